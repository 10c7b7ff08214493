"""The rows of `experiments.report loop_vs_bench` (experiments/tools/loop_vs_bench.py): the
training loop's metrics windows beside the bench's timed step, per arm. No flags, so tests and
other tools import it freely."""
import os
import statistics

from loka_jax import jsonio

ARMS = {"bf16_mods": "bf16+Mods", "loka": "LoKA"}


def _bench_rows(path: str):
  rows = {}
  for n, row, error in jsonio.jsonl_rows(path):
    if error is not None:
      raise ValueError(f"{path}:{n}: not valid JSON ({error})")
    if isinstance(row, dict) and row.get("variant") in ARMS and "train" in row:
      rows[row["variant"]] = row
  return rows


def timed_arms(bench_path: str):
  """The arms of `bench_path` whose training step the bench timed (a row holding `train`)."""
  return list(_bench_rows(bench_path))


def _windows(run_dir: str):
  """The loop's steps/s per metrics window after the first (the first holds compiles)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  rates = [row["steps_per_sec"] for _, row, error in jsonio.jsonl_rows(path)
           if error is None and isinstance(row, dict) and "steps_per_sec" in row]
  return rates[1:]


def _batch_workers(run_dir: str):
  """(worker processes that made the loop's batches, the step they started at): those of the
  last `batch_workers` line of metrics.jsonl (the latest process that started any; the call
  runs one process), else the run's setting in config.json (a setting of -1 that started
  none: 0), with no step."""
  lines = [row for _, row, error in jsonio.jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))
           if error is None and isinstance(row, dict) and row.get("event") == "batch_workers"]
  if lines:
    return lines[-1]["workers"], lines[-1]["step"]
  path = os.path.join(run_dir, "config.json")
  setting = 0
  if os.path.exists(path):
    config = jsonio.read_json(path, "run settings (config.json)", "rerun the loop",
                              ValueError)
    setting = (config.get("train") or {}).get("batch_workers", 0)
  return max(int(setting), 0), None


def rows(bench_path: str, loop_dirs, plan: str, command: str, commit: str, date: str):
  """One loop_vs_bench row per arm that both the bench and a loop directory hold."""
  bench = _bench_rows(bench_path)
  out = {}
  for run_dir in loop_dirs:
    variant = os.path.basename(os.path.normpath(run_dir)).removeprefix("loop_")
    if variant not in ARMS:
      raise ValueError(f"--loops: {run_dir} is not named loop_<variant> with a variant "
                       f"among {', '.join(ARMS)}")
    if variant not in bench or not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
      print(f"[loop_vs_bench] {ARMS[variant]}: no bench row or no loop metrics; left out")
      continue
    windows = _windows(run_dir)
    if not windows:
      print(f"[loop_vs_bench] {run_dir}: fewer than two metrics windows; left out")
      continue
    b = bench[variant]
    workers, workers_from = _batch_workers(run_dir)
    bench_rate = 1e6 / b["train"]["median_us"]
    loop_rate = statistics.median(windows)
    out[variant] = {
        "kind": "loop_vs_bench", "model": b["model"], "preset": b["preset"],
        "device": b["device"], "jax": b["jax"], "date": date, "commit": commit,
        "command": command, "arm": ARMS[variant], "batch_size": b["batch_size"],
        "plan": os.path.basename(plan) if variant == "loka" and plan else None,
        "bench_step_ms": round(b["train"]["median_us"] / 1e3, 3),
        # False: the bench timed this arm on a state of its own model's parameters (always
        # with `speed.own_states`, as the loop runs it); True: on bf16's shared state, with
        # the biases its Mods drop.
        "bench_shared_state": b.get("shared_state"),
        "bench_steps_per_s": round(bench_rate, 3),
        "window_steps_per_s": [round(r, 3) for r in windows],
        "loop_steps_per_s": round(loop_rate, 3),
        "loop_over_bench": round(loop_rate / bench_rate, 4),
        "batch_workers": workers, "batch_workers_from_step": workers_from}
  if "loka" in out and "bf16_mods" in out:
    base, loka = out["bf16_mods"], out["loka"]
    loka["speedup_bench"] = round(loka["bench_steps_per_s"] / base["bench_steps_per_s"], 4)
    loka["speedup_loop"] = round(loka["loop_steps_per_s"] / base["loop_steps_per_s"], 4)
  return list(out.values())
