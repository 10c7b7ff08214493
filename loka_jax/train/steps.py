"""The jitted train and eval steps, the loss they minimize, held-out evaluation, and where a
non-finite value of a step first appears.

The train step never applies a non-finite update: a non-finite loss or gradient norm (one that
overflows float32 counts too) leaves the parameters as they were; with nan_policy 'stop' the
step does not advance, with 'skip' it moves the data position on (see loop.py).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from loka_jax.kernels import FP8_META
from loka_jax.train import metrics as metrics_lib
from loka_jax.train import module_norms as module_norms_lib
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import TrainState


def step_rng(state: TrainState, step) -> jax.Array:
  """The dropout key of step `step`: a pure function of the run's key and the step."""
  return jax.random.fold_in(state.rng, step)


def loss_fn(model, params, fp8_meta, batch, rng, extra_variables=None):
  """(mean log loss, logits) of a training-mode forward: the loss every step minimizes.
  `extra_variables`: other collections the model reads (validation's site switches)."""
  variables = {"params": params, **(extra_variables or {})}
  if fp8_meta:
    variables[FP8_META] = fp8_meta
  logits = model.apply(variables, batch, train=True, rngs={"dropout": rng})
  return jnp.mean(metrics_lib.bce_with_logits(logits, batch["label"])), logits


def _build_train_step(model, tx: optax.GradientTransformation, nan_policy: str,
                      module_norms: bool = False):
  def train_step(state: TrainState, batch, halted=None
                 ) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """One step. `halted` (a device bool, optional): an earlier step still unread by the
    host was non-finite, so this one changes nothing; the metrics then carry `halted` for
    the next step (the loop's run-ahead, loop.py). Without it the program has no such
    input or output."""
    grad_fn = jax.value_and_grad(lambda p, f: loss_fn(model, p, f, batch,
                                                       step_rng(state, state.step)),
                                 argnums=(0, 1), has_aux=True)
    (loss, _), (grads, fp8_grads) = grad_fn(state.params, state.fp8_meta)
    # The norm is non-finite iff some gradient is (or their squares overflow float32, a fault
    # too); one reduction compiles much faster than a check per leaf.
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # Never apply a non-finite update; 'skip' still advances the data position.
    bad_step = 0 if nan_policy == "stop" else 1
    apply = ok if halted is None else ok & ~halted
    advance = bad_step if halted is None else jnp.where(halted, 0, bad_step)
    new = jax.lax.cond(apply, lambda s: s.apply_gradients(tx, grads, fp8_grads),
                       lambda s: s.replace(step=s.step + advance), state)
    metrics = {"loss": loss, "ok": ok, "grad_norm": grad_norm}
    if halted is not None:
      metrics["halted"] = halted | ~ok
    if module_norms:  # the outputs from a second forward: the step's own is inside its grad
      metrics.update(module_norms_lib.step_norms(grads, state.params, new.params))
      metrics[module_norms_lib.OUTPUT] = module_norms_lib.output_rms(
          model, state.variables(), batch, step_rng(state, state.step))
    return new, metrics

  return jax.jit(train_step, donate_argnums=0)  # the old state is never needed again


def _build_eval_step(model):
  def eval_step(state: TrainState, batch) -> jax.Array:
    return model.apply(state.variables(), batch, train=False).astype(jnp.float32)
  return jax.jit(eval_step)


_STEP_CACHE: Dict[Any, Tuple[Callable, Callable]] = {}


def compiled_steps(model, optim: OptimConfig, nan_policy: str, module_norms: bool = False):
  """(train_step, eval_step) jitted for `model`; equal models and settings share one
  compilation within a process (tests build the same tiny model many times). With
  `module_norms` the train step's metrics also hold each module's norms (module_norms.py)."""
  key = (model, optim, nan_policy, module_norms)
  try:
    hit = _STEP_CACHE.get(key)
  except TypeError:  # an unhashable model config: no sharing
    key, hit = None, None
  if hit is None:
    hit = (_build_train_step(model, make_optimizer(optim), nan_policy, module_norms),
           _build_eval_step(model))
    if key is not None:
      _STEP_CACHE[key] = hit
  return hit


