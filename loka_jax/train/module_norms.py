"""Per-module norms of a parameter tree: where in the model a gradient or an update grew.

A run's global gradient norm says that a step went wrong, not where. A training loss spike
(DCNv2 `large` with No Bias and Hard Swish, on an H200) is read by logging, every step, the
norm of each module's gradient, parameters and update and the RMS of its output, and asking
which module left its recent range first (`loka_jax.train.spikes`).

A module is the path of a parameter leaf without its last key: `top_mlp/dense_0/kernel` and
`top_mlp/dense_0/bias` both belong to `top_mlp/dense_0`; a leaf at the top of the tree is its
own module.
"""
from __future__ import annotations

from typing import Any, Dict, List

import jax
import jax.numpy as jnp

# The metrics keys the training loop writes with `TrainConfig.module_norms`: the step's
# gradient, the parameters after the step, and the step's update (new minus old parameters),
# each a norm over a module's parameters; and the RMS of each module's output in the step's
# forward (every module, parameter-free ones such as a DCNv2 cross layer included).
GRAD, PARAM, UPDATE = "module_grad_norms", "module_param_norms", "module_update_norms"
OUTPUT = "module_output_rms"
KINDS = (GRAD, PARAM, UPDATE, OUTPUT)
ROOT = "<model>"  # the whole model's output (the logits) in OUTPUT


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def module_of(path) -> str:
  """The module a leaf at `path` (a tree_util key path) belongs to."""
  names = [_key_name(k) for k in path]
  return "/".join(names[:-1]) or names[-1]


def module_norms(tree: Any) -> Dict[str, jax.Array]:
  """{module: float32 L2 norm over the module's leaves}; traceable, so a jitted step can
  return it."""
  squares: Dict[str, List[jax.Array]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    squares.setdefault(module_of(path), []).append(
        jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32))))
  return {name: jnp.sqrt(sum(parts)) for name, parts in squares.items()}


def step_norms(grads: Any, old_params: Any, new_params: Any) -> Dict[str, Dict[str, jax.Array]]:
  """The three per-module norms of one training step, keyed as the metrics lines are."""
  update = jax.tree_util.tree_map(
      lambda new, old: jnp.asarray(new, jnp.float32) - jnp.asarray(old, jnp.float32),
      new_params, old_params)
  return {GRAD: module_norms(grads), PARAM: module_norms(new_params),
          UPDATE: module_norms(update)}


def output_rms(model, variables, batch, rng) -> Dict[str, jax.Array]:
  """{module: float32 RMS of its output} over a training-mode forward of `batch` (dropout
  key `rng`, as the step's own forward). A module called more than once, or returning a
  tuple, gets one entry per output: `name#i` past the first."""
  _, state = model.apply(variables, batch, train=True, rngs={"dropout": rng},
                         capture_intermediates=True, mutable=["intermediates"])
  out: Dict[str, jax.Array] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]:
    names = [_key_name(k) for k in path]
    if "__call__" not in names or not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
      continue
    at = names.index("__call__")
    module = "/".join(names[:at]) or ROOT
    rest = [n for n in names[at + 1:] if n != "0"]
    name = module + (f"#{'.'.join(rest)}" if rest else "")
    out[name] = jnp.sqrt(jnp.mean(jnp.square(jnp.asarray(leaf, jnp.float32))))
  return out
