"""Model swaps mid-run: what a model hook (`ModelHook`, e.g. the Dispatch drift valve) returns
after a step, and the train state carried over to the swapped-in model (`swap_model`).

A swap keeps the parameters, optimizer state and data position; fp8 state entries of sites
that keep their delayed-scaling op carry over, new ones start from their initial values. The
swapped-in model must have exactly the running one's parameters (only kernels may change).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.train.state import TrainState, one_example, split_variables


@dataclasses.dataclass(frozen=True)
class ModelSwap:
  """What a model hook returns: the model to continue with (same parameters; None keeps the
  current one) and metrics.jsonl lines to write, each with its "step"."""
  model: Any
  records: Tuple[Mapping[str, Any], ...] = ()


class ModelHook(Protocol):
  """Called by `train` around the run; `ModelSwap` from `after_step` swaps the model."""

  def extras(self) -> Mapping[str, Any]:
    """Entries saved in every checkpoint's extras (JSON or trees of arrays)."""

  def on_restore(self, step: int, extras: Mapping[str, Any]) -> None:
    """The extras of the checkpoint the run resumes from (at `step`)."""

  def after_step(self, step: int, state, step_metrics) -> Optional[ModelSwap]:
    """After step `step` (and the step_callback); None keeps the model.

    A hook may also define `reads_state(step) -> bool`, which a loop running ahead asks
    before `after_step(step)` (from the run's second step on): False promises that
    `after_step(step)` reads no array of `state` and returns no model, so the loop may call
    it after dispatching the next step, with that step's state. A hook without it reads
    every step's state."""


class ModelSwapError(ValueError):
  """A swapped-in model whose parameters differ from the running one's."""


def _shapes(tree) -> Dict[str, Tuple]:
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(tree) if tree else {}, sep="/")
  return {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items()}


def swap_model(state: TrainState, new_model, example_batch, seed: int) -> TrainState:
  """`state` for `new_model`: parameters and optimizer state kept (they must match exactly);
  fp8 state kept where the new model has the same entry, initialized where it is new."""
  init_key = jax.random.split(jax.random.PRNGKey(seed))[0]
  params_key, dropout_key = jax.random.split(init_key)
  rngs = {"params": params_key, "dropout": dropout_key}
  abstract = jax.eval_shape(lambda b: new_model.init(rngs, b, train=False), example_batch)
  new_params, new_meta = split_variables(abstract)
  have, want = _shapes(state.params), _shapes(new_params)
  if have != want:
    diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
    raise ModelSwapError(
        f"the swapped-in model has other parameters than the running one (differences at "
        f"{', '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}); a swap may change kernels "
        "only, never the model's structure")
  if _shapes(state.fp8_meta) == _shapes(new_meta):
    return state
  fresh = {}
  if jax.tree.leaves(new_meta):  # new delayed-scaling entries need their initial values
    init = jax.jit(lambda b: new_model.init(rngs, b, train=False))
    fresh = split_variables(init(one_example(example_batch)))[1]
  old = flax.traverse_util.flatten_dict(flax.core.unfreeze(state.fp8_meta or {}))
  merged = {k: old.get(k, v) if (k in old and np.shape(old[k]) == np.shape(v)) else v
            for k, v in flax.traverse_util.flatten_dict(flax.core.unfreeze(fresh)).items()}
  meta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                      flax.traverse_util.unflatten_dict(merged)) if merged else {}
  return state.replace(fp8_meta=meta)
