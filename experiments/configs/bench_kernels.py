"""Settings of the kernel benchmark, `python3 -m experiments.bench_kernels --out=DIR`: the
Pallas FP8 kernels against XLA FP8 and bf16 at recommendation shapes, on the GPU.

  python3 -m experiments.bench_kernels --out=/tmp/bench --config.timing.tune=true \
      --config.select.only=gemm,fmb

--out is a flag of the main, not a setting: the directory of results.jsonl (appended; a rerun
skips finished shapes), table.md and the tuning caches.
"""
import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # Which shapes and variants run.
  config.select = select = ml_collections.ConfigDict()
  # Comma-separated tokens: only shapes or variants whose name contains one (a variant's
  # baseline is timed with it); empty: every shape and variant.
  select.only = ""
  # Tiny shapes, CPU allowed: checks the benchmark's code paths only (timings meaningless).
  select.smoke = False

  # How each variant is timed.
  config.timing = timing = ml_collections.ConfigDict()
  timing.repeats = 25           # interleaved timing repeats per variant
  # A timed sample's length in ms: calls shorter than a quarter of it are timed as chains of
  # dependent calls, less their floor.
  timing.min_call_ms = 1.0
  timing.tune = False           # autotune the Pallas tiles (cached under OUT/pallas_tune)
  # maxNumImpreciseAcc of the Pallas FP8 dots (>= 32 lets Triton use Hopper's FP8 wgmma; 0:
  # promote every step). Give it its own --out: rows do not mix settings.
  timing.fp8_imprecise_acc = 0

  # How long one invocation runs, and where compiled programs are kept across invocations.
  config.limits = limits = ml_collections.ConfigDict()
  # No new shape starts unless it can end (about a minute) within this many minutes of the
  # start; a rerun resumes. 0: no limit.
  limits.max_minutes = 7.0
  # Persistent compilation cache directory; unset: ~/.cache/loka_jax/jax_cache.
  limits.compile_cache = config_dict.placeholder(str)
  return config
