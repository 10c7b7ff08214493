"""The training loop (`train`): steps, periodic held-out evaluation, JSONL metrics,
checkpoints, resume, non-finite loss handling and model swaps. Its parts live beside it, and
their names are importable from here as well: the jitted steps, the loss and evaluation in
steps.py, the run directory's files and records in run_files.py, model swaps in swap.py.

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

Run-ahead (`TrainConfig.run_ahead`): a step's metrics are read after the next step is
dispatched, unless what follows the step reads its state (evaluation, checkpoint; every step
of a run with a step callback, and the steps a model hook's `reads_state` names). The step
dispatched ahead takes `halted` from the one before it and, once a step in flight was
non-finite, changes nothing: 'stop' raises with the state before
the bad step, 'skip' dispatches that step again. No number changes.

Model swaps (`model_hook`, e.g. the Dispatch drift valve): after a step the hook may return a
`ModelSwap` with a new model of the same parameters (another kernel plan). The loop keeps the
parameters, optimizer state, data position and fp8 state (entries of sites that keep their
delayed-scaling op carry over; new ones start from their initial values), rebuilds its
jitted steps once, and writes the swap's records to metrics.jsonl.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import numpy as np
import tqdm
from absl import logging

from loka_jax.train import prefetch as prefetch_lib
from loka_jax.train import module_norms as module_norms_lib
from loka_jax.train import steps as steps_lib
from loka_jax.train.checkpoint import Checkpointer
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.run_files import (RESUMABLE_SETTINGS, TIME_SPLIT_FIELDS, WALL_CLOCK_FIELDS,
                                      LossWindow, MetricsWriter, RunSettingsError,
                                      check_run_config, final_record, finished_record,
                                      note_peak, read_metrics, write_json_atomic)
from loka_jax.train.state import (TrainState, abstract_train_state, all_finite,
                                  create_train_state)
from loka_jax.train.steps import (compiled_steps, evaluate, locate_non_finite, loss_fn,
                                  step_rng)
from loka_jax.train.swap import ModelHook, ModelSwap, ModelSwapError, swap_model

# The loop's names and those of its parts (steps.py, run_files.py, swap.py) that callers
# import from here.
__all__ = ["NAN_POLICIES", "RESUMABLE_SETTINGS", "TIME_SPLIT_FIELDS", "WALL_CLOCK_FIELDS",
           "MetricsWriter", "ModelHook", "ModelSwap", "ModelSwapError", "NonFiniteError",
           "RunSettingsError", "TrainConfig", "compiled_steps", "evaluate",
           "locate_non_finite", "loss_fn", "read_metrics", "restore_run", "step_rng",
           "swap_model", "train"]
# The compiled steps of this process, by model and settings (tests read which were built).
_STEP_CACHE = steps_lib._STEP_CACHE

NAN_POLICIES = ("stop", "skip")


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
  # Batches made and put on the device this many steps ahead, on a background thread
  # (prefetch.py), so no step waits for the host; 0: each made after the step before it.
  prefetch: int = 2
  # Processes that make those batches (prefetch.py's `workers`): one thread makes one batch
  # at a time, slower than a short step (DLRM `large`: 15-18 ms a batch on one core, a
  # 6-7 ms step on an H200); 0: the prefetch thread makes them; -1: started when the loop
  # waits on the thread, as many as its step needs (none on a CPU backend).
  batch_workers: int = prefetch_lib.AUTO
  # Read a step's metrics after dispatching the next one, where nothing but its metrics line
  # needs it (not at evaluation or checkpoint steps, and never in a run with a step callback
  # or model hook, which read every step's state): the host's work between two steps then
  # overlaps the device's. Changes no number.
  run_ahead: bool = True
  optim: OptimConfig = OptimConfig()

  def __post_init__(self):
    if self.nan_policy not in NAN_POLICIES:
      raise ValueError(f"nan_policy={self.nan_policy!r}; use one of {NAN_POLICIES}")
    for name in ("steps", "eval_every", "log_every", "checkpoint_every", "prefetch"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.batch_workers < prefetch_lib.AUTO:
      raise ValueError(f"batch_workers must be >= 0, or {prefetch_lib.AUTO} (as many as the "
                       f"step needs), got {self.batch_workers}")
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


# ----------------------------------------------------------------------------- the loop


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


# A non-finite step this soon after a resume most likely comes from the state resumed.
RESUME_SUSPECT_STEPS = 50


def last_checkpoint(checkpointer: Checkpointer) -> Optional[str]:
  latest = checkpointer.latest_step()
  return None if latest is None else os.path.join(checkpointer.directory, str(latest))


def non_finite_advice(message: str, checkpointer: Checkpointer, step: int, start: int,
                      resumed: bool) -> str:
  """What a run stopped by a non-finite step tells the user: the likely cause and where good
  states are. `step` is the failing step, `start` the step the run resumed from."""
  directory = checkpointer.directory
  earned = checkpointer.earned_step()
  earned_text = ("" if earned is None else
                 f"; {directory}/{earned} is the newest checkpoint from which training reached "
                 "the next save with finite steps (kept until a newer one does)")
  if resumed and step - start <= RESUME_SUSPECT_STEPS:
    return (f"{message}, {step - start} step(s) after resuming from {directory}/{start}. "
            "Training stopped (nan_policy='stop'). That checkpoint is the likely cause: it "
            "passed its integrity check, so the state it holds is itself unstable or was "
            f"written from a damaged run; move it aside to resume from an earlier one"
            f"{earned_text}.")
  latest = last_checkpoint(checkpointer)
  return (f"{message}. Training stopped (nan_policy='stop'); the state before this step is "
          f"{latest or 'not saved (no finite state to save)'}{earned_text}. Lower the "
          "learning rate, check the data, or rerun with train.nan_policy=skip to skip such "
          "steps.")


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
    step_callback: called after each completed step as f(step, state, step_metrics), after
      the step's metrics line and before its checkpoint (which saves `extras` as the
      callback left them); the state's buffers are reused by the next step, so copy
      (device_get) what you keep.
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
  check_run_config(workdir, {"run": run_info, "train": config.to_dict()})
  train_step, eval_step = compiled_steps(model, config.optim, config.nan_policy,
                                         config.module_norms)
  eval_batch_size = min(config.eval_batch_size or config.batch_size, source.num_eval_examples())

  first_batch = source.train_batch(0, config.batch_size)
  tx = make_optimizer(config.optim)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                              keep=max(config.keep_checkpoints, 1))
  final_path = os.path.join(workdir, "final.json")
  finished = finished_record(final_path, checkpointer.latest_step(), config.steps,
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
  window, last_eval, grad_norm = LossWindow(), None, math.nan
  # Skipped (non-finite) steps counted at the last save or resume: a checkpoint earns its
  # place in the rotation when none were skipped before the next save.
  skipped_at_save = [loop_extras["skipped_steps"]]

  def save(finite_since_last: bool = True):
    began = time.perf_counter()
    loop_extras["elapsed_s"] = began - t0
    hook_extras = dict(model_hook.extras()) if model_hook is not None else {}
    earned = finite_since_last and loop_extras["skipped_steps"] == skipped_at_save[0]
    saved = checkpointer.save(state, {**(extras or {}), **hook_extras, "loop": loop_extras},
                              previous_earned=earned)
    skipped_at_save[0] = loop_extras["skipped_steps"]
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
  make_batch = prefetch_lib.BatchMaker(source, config.batch_size)
  feed = prefetch_lib.prefetcher(make_batch, start + 1, config.steps, config.prefetch,
                                 config.batch_workers)
  def is_eval(done: int) -> bool:
    return bool(config.eval_every and done % config.eval_every == 0) or done == config.steps

  def is_ckpt(done: int) -> bool:
    return config.saves and (bool(config.checkpoint_every and done % config.checkpoint_every == 0)
                             or done == config.steps)

  # A hook says which steps it reads the state after (`reads_state`); one that does not
  # reads every step's.
  hook_reads = getattr(model_hook, "reads_state", lambda done: True)

  def reads_state(done: int) -> bool:
    """Whether what follows step `done` reads the state after it (which a step dispatched
    ahead would have replaced)."""
    return (step_callback is not None or (model_hook is not None and hook_reads(done))
            or is_eval(done) or is_ckpt(done))

  def finish(i: int, step_metrics, step_batch, began: float) -> bool:
    """What follows step i once its metrics are read: the loss window, a non-finite step's
    handling, the metrics line, evaluation, the callback, the checkpoint and a model swap.
    False when the step was skipped (non-finite, nan_policy 'skip')."""
    nonlocal state, model, train_step, eval_step, last_eval, grad_norm
    step_metrics = jax.device_get(step_metrics)
    if i == start:
      time_split["first_step_s"] = time.perf_counter() - began
    done = i + 1
    if step_metrics["ok"]:
      window.add(float(step_metrics["loss"]))
      note_peak(loop_extras, float(step_metrics["loss"]), done)
      grad_norm = float(step_metrics["grad_norm"])
    else:
      site = locate_non_finite(model, state, step_batch, i)
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
          save(finite_since_last=False)   # the state before the bad step
        raise NonFiniteError(non_finite_advice(message, checkpointer, done, start,
                                               restored is not None),
                             step=done, site=site,
                             checkpoint=last_checkpoint(checkpointer))
    bar.update(1)

    logged = (config.log_every and done % config.log_every == 0) or is_eval(done) or is_ckpt(
        done)
    if logged:
      record = window.record(done, time.perf_counter() - t0, grad_norm)
      if step_metrics["ok"]:  # the norms of the line's last step, as its grad_norm is
        record.update({k: {m: float(v) for m, v in step_metrics[k].items()}
                       for k in module_norms_lib.KINDS if k in step_metrics})
      if is_eval(done):
        last_eval = (done, timed_evaluate())
        record.update({k: last_eval[1][k] for k in ("ne", "auc", "logloss")})
      writer.write(record)
      logging.info("step %d: %s", done, {k: round(v, 5) if isinstance(v, float) else v
                                         for k, v in record.items()
                                         if k != "step" and k not in module_norms_lib.KINDS})
      bar.set_postfix(loss=f"{record['loss']:.4f}")
    # Before the step's checkpoint: it saves what the callback made of the step (a probe's
    # observation at a checkpoint step), so a run resumed from it continues as one that
    # was never stopped.
    if step_callback is not None:
      step_callback(done, state, step_metrics)
    if logged:
      if is_ckpt(done):
        save()
      window.reset()  # after the save, which the next line's steps_per_sec must not count
    swap = model_hook.after_step(done, state, step_metrics) if model_hook is not None else None
    if swap is not None and swap.model is not None:
      state = swap_model(state, swap.model, first_batch, config.seed)
      model = swap.model
      train_step, eval_step = compiled_steps(model, config.optim, config.nan_policy,
                                             config.module_norms)
    for record in (swap.records if swap is not None else ()):
      writer.write(record)
    return bool(step_metrics["ok"])

  # Run-ahead: a step whose outcome nothing but its metrics line needs is read after the
  # next step is dispatched, so the device never waits for the host between them. A step
  # callback reads every step's state, so with one there is no run-ahead; a model hook
  # reads the steps its `reads_state` names (every step without one). The step
  # takes `halted` (true once a step in flight was non-finite) and then changes nothing:
  # 'stop' raises with the state before the bad step, 'skip' runs the step behind it again.
  # Placed as the step's own outputs are (the state's step counter), so the flag a step
  # returns and the one the loop starts with compile to one program.
  running = jax.device_put(np.False_, state.step.sharding)
  halted = running
  pending = None   # (i, metrics, batch, began) of a step whose metrics are not read yet
  try:
    batch = first_batch if start == 0 else make_batch(start)
    i = start
    while i < config.steps:
      began = time.perf_counter()
      state, step_metrics = train_step(state, batch, halted)
      halted = step_metrics["halted"]
      if pending is not None:
        behind, pending = pending, None
        if not finish(*behind):   # skipped: this step ran as a no-op behind it; again
          halted = running
          continue
      # The next batch: made ahead (feed), else on the host while the device runs this step.
      next_batch = (None if i + 1 >= config.steps else
                    feed.get(i + 1) if feed is not None else make_batch(i + 1))
      for event in (feed.take_events() if feed is not None else ()):
        writer.write({"step": i + 1, **event})
        logging.info("batches from step %d on are made in %d worker processes (a batch took "
                     "%.1f ms to make, the loop %.1f ms a step waiting for it)",
                     event["from_batch"], event["workers"], event["make_ms"], event["loop_ms"])
      if config.run_ahead and i > start and not reads_state(i + 1):
        pending = (i, step_metrics, batch, began)
      else:
        finish(i, step_metrics, batch, began)
        halted = running   # read: a skipped step has nothing dispatched behind it
      batch = next_batch
      i += 1

    final_step = int(jax.device_get(state.step))
    if last_eval is None or last_eval[0] != final_step:  # e.g. resumed at the end
      last_eval = (final_step, timed_evaluate())
    if config.saves:
      save()
    final = final_record(last_eval[1], final_step, config.seed, run_info, source, loop_extras,
                         time.perf_counter() - t0, time_split)
    write_json_atomic(final_path, final)
    return final
  finally:
    if feed is not None:
      feed.close()
    bar.close()
    writer.close()
    checkpointer.close()