# ----------------------------------------------------------------------------- diagnosis


def _non_finite_fields(batch) -> list:
  return [f"input field {k!r}" for k, v in batch.items()
          if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()]


def locate_non_finite(model, state: TrainState, batch, step: int) -> Optional[str]:
  """Where a non-finite value first appears in step `step`: an input field, the first module
  (site) whose forward output is non-finite, or the parameters with non-finite gradients."""
  bad_inputs = _non_finite_fields(batch)
  if bad_inputs:
    return ", ".join(bad_inputs)

  def finite_outputs(variables, batch, rng):
    _, inter = model.apply(variables, batch, train=True, rngs={"dropout": rng},
                           capture_intermediates=True, mutable=["intermediates"])
    return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x.astype(jnp.float32)))
                        if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.asarray(True),
                        inter["intermediates"])

  rng = step_rng(state, step)
  flags = jax.device_get(jax.jit(finite_outputs)(state.variables(), batch, rng))
  bad = [path[:-1] for path, values in flax.traverse_util.flatten_dict(flags).items()
         if not all(bool(v) for v in jax.tree.leaves(values))]
  # A fault spreads to every enclosing module and to later layers; report the first module
  # (in creation order, which follows the call order) none of whose submodules is at fault.
  innermost = [p for p in bad if not any(len(q) > len(p) and q[:len(p)] == p for q in bad)]
  if innermost:
    module = "/".join(str(p) for p in innermost[0])
    return f"site/module {module!r} (forward output)" if module else "the model output"

  grads = jax.grad(lambda p, f: loss_fn(model, p, f, batch, rng)[0], argnums=(0, 1))
  g_params, g_fp8 = jax.device_get(jax.jit(grads)(state.params, state.fp8_meta))
  bad = ["/".join(str(p) for p in path)
         for path, g in flax.traverse_util.flatten_dict({"params": g_params, "fp8_meta": g_fp8}
                                                        ).items()
         if not np.isfinite(np.asarray(g, np.float32)).all()]
  if bad:
    more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
    return "gradient of " + ", ".join(bad[:5]) + more
  return None


# ----------------------------------------------------------------------------- evaluation


def evaluate(eval_step, state: TrainState, source, batch_size: int, *,
             keep_scores: bool = False) -> Dict[str, Any]:
  """Held-out logloss, NE, AUC over `source.eval_batches`, streamed batch by batch; with
  `keep_scores`, also every example's logit and label ('logits', 'labels': arrays), for
  paired comparisons of two models on the same examples."""
  acc = metrics_lib.EvalAccumulator()
  pending = None  # the batch on the device: its scores are read after the next is dispatched
  for batch in source.eval_batches(batch_size):
    valid = len(batch["label"])
    if valid < batch_size:  # pad a short batch so the step compiles once
      batch = {k: np.concatenate([v, np.repeat(v[:1], batch_size - valid, axis=0)])
               for k, v in batch.items()}
    # Dispatch this batch before reading the last one's scores, so the host builds the next
    # batch while the device scores this one (InterFormer `large`: 392 batches of 512).
    scores = eval_step(state, batch)
    if pending is not None:
      acc.add(jax.device_get(pending[0]), pending[1], valid=pending[2])
    pending = (scores, batch["label"], valid)
  if pending is not None:
    acc.add(jax.device_get(pending[0]), pending[1], valid=pending[2])
  if acc.count == 0:
    raise ValueError(f"data source {source.name!r} yielded no eval batch of size {batch_size} "
                     f"({source.num_eval_examples()} eval examples); lower the eval batch size")
  result = acc.result()
  if keep_scores:
    result["logits"], result["labels"] = acc.scores()
  return result
