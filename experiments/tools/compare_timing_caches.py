"""Compares two probe timing caches of the same kernel passes, measured apart.

  python3 -m experiments.timing_cache compare FIRST.json SECOND.json [--out=ROWS.json]

For a setting that should not change a timing, e.g. the probe's timing compile workers:
time the same shapes twice, each in a fresh process with no compilation cache, once with
each setting, and compare (`timing_caches.compare_caches`). Prints the summary (entries,
median ratio second/first and its 5-95% range, the share of overlapping 95% CIs, the largest
change of a speedup over the baseline) and the ten entries that moved most.
"""
import json

from absl import app, flags

from loka_jax import jsonio
from loka_jax.probe import kernel_timing, timing_caches

OUT = flags.DEFINE_string("out", None, "Write every compared row here (JSON).")


def _entries(path: str):
  try:
    return timing_caches.read_cache(path).entries
  except kernel_timing.TimingCacheError as e:
    raise app.UsageError(str(e)) from e


def main(argv):
  if len(argv) != 3:
    raise app.UsageError("give two timing cache files: FIRST.json SECOND.json")
  try:
    result = timing_caches.compare_caches(_entries(argv[1]), _entries(argv[2]))
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if OUT.value:
    jsonio.write_json_atomic(OUT.value, result)
  print(json.dumps(result["summary"]))
  moved = sorted(result["rows"], key=lambda r: -abs(r["ratio"] - 1))[:10]
  print("| kernel | pass | lhs | rhs | first us | second us | ratio | CIs overlap |")
  print("|---|---|---|---|---|---|---|---|")
  for r in moved:
    print(f"| {r['kernel']} | {r['pass']} | {r['lhs_shape']} | {r['rhs_shape']} | "
          f"{r['first_us']:.1f} | {r['second_us']:.1f} | {r['ratio']:.3f} | {r['ci_overlap']} |")

