"""Hand-made benchmark rows for the bench tests (`import bench_rows`): a timing summary around a
known speedup, a model row of two of them, a quality row, the one verdict of a target, and a
temporary directory for the files and a JSON file written there."""
import json
import os
import shutil
import tempfile

import numpy as np


def tempdir(test):
  """A fresh directory, removed when `test` ends."""
  path = tempfile.mkdtemp(prefix="loka_bench_report_")
  test.addCleanup(shutil.rmtree, path, ignore_errors=True)
  return path


def write_json(directory, name, value):
  """`value` as JSON in DIRECTORY/NAME; returns the path."""
  path = os.path.join(directory, name)
  with open(path, "w") as f:
    json.dump(value, f)
  return path


def speed(speedup, rng, base_us=100.0, n=20, jitter=0.01):
  """A timing summary whose variant runs `speedup` x faster than the bf16 timed beside it."""
  base = base_us * (1 + jitter * rng.standard_normal(n))
  var = base_us / speedup * (1 + jitter * rng.standard_normal(n))
  return {"median_us": float(np.median(var)), "speedup": float(np.median(base) / np.median(var)),
          "speedup_ci": [speedup * 0.99, speedup * 1.01],
          "examples_per_s": float(4096 / np.median(var) * 1e6), "samples_us": var.tolist(),
          "baseline_samples_us": base.tolist()}


def model_row(model, preset, variant, train, infer, rng, suite_name="models"):
  """A speed row whose variant trains `train` x and infers `infer` x as fast as its bf16."""
  return {"suite": suite_name, "model": model, "preset": preset, "variant": variant,
          "device": "H100", "batch_size": 4096, "train": speed(train, rng),
          "infer": speed(infer, rng), "train_memory_bytes": 2 ** 31}


def quality_row(model, preset, arm, seed, logloss, **fields):
  """A synthetic-data quality row as `quality.run_model` writes it."""
  return {"suite": "quality", "data": "synthetic", "model": model, "preset": preset, "arm": arm,
          "seed": seed, "device": "H100", "logloss": logloss, "ne": logloss / 0.5, "auc": 0.7,
          "eval_fingerprint": "abc", **fields}


def find_verdict(verdicts, target, subject, mode):
  """The one verdict of `target` for `subject` in `mode` among `verdicts`."""
  found = [v for v in verdicts if v["target"] == target and v["subject"] == subject
           and v["mode"] == mode]
  assert len(found) == 1, (target, subject, mode, found)
  return found[0]
