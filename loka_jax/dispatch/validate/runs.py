"""The training checks' runs: `steps` training steps of a plan from the checkpoint or from
a fresh initialization (`shadow_run`), what a check judges of one (`run_summary`), and each
run recorded under its arm and recipe as it finishes (`_training_runs`), so a call that
stops mid-round does not train it again."""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.plan.file import Plan
from loka_jax.dispatch.validate.config import BASELINE, ValidationContext
from loka_jax.dispatch.validate.records import (Progress, matching_records, run_step,
                                                take_in_turn)
from loka_jax.dispatch.validate.state import (_fresh_copy, held_out, model_and_meta,
                                              working_state)
from loka_jax.kernels import KernelPlan
from loka_jax.train.loop import compiled_steps
from loka_jax.train.metrics import calibration
from loka_jax.train.optim import OptimConfig, restart_schedules


# Where a training run starts: the context's trained state, or a fresh initialization.
CHECKPOINT, INIT = "checkpoint", "init"


@functools.partial(jax.jit, donate_argnums=0)
def _jitter(tree, key, rel):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      (x * (1 + rel * jax.random.normal(k, x.shape, jnp.float32))).astype(x.dtype)
      for x, k in zip(leaves, keys)])


def jittered(params, rel: float, seed: int):
  """`params` with each value times (1 + u), u ~ N(0, rel^2) drawn from `seed` (a key per
  leaf), in each leaf's dtype. The input's buffers are donated: the caller's copy is gone.
  One compiled program serves every window and jitter."""
  return _jitter(params, jax.random.PRNGKey(seed), jnp.float32(rel))


def shadow_run(ctx: ValidationContext, kplan: KernelPlan, steps: int, eval_batch_size=None,
               start: str = CHECKPOINT, seed: int = 0,
               optim: Optional[OptimConfig] = None, window: int = 0,
               jitter: float = 0.0, warmup_after_switch: int = 0) -> Dict[str, Any]:
  """`steps` training steps under `kplan`: losses, finiteness and the held-out metrics at the
  end (cached per plan). `start`: CHECKPOINT, the context's trained state and the batches
  from `window` x `steps` after it; INIT, a fresh initialization from `seed`
  (`initial_state`) and the data from its start. `optim`: the optimizer (None: the
  context's, the probe's recipe). `jitter` > 0 (from the checkpoint only): the parameters
  start `jittered` by that relative std, drawn from `seed` (the shadow check's noise floor).
  `warmup_after_switch` > 0 (from the checkpoint only): both learning rates warm up linearly
  from 0 over that many steps after the switch (`restart_schedules`; the shadow check's
  `shadow_warmup_steps`)."""
  if start not in (CHECKPOINT, INIT):
    raise ValueError(f"start={start!r}; use {CHECKPOINT!r} or {INIT!r}")
  if warmup_after_switch < 0 or (warmup_after_switch and start == INIT):
    raise ValueError(f"warmup_after_switch={warmup_after_switch}: a warm-up (>= 0) after "
                     "switching the checkpoint's state to the plan; from initialization the "
                     "optimizer's own warm-up applies")
  if window < 0 or (window and start == INIT):
    raise ValueError(f"window={window}: a data window (>= 0) is a run from the checkpoint's")
  if jitter < 0 or (jitter and start == INIT):
    raise ValueError(f"jitter={jitter}: a jitter (>= 0) perturbs the checkpoint's parameters")
  optim = optim or ctx.optim
  if warmup_after_switch:
    optim = dataclasses.replace(optim, warmup_steps=warmup_after_switch)
  key = ("shadow", kplan, steps, eval_batch_size, start, seed, optim, window, jitter,
         warmup_after_switch)
  if key in ctx._cache:
    return ctx._cache[key]
  model, meta = model_and_meta(ctx, kplan)  # also before the state leaves the device
  bf16_meta = model_and_meta(ctx, BASELINE)[1]   # for the plan's bf16+Mods reading below
  train_step, _ = compiled_steps(model, optim, "stop")
  if start == INIT:
    batch = lambda i: ctx.source.train_batch(i, ctx.batch_size)
  else:
    batch, meta = (lambda i: ctx.batch(window * steps + i)), _fresh_copy(meta)
  with working_state(ctx) as state:
    if start == INIT:
      _free(state)  # the trained state's device copy: the backup puts it back afterwards
      state = initial_state(ctx, kplan, seed, optim)
    else:
      state = state.replace(fp8_meta=meta)
      if warmup_after_switch:
        state = state.replace(opt_state=restart_schedules(state.opt_state))
      if jitter:
        state = state.replace(params=jittered(state.params, jitter, seed))
    losses, oks = [], []
    for i in range(steps):
      state, m = train_step(state, batch(i))
      losses.append(m["loss"])
      oks.append(m["ok"])
    losses = np.asarray(jax.device_get(losses), np.float64)
    finite = bool(np.all(jax.device_get(oks))) and bool(np.all(np.isfinite(losses)))
    final = held_out(ctx, kplan, eval_batch_size, state=state) if finite else None
    out = {"losses": losses, "finite": finite, "held_out": final}
    if finite and kplan != BASELINE:
      # The same trained parameters through bf16+Mods' forwards: whether the plan's held-out
      # change comes from how it trained or from its FP8 forwards at the end (a Wukong
      # `large` shadow round read held-out +1.2% with the training loss 0.07% below
      # bf16+Mods').
      out["held_out_bf16_forward"] = held_out(ctx, BASELINE, eval_batch_size,
                                              state=state.replace(fp8_meta=bf16_meta))
    del state
  ctx._cache[key] = out
  return out


BASELINE_ARM, PLAN_ARM, NOISE_ARM = "bf16_mods", "plan", "bf16_mods_jittered"


