"""Hand-made benchmark rows for the bench-report tests (`from bench_rows import speed, ...`):
a timing summary around a known speedup, and a temporary directory for the files."""
import shutil
import tempfile

import numpy as np


def tempdir(test):
  """A fresh directory, removed when `test` ends."""
  path = tempfile.mkdtemp(prefix="loka_bench_report_")
  test.addCleanup(shutil.rmtree, path, ignore_errors=True)
  return path


def speed(speedup, rng, base_us=100.0, n=20):
  """A timing summary whose variant runs `speedup` x faster than the bf16 timed beside it."""
  base = base_us * (1 + 0.01 * rng.standard_normal(n))
  var = base_us / speedup * (1 + 0.01 * rng.standard_normal(n))
  return {"median_us": float(np.median(var)), "speedup": float(np.median(base) / np.median(var)),
          "speedup_ci": [speedup * 0.99, speedup * 1.01],
          "examples_per_s": float(4096 / np.median(var) * 1e6), "samples_us": var.tolist(),
          "baseline_samples_us": base.tolist()}
