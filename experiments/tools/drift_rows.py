"""The rows of `experiments.report drift_run` (experiments/tools/drift_run.py): what the drift
valve's refreshes cost in one `experiments.train` run. No flags, so tests and other tools
import it freely."""
import json
import os
import statistics
from typing import Any, Dict, Mapping

from loka_jax import jsonio


class DriftRowError(ValueError):
  """A run that cannot make a row (the message names the file and what is missing)."""


def _final_metrics(path: str) -> Dict[str, Any]:
  """The JSON object experiments.train printed last (its stdout also holds the valve's lines;
  the object starts on a line of its own)."""
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise DriftRowError(f"{path}: cannot read the final metrics experiments.train printed "
                        f"({e})") from None
  starts = [i for i, line in enumerate(lines) if line.startswith("{")]
  for i in reversed(starts):
    try:
      return json.loads("\n".join(lines[i:]))
    except ValueError:
      continue
  raise DriftRowError(f"{path}: holds no final metrics (the stdout of a finished "
                      "experiments.train run)")


def row(run_dir: str, final_path: str, device: str, jax_version: str, date: str,
        commit: str, command: str) -> Dict[str, Any]:
  """One drift_run row from a run directory (its config.json and metrics.jsonl) and the final
  metrics `experiments.train` printed (`final_path`, which holds the valve's "drift")."""
  config = jsonio.read_json(os.path.join(run_dir, "config.json"), "run settings (config.json)",
                            "give the directory of an experiments.train run", DriftRowError)
  info = config.get("run", config)
  if not info.get("drift_every"):
    raise DriftRowError(f"{run_dir}/config.json: not a drift run (no drift_every); train "
                        "with --config.drift.every=N")
  final = _final_metrics(final_path)
  drift = final.get("drift")
  if not isinstance(drift, Mapping):
    raise DriftRowError(f"{final_path}: no \"drift\" entry (the stdout of an "
                        "experiments.train run with --config.drift.every=N)")
  rates = [r["steps_per_sec"] for _, r, error in
           jsonio.jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))
           if error is None and isinstance(r, dict) and "steps_per_sec" in r]
  seconds = drift["seconds"]
  return {
      "kind": "drift_run", "model": info["model"], "preset": info["preset"],
      "device": device, "jax": jax_version, "date": date, "commit": commit,
      "command": command, "plan": os.path.basename(info.get("plan") or ""),
      "cadence": info["drift_every"], "max_overhead": info.get("drift_max_overhead"),
      "steps": final["steps"], "refresh_steps": drift["refresh_steps"],
      "refresh_s": [round(s, 4) for s in seconds],
      "later_refresh_s": round(statistics.median(seconds[1:]), 4) if len(seconds) > 1 else None,
      "stepping_s": round(drift["stepping_s"], 3),
      # The windows hold the refreshes; the step alone is the stepping time per step.
      "step_ms": round(1e3 * drift["stepping_s"] / max(1, final["steps"] - 1), 3),
      "window_steps_per_s": [round(r, 3) for r in rates],
      "ahead_s": drift.get("ahead_s"), "waiting_since": drift.get("waiting_since"),
      "switches": drift["switches"], "share": drift["share"],
      "share_after_first": drift["share_after_first"]}
