r"""The training loop's speed beside the bench's step, per arm: rows for RESULTS.

  python3 -m experiments.report loop_vs_bench --bench=DIR/bench/bench.jsonl \
      --loops=DIR/loop_bf16_mods,DIR/loop_loka --out=loop_vs_bench.jsonl

The bench times a device-resident training step (`experiments.bench`, its row's
`train.median_us`); `experiments.train` runs the user's loop (batches made, moved, metrics
read). Per arm (bf16+Mods from the loop directory named loop_bf16_mods, LoKA from loop_loka)
this writes one `loop_vs_bench` row: the bench's step as steps/s, the loop's 25-step metrics
windows after the first and their median, the loop over the bench, and in LoKA's row its
speedup over bf16+Mods in both. `experiments/gpu_loop_bench_call.sh` runs both and this.
"""
import datetime
import json
import os
import statistics

from absl import app, flags

from loka_jax import jsonio

BENCH = flags.DEFINE_string("bench", None, "The bench's rows (bench.jsonl).")
LOOPS = flags.DEFINE_list("loops", [], "experiments.train run directories, named "
                          "loop_<variant> (loop_bf16_mods, loop_loka); missing ones are left out.")
PLAN = flags.DEFINE_string("plan", "", "The LoKA arm's plan file (recorded in its row).")
COMMAND = flags.DEFINE_string("command", "", "The command that measured them (recorded).")
COMMIT = flags.DEFINE_string("commit", "unknown", "The commit measured (recorded).")
OUT = flags.DEFINE_string("out", None, "Append the rows here (JSONL).")

ARMS = {"bf16_mods": "bf16+Mods", "loka": "LoKA"}


def _bench_rows(path: str):
  rows = {}
  for n, row, error in jsonio.jsonl_rows(path):
    if error is not None:
      raise app.UsageError(f"{path}:{n}: not valid JSON ({error})")
    if isinstance(row, dict) and row.get("variant") in ARMS and "train" in row:
      rows[row["variant"]] = row
  return rows


def _windows(run_dir: str):
  """The loop's steps/s per metrics window after the first (the first holds compiles)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  rates = [row["steps_per_sec"] for _, row, error in jsonio.jsonl_rows(path)
           if error is None and isinstance(row, dict) and "steps_per_sec" in row]
  return rates[1:]


def rows(bench_path: str, loop_dirs, plan: str, command: str, commit: str, date: str):
  """One loop_vs_bench row per arm that both the bench and a loop directory hold."""
  bench = _bench_rows(bench_path)
  out = {}
  for run_dir in loop_dirs:
    variant = os.path.basename(os.path.normpath(run_dir)).removeprefix("loop_")
    if variant not in ARMS:
      raise app.UsageError(f"--loops: {run_dir} is not named loop_<variant> with a variant "
                           f"among {', '.join(ARMS)}")
    if variant not in bench or not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
      print(f"[loop_vs_bench] {ARMS[variant]}: no bench row or no loop metrics; left out")
      continue
    windows = _windows(run_dir)
    if not windows:
      print(f"[loop_vs_bench] {run_dir}: fewer than two metrics windows; left out")
      continue
    b = bench[variant]
    bench_rate = 1e6 / b["train"]["median_us"]
    loop_rate = statistics.median(windows)
    out[variant] = {
        "kind": "loop_vs_bench", "model": b["model"], "preset": b["preset"],
        "device": b["device"], "jax": b["jax"], "date": date, "commit": commit,
        "command": command, "arm": ARMS[variant], "batch_size": b["batch_size"],
        "plan": os.path.basename(plan) if variant == "loka" and plan else None,
        "bench_step_ms": round(b["train"]["median_us"] / 1e3, 3),
        "bench_steps_per_s": round(bench_rate, 3),
        "window_steps_per_s": [round(r, 3) for r in windows],
        "loop_steps_per_s": round(loop_rate, 3),
        "loop_over_bench": round(loop_rate / bench_rate, 4)}
  if "loka" in out and "bf16_mods" in out:
    base, loka = out["bf16_mods"], out["loka"]
    loka["speedup_bench"] = round(loka["bench_steps_per_s"] / base["bench_steps_per_s"], 4)
    loka["speedup_loop"] = round(loka["loop_steps_per_s"] / base["loop_steps_per_s"], 4)
  return list(out.values())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not BENCH.value or not os.path.exists(BENCH.value):
    raise app.UsageError(f"--bench: {BENCH.value!r} does not exist (the bench's bench.jsonl)")
  made = rows(BENCH.value, LOOPS.value, PLAN.value, COMMAND.value, COMMIT.value,
              datetime.date.today().isoformat())
  for r in made:
    extra = (f"; LoKA over bf16+Mods {r['speedup_bench']:.3f}x in the bench, "
             f"{r['speedup_loop']:.3f}x in the loop" if "speedup_loop" in r else "")
    print(f"{r['model']}/{r['preset']} {r['arm']:9s} bench {r['bench_steps_per_s']:7.2f} "
          f"steps/s, loop {r['loop_steps_per_s']:7.2f} (windows "
          f"{' '.join(f'{w:.2f}' for w in r['window_steps_per_s'])}): loop/bench "
          f"{r['loop_over_bench']:.3f}{extra}")
  if OUT.value and made:
    with open(OUT.value, "a") as f:
      for r in made:
        f.write(json.dumps(jsonio.with_digest(r)) + "\n")
    print(f"[loop_vs_bench] appended {len(made)} rows to {OUT.value}")


if __name__ == "__main__":
  app.run(main)
