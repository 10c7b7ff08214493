r"""GPU benchmark of the Pallas FP8 kernels against XLA FP8 and bf16 (docs/BENCHMARKS.md,
section 3: how speed is measured).

  python3 -m experiments.bench_kernels --out=/tmp/bench --config.limits.max_minutes=7 \
      [--config.select.only=gemm,fmb] [--config.timing.tune=true]

Settings come from experiments/configs/bench_kernels.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field); experiments/bench/kernels_suite.py times the
shapes. Per shape (GEMMs, batched interaction einsums, and the chain quantize -> GEMM ->
BlockNorm(256) -> Hard Swish -> quantize) every variant is timed interleaved with its group's
baseline, each row holding the median time, TFLOP/s and the speedup with a bootstrap 95% CI.
Rows go to OUT/results.jsonl; a rerun skips finished shapes, so the benchmark resumes across
invocations that each stop at config.limits.max_minutes. The markdown table of all rows is
printed last (and written to OUT/table.md).
"""
import sys

from absl import app, flags

from experiments import run_config
from experiments import time_limit
from experiments.bench import kernels_suite

CONFIG = run_config.define_config_flag("bench_kernels")
flags.adopt_module_key_flags(run_config)  # --help lists --config
OUT = flags.DEFINE_string("out", None, "Output directory (results.jsonl, table.md, caches).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not OUT.value:
    raise app.UsageError("--out=DIR is required (results.jsonl is appended there)")
  settings = kernels_suite.Settings.from_config(CONFIG.value)
  should_stop = time_limit.stop_after(settings.max_minutes * 60)
  try:
    device, table = kernels_suite.run(settings, OUT.value, should_stop)
  except RuntimeError as e:
    sys.exit(f"error: {e}")
  print(f"\ncard: {device}\n")
  print(table)


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
