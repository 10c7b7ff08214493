"""The training loop: jitted train/eval steps, periodic eval, JSONL metrics, checkpoints,
resume, and non-finite loss handling.

Run directory layout:
  WORKDIR/config.json     the run's settings; a resume with different settings is refused
  WORKDIR/metrics.jsonl   one JSON line per logged step: {"step", "loss", "time", ...} and, at
                          eval steps, held-out "ne", "auc", "logloss"; with
                          `module_norms`, each module's gradient, parameter and update
                          norms and output RMS of the line's last step (module_norms.py)
  WORKDIR/checkpoints/    orbax checkpoints (see checkpoint.py)
  WORKDIR/final.json      held-out ne, auc, logloss + steps, precision, seed (+ oracle_ne),
                          wall-clock "time" and its split ("time_split", this process's:
                          set-up, first step with its compile, evaluation, checkpoints)

`step` counts completed steps, which is also the data position: from step i the loop trains
on `source.train_batch(i, batch_size)` (batch index i) and reaches step i + 1. A line is
written at every log, eval and checkpoint step, and its "loss" is the mean training loss since
the previous line, so a resumed run writes the same lines and final.json as an uninterrupted
one (only the wall-clock fields, `WALL_CLOCK_FIELDS`, differ).

Non-finite losses or gradients (`nan_policy`; a gradient norm that overflows float32 counts
too): the jitted step never applies such an update. 'stop' (default) saves the last good
state, reports the step and the first module (site) whose forward output, or the parameters
whose gradient, is non-finite, and raises NonFiniteError; 'skip' leaves the parameters as they
were, moves on to the next batch and counts the skipped steps (a line with "skipped": true).

Model swaps (`model_hook`, e.g. the Dispatch drift valve): after a step the hook may return a
`ModelSwap` with a new model of the same parameters (another kernel plan). The loop keeps the
parameters, optimizer state, data position and fp8 state (entries of sites that keep their
delayed-scaling op carry over; new ones start from their initial values), rebuilds its
jitted steps once, and writes the swap's records to metrics.jsonl.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from absl import logging

from loka_jax import jsonio
from loka_jax.kernels import FP8_META
from loka_jax.train import metrics as metrics_lib
from loka_jax.train import module_norms as module_norms_lib
from loka_jax.train.checkpoint import Checkpointer
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import (TrainState, abstract_train_state, all_finite,
                                  create_train_state, one_example, split_variables)

NAN_POLICIES = ("stop", "skip")
# Settings a resumed run may change; anything else must match the run directory's config.
# A plan's path ("plan") may change too: what it runs is pinned by "plan_kernels_sha256".
RESUMABLE_SETTINGS = ("steps", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints",
                      "nan_policy", "progress", "plan", "module_norms")
# Fields of metrics lines and final.json that are wall-clock readings: the only ones a resumed
# run may write differently from an uninterrupted one.
WALL_CLOCK_FIELDS = ("time", "steps_per_sec", "time_split")
# Where a run's wall-clock time went (final.json's "time_split", seconds, this process only):
# from entering `train` to its first step (state restore or initialization), the first step
# (its compile), every held-out evaluation and every checkpoint save. The rest of "time" is
# the other steps. A quality run's length paces the next one; this says what it is made of.
TIME_SPLIT_FIELDS = ("setup_s", "first_step_s", "eval_s", "checkpoint_s")


class RunSettingsError(ValueError):
  """A run directory resumed with settings other than its own."""


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
    """After step `step` (and the step_callback); None keeps the model."""


class ModelSwapError(ValueError):
  """A swapped-in model whose parameters differ from the running one's."""