# Steps per point of a training run's recorded loss curve (`loss_curve`).
CURVE_EVERY = 25


def loss_curve(losses, every: int = CURVE_EVERY) -> List[Optional[float]]:
  """Mean training loss over each block of `every` consecutive steps (the last block may be
  shorter), rounded to 6 digits; None for a block with a non-finite step (JSON has no NaN)."""
  if every < 1:
    raise ValueError(f"every={every}: a block is at least one step")
  losses = np.asarray(losses, np.float64)
  blocks = (losses[i:i + every] for i in range(0, losses.size, every))
  return [round(float(b.mean()), 6) if np.all(np.isfinite(b)) else None for b in blocks]


def run_summary(run: Mapping[str, Any], window: int) -> Dict[str, Any]:
  """What the training checks judge of a `shadow_run`: whether it stayed finite, its mean
  loss over the last `window` steps, its worst step's loss and its held-out log loss (None
  where not finite: JSON has no NaN), with its held-out AUC and calibration where the scores
  were kept; a plan's run also its parameters' held-out log loss through bf16+Mods' forwards.
  AUC and calibration tell a worse ranking from a shifted mean prediction, which an early,
  barely learning state's log loss mostly is (Wukong `large`: AUC 0.519 at the probe's
  state). Its `loss_curve` tells when a run left a plateau: Wukong `large`'s runs sit near
  0.564 from about step 100 and leave it between steps 100 and 350 by seed, plan and
  warm-up, so a run judged on its last steps while still on it reads as stalled."""
  finite = bool(run["finite"])
  losses = run["losses"]
  out = {"finite": finite,
         "window_loss": float(np.mean(losses[-window:])) if finite else None,
         "peak_loss": float(np.max(losses)) if finite else None,
         "logloss": float(run["held_out"]["logloss"]) if finite else None,
         "loss_curve": loss_curve(losses)}
  if finite and "logits" in run["held_out"]:
    out.update(auc=float(run["held_out"]["auc"]),
               calibration=calibration(run["held_out"]["logits"], run["held_out"]["labels"]))
  if finite and run.get("held_out_bf16_forward") is not None:
    out["logloss_bf16_forward"] = float(run["held_out_bf16_forward"]["logloss"])
  return out


def _training_runs(plan: Plan, ctx: ValidationContext, progress: Progress, step: str, arm: str,
                   kplan: KernelPlan, seeds: Sequence[int], recipe: Mapping[str, Any],
                   eval_batch_size, optim: Optional[OptimConfig]
                   ) -> Tuple[Plan, List[Dict[str, Any]]]:
  """(plan, one `run_summary` per seed) of `arm`'s training runs under `recipe` (steps, start,
  window, warm-up, and for the plan's arm its FP8 sites' kernels), each read from a `step`
  run record the plan holds or run now and recorded at once (`take_in_turn`). A check's runs
  are its cost (six 500-step runs a round at DCNv2 `large` with three seeds), so a call that
  stops mid-round, or while the round's sites are measured, keeps them: the next call takes
  the round's verdict from the records instead of training again."""
  fields = {"arm": arm, **recipe}
  def saved(p: Plan) -> Dict[int, Dict[str, Any]]:
    return {r["seed"]: r for r in matching_records(p, run_step(step), fields)}
  def measure(seed: int) -> Dict[str, Any]:
    # From the checkpoint each seed is a data window (`shadow_windows`), the first window 0.
    window = seeds.index(seed) if recipe["start"] == CHECKPOINT else 0
    return run_summary(shadow_run(ctx, kplan, recipe["steps"], eval_batch_size,
                                  recipe["start"], seed, optim, window,
                                  recipe.get("jitter", 0.0),
                                  warmup_after_switch=recipe.get("warmup_after_switch", 0)),
                       recipe["window"])
  have = saved(plan)
  pending = [(f"the {step} check's {arm} run, seed {seed}", {**fields, "seed": seed},
              functools.partial(measure, seed)) for seed in seeds if seed not in have]
  # A run's program is its arm and recipe: its other seeds (data windows) rerun it warm.
  plan = take_in_turn(plan, progress, run_step(step), pending,
                      lambda f: json.dumps({k: v for k, v in f.items() if k != "seed"},
                                           sort_keys=True))
  have = saved(plan)
  return plan, [have[seed] for seed in seeds]


def _free(tree) -> None:
  """Deletes the device buffers of `tree` (a state `working_state` holds a backup of)."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()


def initial_state(ctx: ValidationContext, kplan: KernelPlan, seed: int,
                  optim: Optional[OptimConfig] = None):
  """A fresh TrainState of `kplan`'s model, as training from scratch starts: parameters and
  optimizer state (of `optim`, default the context's) from `seed`, delayed-scaling state at
  its initial values. Every plan's
  parameters must equal bf16+Mods' (a plan changes kernels, never weights): once bf16+Mods'
  state was made (the checks make it first), a sum of each parameter checks it."""
  from loka_jax.train.optim import make_optimizer
  from loka_jax.train.state import create_train_state
  model = model_and_meta(ctx, kplan)[0]
  state = create_train_state(model, make_optimizer(optim or ctx.optim),
                             ctx.source.train_batch(0, 1), seed)
  sums = jax.device_get(jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32)), state.params))
  key = ("init_param_sums", seed)
  if kplan == BASELINE:
    ctx._cache[key] = sums
  elif key in ctx._cache and not jax.tree.all(jax.tree.map(
      lambda a, b: bool(np.array_equal(a, b)), sums, ctx._cache[key])):
    raise ValueError("the planned model initializes other parameters than bf16+Mods from the "
                     "same seed; a plan may change kernels only")
  return state
