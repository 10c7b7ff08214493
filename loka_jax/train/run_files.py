"""A run directory's files and the records the loop writes into them.

  WORKDIR/config.json     the run's settings (`check_run_config`); a resume with different
                          settings is refused (RunSettingsError)
  WORKDIR/metrics.jsonl   one JSON line per logged step (`MetricsWriter`, `LossWindow`)
  WORKDIR/final.json      the finished run's record (`final_record`, `finished_record`)
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, Mapping, Optional

from loka_jax import jsonio
from loka_jax.train import metrics as metrics_lib

# Settings a resumed run may change; anything else must match the run directory's config.
# A plan's path ("plan") may change too: what it runs is pinned by "plan_kernels_sha256".
RESUMABLE_SETTINGS = ("steps", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints",
                      "nan_policy", "progress", "plan", "module_norms", "prefetch",
                      "batch_workers", "run_ahead", "drift_compile_ahead")
# Settings newer than some run directories, with the value every run written before them
# ran with: a config.json without one matches that value, so such a run still resumes.
ADDED_SETTINGS = {"cooldown_start": 0, "cooldown_steps": 0}
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


def write_json_atomic(path: str, value) -> None:
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


def without_added_defaults(settings: Mapping[str, Any]) -> Dict[str, Any]:
  """`settings` less the ADDED_SETTINGS at the value runs had before them: a cache key made
  from it (the probe's trained statistics) still matches one written before they existed."""
  return {k: v for k, v in settings.items()
          if not (k in ADDED_SETTINGS and v == ADDED_SETTINGS[k])}


def _ran_with(key: str, old: Mapping[str, Any]) -> Any:
  """The value of setting `key` (flattened) in the run whose settings are `old`: a setting
  newer than its config.json ran at its ADDED_SETTINGS value (None: one it did not have)."""
  return old[key] if key in old else ADDED_SETTINGS.get(key.split(".")[-1])


def check_run_config(workdir: str, settings: Mapping[str, Any]) -> None:
  """Writes config.json, or checks a resumed run's settings against it."""
  path = os.path.join(workdir, "config.json")
  settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
  if os.path.exists(path):
    old = jsonio.read_json(path, "run settings (config.json)", "restore it from a copy or use "
                           "a new run directory", RunSettingsError)

    def flat(d, prefix=""):
      out = {}
      for k, v in d.items():
        if isinstance(v, dict):
          out.update(flat(v, f"{prefix}{k}."))
        else:
          out[f"{prefix}{k}"] = v
      return out

    old_flat, new_flat = flat(old), flat(settings)
    diffs = [f"{k}: {_ran_with(k, old_flat)!r} -> {new_flat.get(k)!r}"
             for k in sorted(set(old_flat) | set(new_flat))
             if k.split(".")[-1] not in RESUMABLE_SETTINGS
             and _ran_with(k, old_flat) != new_flat.get(k)]
    if diffs:
      raise RunSettingsError(f"run directory {workdir} holds a run with other settings ("
                       + "; ".join(diffs) + "); resume with the same settings or use a new "
                       "run directory")
  write_json_atomic(path, settings)


class LossWindow:
  """Mean and worst training loss (and speed) over the steps since the previous metrics line.
  The worst step is kept because a mean hides a spike: on an H200, a DCNv2 `large` bf16+Mods
  step at loss 5.7 disappears into its window's mean."""

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


def note_peak(loop_extras: Dict[str, Any], loss: float, step: int) -> None:
  """Keeps the run's worst finite step (`peak_loss` at `peak_step`) in the loop's checkpointed
  extras, so a resumed run reports the worst step of the whole run, not of its last part."""
  if loss > loop_extras.get("peak_loss", -math.inf):
    loop_extras["peak_loss"], loop_extras["peak_step"] = loss, step


def final_record(evaluation: Mapping[str, Any], step: int, seed: int,
                 run_info: Mapping[str, Any], source, loop_extras: Mapping[str, Any],
                 elapsed: float, time_split: Mapping[str, Optional[float]]) -> Dict[str, Any]:
  """final.json's record: the held-out evaluation at `step`, the run's identity (`run_info`;
  `seed` unless it names one), skipped and worst steps, wall-clock time and its split."""
  final = {"ne": evaluation["ne"], "auc": evaluation["auc"], "logloss": evaluation["logloss"],
           "base_ctr": evaluation["base_ctr"], "num_eval_examples": evaluation["num_examples"],
           "steps": step, "precision": run_info.get("precision"),
           "seed": run_info.get("seed", seed),
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


def finished_record(final_path: str, latest_step: Optional[int], steps: int,
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