class NonFiniteError(FloatingPointError):
  """A non-finite loss or gradient; `step`, `site` and `checkpoint` say where and what is left."""

  def __init__(self, message: str, step: int, site: Optional[str], checkpoint: Optional[str]):
    super().__init__(message)
    self.step = step
    self.site = site
    self.checkpoint = checkpoint


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop settings (model and data are built by the caller)."""
  steps: int = 200
  batch_size: int = 256
  seed: int = 0                         # parameters and dropout (the source has its own seed)
  eval_every: int = 0                   # steps between held-out evals; 0: only at the end
  eval_batch_size: Optional[int] = None  # None: batch_size
  log_every: int = 50                   # steps between metrics lines
  checkpoint_every: int = 0             # steps between checkpoints; 0: only at the end
  # Checkpoints kept; 0: none is ever written (a run whose state is thrown away once scored,
  # such as a large quality run: Wukong large's final save is 36.6 GB). Such a run resumes
  # from its start, and its final.json alone says it is finished.
  keep_checkpoints: int = 3
  nan_policy: str = "stop"              # 'stop' | 'skip' (see module docstring)
  progress: bool = True                 # tqdm bar on stderr (only when it is a terminal)
  # Log each module's gradient, parameter and update norms and output RMS (module_norms.py)
  # with every metrics line, for reading a loss spike (with log_every=1: every step). Off by
  # default: it adds a forward and three reductions per parameter leaf to the step.
  module_norms: bool = False
  optim: OptimConfig = OptimConfig()

  def __post_init__(self):
    if self.nan_policy not in NAN_POLICIES:
      raise ValueError(f"nan_policy={self.nan_policy!r}; use one of {NAN_POLICIES}")
    for name in ("steps", "eval_every", "log_every", "checkpoint_every"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
    if self.keep_checkpoints < 0:
      raise ValueError(f"keep_checkpoints must be >= 0, got {self.keep_checkpoints}")
    if self.keep_checkpoints == 0 and self.checkpoint_every:
      raise ValueError(f"checkpoint_every={self.checkpoint_every} with keep_checkpoints=0: a "
                       "run that keeps no checkpoint writes none; set checkpoint_every=0")

  @property
  def saves(self) -> bool:
    """Whether the run writes checkpoints at all."""
    return self.keep_checkpoints > 0

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- jitted steps


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
  def train_step(state: TrainState, batch) -> Tuple[TrainState, Dict[str, jax.Array]]:
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
    new = jax.lax.cond(ok, lambda s: s.apply_gradients(tx, grads, fp8_grads),
                       lambda s: s.replace(step=s.step + bad_step), state)
    metrics = {"loss": loss, "ok": ok, "grad_norm": grad_norm}
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


# ----------------------------------------------------------------------------- files


def _write_json_atomic(path: str, value) -> None:
  jsonio.write_json_atomic(path, value, sort_keys=True)


class MetricsWriter:
  """Appends JSON lines to metrics.jsonl; on resume drops lines past the restored step (and a
  torn last line left by a killed run)."""

  def __init__(self, path: str, resume_step: int):
    self.path = path
    kept = []
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            record = json.loads(line)
          except json.JSONDecodeError:
            continue
          if isinstance(record, dict) and record.get("step", math.inf) <= resume_step:
            kept.append(json.dumps(record, sort_keys=True))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      f.writelines(line + "\n" for line in kept)
    os.replace(tmp, path)
    self._file = open(path, "a")

  def write(self, record: Mapping[str, Any]) -> None:
    self._file.write(json.dumps(metrics_lib.json_safe(record), sort_keys=True) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def read_metrics(path: str):
  """The records of a metrics.jsonl file."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _check_run_config(workdir: str, settings: Mapping[str, Any]) -> None:
  """Writes config.json, or checks a resumed run's settings against it."""
  path = os.path.join(workdir, "config.json")
  settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
  if os.path.exists(path):
    old = jsonio.read_json(path, "run settings (config.json)", "restore it from a copy or use "
                           "a new --workdir", RunSettingsError)

    def flat(d, prefix=""):
      out = {}
      for k, v in d.items():
        if isinstance(v, dict):
          out.update(flat(v, f"{prefix}{k}."))
        else:
          out[f"{prefix}{k}"] = v
      return out

    old_flat, new_flat = flat(old), flat(settings)
    diffs = [f"{k}: {old_flat.get(k)!r} -> {new_flat.get(k)!r}"
             for k in sorted(set(old_flat) | set(new_flat))
             if k.split(".")[-1] not in RESUMABLE_SETTINGS and old_flat.get(k) != new_flat.get(k)]
    if diffs:
      raise RunSettingsError(f"run directory {workdir} holds a run with other settings ("
                       + "; ".join(diffs) + "); resume with the same settings or use a new "
                       "--workdir")
  _write_json_atomic(path, settings)


