"""The Mods ablation: every on/off combination of No Bias, BlockNorm and Hard Swish, each
trained in bf16 and in FP8 (one kernel at every site) at each of the config's seeds (the arms
of one seed share their initialization key, data order and held-out set), plus (on a GPU)
train-step and inference time. Loss verdicts pair the arms by seed
(`loka_jax.train.verdict.paired_quality`).

Work directory (resumable: finished arms and timing rows are never redone):
  DIR/settings.json      what every arm shares; a rerun with other settings is refused
  DIR/runs/<arm>/        one `experiment.run` directory per arm and seed, e.g.
                         runs/fp8_all__no_bias__seed1 (final.json when finished,
                         error.json when it failed; delete the directory to retry)
  DIR/timing.jsonl       one row per mods combination: bf16 baseline, bf16 and FP8 with the
                         mods, timed interleaved in one process (GPU only, or timing 'force')
  DIR/ablation.json      schema loka.ablation/2 (see `summarize`)
  DIR/ablation.md        the markdown table
  DIR/ablation.png       NE per combination (bf16 vs FP8) and latency where measured

The parts: `ablation_arms` (combinations, settings, arms), `ablation_timing` (the timing
rows), `ablation_report` (verdicts, table, plot); this module runs them and holds the names
they are used by (`from loka_jax.train import ablation`). How long a call may run is the
caller's: `run`'s `should_stop` (experiments/ablate_mods.py makes one of its config's
max_minutes).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax

from loka_jax import jsonio
from loka_jax.train.ablation_arms import (FREE_SETTINGS, PRECISIONS, SHORT, TIMING_MODES,
                                         AblationConfig, Arm, Combination, all_combinations,
                                         arms, combination_key, combination_label,
                                         parse_combinations, run_spec, timing_enabled,
                                         train_config)
from loka_jax.train.ablation_report import (SCHEMA, load, markdown_table, plot, reading,
                                           summarize, write_json, write_outputs)
from loka_jax.train.ablation_timing import step_calls, time_combination, timing_variants
from loka_jax.train import NonFiniteError, experiment

__all__ = [
    "AblationConfig", "Arm", "Combination", "FREE_SETTINGS", "PRECISIONS", "SCHEMA", "SHORT",
    "SettingsError", "TIMING_MODES", "all_combinations", "arm_result", "arms",
    "check_settings", "combination_key", "combination_label", "load", "markdown_table",
    "parse_combinations", "plot", "reading", "run", "run_spec", "step_calls", "summarize",
    "time_combination", "timing_enabled", "timing_variants", "train_arm", "train_config",
    "use_compile_cache", "write_outputs",
]


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


def arm_result(workdir: str, arm: Arm, steps: int) -> Optional[Dict[str, Any]]:
  """The finished arm's final.json (or its error record), None if it still has to run."""
  run_dir = os.path.join(workdir, "runs", arm.name)
  error = os.path.join(run_dir, "error.json")
  if os.path.exists(error):
    return _read_json(error)
  final = os.path.join(run_dir, "final.json")
  if os.path.exists(final):
    result = _read_json(final)
    if result.get("steps") == steps:
      return result
  return None


def train_arm(config: AblationConfig, arm: Arm, workdir: str) -> Dict[str, Any]:
  """Trains one arm (resuming its run directory) and returns its final.json dict; a
  divergence is recorded in error.json and returned as {"error": ...}."""
  run_dir = os.path.join(workdir, "runs", arm.name)
  try:
    final = experiment.run(run_spec(config, arm), run_dir, train_config(config, arm.seed))
  except NonFiniteError as e:
    # A diverged arm is a result of the ablation (e.g. FP8 without Mods); anything else is a
    # fault of the setup and propagates.
    os.makedirs(run_dir, exist_ok=True)
    record = {"error": f"{type(e).__name__}: {e}", "arm": arm.name}
    write_json(os.path.join(run_dir, "error.json"), record)
    return record
  if not config.keep_checkpoints:
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
  return final


def _timing_rows(workdir: str) -> Dict[Tuple[str, str], Dict[str, Any]]:
  path = os.path.join(workdir, "timing.jsonl")
  rows = {}
  if os.path.exists(path):
    for _, row, error in jsonio.jsonl_rows(path):
      if error is None:  # a line cut by a killed run is measured again
        rows[(row["combination"], row["device"])] = row
  return rows