def restore_run(workdir: str, model, source, config: TrainConfig, array_extras: bool = True
                ) -> Optional[Tuple[TrainState, Dict[str, Any]]]:
  """(state, extras) of the newest good checkpoint of the run in `workdir`, or None.

  The template is abstract (shapes, dtypes and the device): a concrete one would hold a second
  copy of the state on the device while the checkpoint is read (Wukong large: 50 GiB more).
  `array_extras=False` leaves array extras such as probe statistics unread.
  """
  template = abstract_train_state(model, make_optimizer(config.optim),
                                  source.train_batch(0, config.batch_size), config.seed)
  with Checkpointer(os.path.join(workdir, "checkpoints"),
                    keep=max(config.keep_checkpoints, 1)) as ckpt:
    return ckpt.restore(template, array_extras)


# ----------------------------------------------------------------------------- model swap


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


# ----------------------------------------------------------------------------- the loop


class _Window:
  """Mean and worst training loss (and speed) over the steps since the previous metrics line.
  The worst step is kept because a mean hides a spike: DCNv2 `large`'s bf16+Mods run whose
  loss jumped to 5.7 logged only window means (docs/BENCHMARKS.md, thirty-third session)."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.loss_sum, self.steps, self.start = 0.0, 0, time.perf_counter()
    self.max_loss = -math.inf

  def add(self, loss: float):
    self.loss_sum += loss
    self.steps += 1
    self.max_loss = max(self.max_loss, loss)

  def record(self, step: int, elapsed: float, grad_norm: float) -> Dict[str, Any]:
    seconds = max(time.perf_counter() - self.start, 1e-9)
    return {"step": step, "loss": self.loss_sum / self.steps if self.steps else math.nan,
            "max_loss": self.max_loss if self.steps else math.nan,
            "time": elapsed, "steps_per_sec": self.steps / seconds, "grad_norm": grad_norm}


def _note_peak(loop_extras: Dict[str, Any], loss: float, step: int) -> None:
  """Keeps the run's worst finite step (`peak_loss` at `peak_step`) in the loop's checkpointed
  extras, so a resumed run reports the worst step of the whole run, not of its last part."""
  if loss > loop_extras.get("peak_loss", -math.inf):
    loop_extras["peak_loss"], loop_extras["peak_step"] = loss, step


def _final_record(evaluation: Mapping[str, Any], step: int, config: TrainConfig,
                  run_info: Mapping[str, Any], source, loop_extras: Mapping[str, Any],
                  elapsed: float, time_split: Mapping[str, Optional[float]]):
  final = {"ne": evaluation["ne"], "auc": evaluation["auc"], "logloss": evaluation["logloss"],
           "base_ctr": evaluation["base_ctr"], "num_eval_examples": evaluation["num_examples"],
           "steps": step, "precision": run_info.get("precision"),
           "seed": run_info.get("seed", config.seed),
           "skipped_steps": loop_extras["skipped_steps"], "time": elapsed,
           "time_split": {k: time_split[k] for k in TIME_SPLIT_FIELDS
                          if time_split.get(k) is not None}}
  # A run resumed from a checkpoint written before the loop kept its worst step reports none:
  # the steps before the checkpoint are not in it.
  if "peak_loss" in loop_extras and not loop_extras.get("peak_unknown"):
    final["peak_loss"] = float(loop_extras["peak_loss"])
    final["peak_step"] = int(loop_extras["peak_step"])
  if getattr(source, "oracle_ne", None) is not None:
    final["oracle_ne"] = float(source.oracle_ne)
  final.update({k: v for k, v in run_info.items() if k not in final})
  return metrics_lib.json_safe(final)


def _finished_record(final_path: str, latest_step: Optional[int], steps: int,
                     saves: bool = True) -> Optional[Dict[str, Any]]:
  """final.json of a run that is finished at `steps` (its newest checkpoint is that step and
  final.json describes it; a run that `saves` no checkpoint has final.json alone), else None.
  An unreadable final.json is not a finished run: the loop restores, evaluates and writes it
  again."""
  if (saves and latest_step != steps) or not os.path.exists(final_path):
    return None
  try:
    with open(final_path) as f:
      final = json.load(f)
  except (OSError, ValueError):
    return None
  return final if isinstance(final, dict) and final.get("steps") == steps else None


def train(model, source, workdir: str, config: TrainConfig, *,
          run_info: Optional[Mapping[str, Any]] = None,
          extras: Optional[Mapping[str, Any]] = None,
          step_callback: Optional[Callable[[int, TrainState, Dict], None]] = None,
          model_hook: Optional[ModelHook] = None) -> Dict[str, Any]:
  """Trains `model` on `source` to `config.steps`, resuming from `workdir` if it holds a run.

  Args:
    model: Linen module, `model.apply(variables, batch, train=...)` -> float32 logits [B].
    source: a DataSource (loka_jax.data.sources).
    workdir: run directory (created).
    config: loop settings.
    run_info: what identifies the run (model, preset, precision, data, ...); goes into
      config.json and final.json, which also gets `precision` and `seed` from here.
    extras: saved in every checkpoint (see checkpoint.py), e.g. the active plan; the key
      "loop" is the loop's own (skipped steps, elapsed time, worst step).
    step_callback: called after each completed step as f(step, state, step_metrics); the
      state's buffers are reused by the next step, so copy (device_get) what you keep.
    model_hook: may swap the model mid-run (see the module docstring and `ModelHook`); its
      `extras()` are saved in every checkpoint and handed back by `on_restore` on resume.
  Returns:
    the final.json dict; a run already finished at `config.steps` returns it as recorded,
    reading no state.
  Raises:
    NonFiniteError (nan_policy='stop'), RunSettingsError, CheckpointError.
  """
  entered = time.perf_counter()
  time_split = {"eval_s": 0.0, "checkpoint_s": 0.0}
  run_info = dict(run_info or {})
  os.makedirs(workdir, exist_ok=True)
  _check_run_config(workdir, {"run": run_info, "train": config.to_dict()})
  train_step, eval_step = compiled_steps(model, config.optim, config.nan_policy,
                                         config.module_norms)
  eval_batch_size = min(config.eval_batch_size or config.batch_size, source.num_eval_examples())

  first_batch = source.train_batch(0, config.batch_size)
  tx = make_optimizer(config.optim)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                              keep=max(config.keep_checkpoints, 1))
  final_path = os.path.join(workdir, "final.json")
  finished = _finished_record(final_path, checkpointer.latest_step(), config.steps,
                              config.saves)
  if finished is not None:  # nothing to train, evaluate or save: no state is read
    logging.info("%s already finished at step %d", workdir, finished["steps"])
    return finished
  # Restore into an abstract template; only a fresh run materializes an initial state. The
  # array extras of the checkpoint (a probe's statistics) are the caller's: it passes the
  # current ones in `extras`, and reading them here would hold a second copy on the device.
  # Only a model hook, whose extras the loop hands back, may want them.
  restored = checkpointer.restore(abstract_train_state(model, tx, first_batch, config.seed),
                                  array_extras=model_hook is not None)
  state, saved = (restored if restored is not None else
                  (create_train_state(model, tx, first_batch, config.seed), {}))
  loop_extras = dict(saved.get("loop", {"skipped_steps": 0, "elapsed_s": 0.0}))
  start = int(jax.device_get(state.step))
  if restored is not None:
    logging.info("resuming %s from step %d", workdir, start)
    if start > 0 and "peak_loss" not in loop_extras:  # saved before the worst step was kept
      loop_extras["peak_unknown"] = True
    if model_hook is not None:
      model_hook.on_restore(start, saved)
  writer = MetricsWriter(os.path.join(workdir, "metrics.jsonl"), resume_step=start)
  if start < config.steps and os.path.exists(final_path):
    os.remove(final_path)  # a final.json always describes a finished run
  t0 = time.perf_counter() - loop_extras["elapsed_s"]
  time_split["setup_s"] = time.perf_counter() - entered
  window, last_eval, grad_norm = _Window(), None, math.nan

  def save():
    began = time.perf_counter()
    loop_extras["elapsed_s"] = began - t0
    hook_extras = dict(model_hook.extras()) if model_hook is not None else {}
    saved = checkpointer.save(state, {**(extras or {}), **hook_extras, "loop": loop_extras})
    time_split["checkpoint_s"] += time.perf_counter() - began
    return saved

  def timed_evaluate():
    began = time.perf_counter()
    result = evaluate(eval_step, state, source, eval_batch_size)
    time_split["eval_s"] += time.perf_counter() - began
    return result

  bar = tqdm.tqdm(total=config.steps, initial=start, file=sys.stderr, dynamic_ncols=True,
                  disable=None if config.progress else True,
                  desc=os.path.basename(os.path.normpath(workdir)))
  try:
    batch = first_batch if start == 0 else source.train_batch(start, config.batch_size)
    for i in range(start, config.steps):
      began = time.perf_counter()
      state, step_metrics = train_step(state, batch)
      # Build the next batch on the host while the device runs this step.
      next_batch = (source.train_batch(i + 1, config.batch_size) if i + 1 < config.steps
                    else None)
      step_metrics = jax.device_get(step_metrics)
      if i == start:
        time_split["first_step_s"] = time.perf_counter() - began
      done = i + 1
      if step_metrics["ok"]:
        window.add(float(step_metrics["loss"]))
        _note_peak(loop_extras, float(step_metrics["loss"]), done)
        grad_norm = float(step_metrics["grad_norm"])
      else:
        site = locate_non_finite(model, state, batch, i)
        message = (f"non-finite loss/gradient (loss={float(step_metrics['loss'])}) in training "
                   f"step {done} (batch index {i})"
                   + (f"; first non-finite value at {site}" if site else ""))
        writer.write({"step": done, "error": message,
                      **({"skipped": True} if config.nan_policy == "skip" else {})})
        if config.nan_policy == "skip":
          loop_extras["skipped_steps"] += 1
          logging.warning("%s; skipped it (nan_policy='skip')", message)
        else:
          # The state before the bad step is the last good one, unless an earlier update
          # already overflowed the parameters (then the last checkpoint is).
          if all_finite(state.params) and config.saves:
            save()
          latest = checkpointer.latest_step()
          where = None if latest is None else os.path.join(checkpointer.directory, str(latest))
          raise NonFiniteError(
              f"{message}. Training stopped (nan_policy='stop'); the last good checkpoint is "
              f"{where or 'none (no good state was saved)'}. Lower the learning rate, check "
              "the data, or rerun with --nan_policy=skip to skip such steps.",
              step=done, site=site, checkpoint=where)
      bar.update(1)

      is_eval = (config.eval_every and done % config.eval_every == 0) or done == config.steps
      is_ckpt = config.saves and ((config.checkpoint_every
                                   and done % config.checkpoint_every == 0)
                                  or done == config.steps)
      if (config.log_every and done % config.log_every == 0) or is_eval or is_ckpt:
        record = window.record(done, time.perf_counter() - t0, grad_norm)
        if step_metrics["ok"]:  # the norms of the line's last step, as its grad_norm is
          record.update({k: {m: float(v) for m, v in step_metrics[k].items()}
                         for k in module_norms_lib.KINDS if k in step_metrics})
        if is_eval:
          last_eval = (done, timed_evaluate())
          record.update({k: last_eval[1][k] for k in ("ne", "auc", "logloss")})
        writer.write(record)
        logging.info("step %d: %s", done, {k: round(v, 5) if isinstance(v, float) else v
                                           for k, v in record.items()
                                           if k != "step" and k not in module_norms_lib.KINDS})
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        if is_ckpt:
          save()
        window.reset()  # after the save, which the next line's steps_per_sec must not count
      if step_callback is not None:
        step_callback(done, state, step_metrics)
      swap = model_hook.after_step(done, state, step_metrics) if model_hook is not None else None
      if swap is not None and swap.model is not None:
        state = swap_model(state, swap.model, first_batch, config.seed)
        model = swap.model
        train_step, eval_step = compiled_steps(model, config.optim, config.nan_policy,
                                               config.module_norms)
      for record in (swap.records if swap is not None else ()):
        writer.write(record)
      batch = next_batch

    final_step = int(jax.device_get(state.step))
    if last_eval is None or last_eval[0] != final_step:  # e.g. resumed at the end
      last_eval = (final_step, timed_evaluate())
    if config.saves:
      save()
    final = _final_record(last_eval[1], final_step, config, run_info, source, loop_extras,
                          time.perf_counter() - t0, time_split)
    _write_json_atomic(final_path, final)
    return final
  finally:
    bar.close()
    writer.close()
    checkpointer.close()