def _append_row(workdir: str, row: Mapping[str, Any]) -> None:
  with open(os.path.join(workdir, "timing.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())


class SettingsError(ValueError):
  """A work directory holding an ablation with other shared settings."""


def check_settings(config: AblationConfig, workdir: str) -> None:
  """Writes settings.json, or refuses a workdir holding an ablation with other settings."""
  path = os.path.join(workdir, "settings.json")
  settings = json.loads(json.dumps(config.shared_settings()))
  if os.path.exists(path):
    old = _read_json(path)
    # A workdir whose settings name one `seed` holds arms named by their seed
    # (runs/<arm>__seed<N>): they resume at whatever seeds the config lists.
    old.pop("seed", None)
    diffs = [f"{k}: {old.get(k)!r} -> {settings.get(k)!r}"
             for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    if diffs:
      raise SettingsError(f"{workdir} holds an ablation with other settings ({'; '.join(diffs)}); "
                          "rerun with the same settings or use a new work directory")
  write_json(path, settings)


def use_compile_cache(path: str) -> None:
  """Persistent compilation cache (arms and timing rows reuse each other's executables, and
  reruns skip compiles); a cache set up earlier (e.g. JAX_COMPILATION_CACHE_DIR) is kept."""
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", path)


def _seconds(value) -> Optional[float]:
  return float(value) if isinstance(value, (int, float)) and value >= 0 else None


class _Stop:
  """`run`'s `should_stop`, asked before each unit with the seconds the longest finished unit
  of its kind took (0.0 before any); once it says stop, no later unit starts."""

  def __init__(self, should_stop: Optional[Callable[[float], bool]]):
    self.should_stop = should_stop
    self.stopped = threading.Event()  # arms may train on several threads

  def __call__(self, expected_s: float) -> bool:
    if (not self.stopped.is_set() and self.should_stop is not None
        and self.should_stop(expected_s)):
      self.stopped.set()
    return self.stopped.is_set()


def run(config: AblationConfig, workdir: str, log: Callable[[str], None] = print,
        should_stop: Optional[Callable[[float], bool]] = None) -> Dict[str, Any]:
  """Trains every arm not yet finished, times every combination not yet timed (see
  `timing_enabled`), and writes ablation.json / .md / .png from all results so far.

  `should_stop`, when given, is called before each arm and each timing row starts, with the
  seconds that unit is expected to take (the longest finished arm, from its final.json's
  "time", or the longest timing row, its "row_s"; 0.0 before one is known). Once it returns
  True no further unit starts: the outputs are written from what has finished, and the
  returned ablation.json dict has "complete" False and the units left under "pending" (rerun
  with the same arguments to continue). Without it every unit runs.
  """
  os.makedirs(workdir, exist_ok=True)
  check_settings(config, workdir)
  stop = _Stop(should_stop)
  results = {a.name: arm_result(workdir, a, config.steps) for a in arms(config)}
  todo = [a for a in arms(config) if results[a.name] is None]
  arm_s = [s for s in (_seconds((r or {}).get("time")) for r in results.values())
           if s is not None]

  def train_one(arm: Arm):
    if stop(max(arm_s, default=0.0)):
      return arm, None
    t0 = time.monotonic()
    final = train_arm(config, arm, workdir)
    arm_s.append(time.monotonic() - t0)
    summary = final.get("error") or f"ne {final['ne']:.5f} logloss {final['logloss']:.5f}"
    log(f"{arm.name}: {summary} ({time.monotonic() - t0:.0f} s)")
    return arm, final

  workers = min(config.workers, max(1, len(todo)))
  if workers == 1:
    done = map(train_one, todo)
  else:
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    done = pool.map(train_one, todo)
  try:
    for arm, final in done:
      results[arm.name] = final
  finally:
    if workers > 1:
      pool.shutdown()

  rows = _timing_rows(workdir)
  device = jax.devices()[0].device_kind
  if timing_enabled(config):
    row_s = [s for s in (_seconds(r.get("row_s")) for r in rows.values()) if s is not None]
    for mods in config.combinations:
      key = (combination_key(mods), device)
      if key in rows:
        continue
      if stop(max(row_s, default=0.0)):
        break
      t0 = time.monotonic()
      row = time_combination(config, mods)
      row["row_s"] = round(time.monotonic() - t0, 3)
      _append_row(workdir, row)
      rows[key] = row
      row_s.append(row["row_s"])
      log(f"timed {combination_label(mods)} ({row['row_s']:.0f} s)")
  result = summarize(config, results, [r for (c, d), r in rows.items() if d == device], device)
  write_outputs(result, workdir)
  if not result["complete"]:
    log(f"stopped: {len(result['pending'])} unit(s) left; rerun the same command to continue")
  return result
