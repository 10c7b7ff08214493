"""`experiments.report loop_vs_bench`: the loop's windows beside the bench's step, per arm,
from a bench.jsonl and experiments.train run directories written by hand."""
import json
import os
import tempfile

from absl.testing import absltest

from experiments.tools import loop_rows
from experiments.tools import results_user_speed as user_speed
from loka_jax import jsonio


def _bench_row(variant, median_us, shared_state=True):
  return {"suite": "models", "model": "wukong", "preset": "large", "device": "NVIDIA H200",
          "jax": "0.11.2", "batch_size": 4096, "variant": variant,
          "train": {"median_us": median_us}, "shared_state": shared_state}


def _loop(root, name, rates, batch_workers=None, started=None):
  """A run directory: its metrics windows, its config.json's batch_workers when given, and
  a `batch_workers` line after the first window when `started` (workers) is given."""
  path = os.path.join(root, name)
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for i, rate in enumerate(rates, 1):
      f.write(json.dumps({"step": 25 * i, "loss": 0.5, "steps_per_sec": rate}) + "\n")
      if i == 1 and started:
        f.write(json.dumps({"step": 14, "event": "batch_workers", "from_batch": 14,
                            "workers": started, "make_ms": 30.0, "loop_ms": 1.0}) + "\n")
  if batch_workers is not None:
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump({"run": {}, "train": {"batch_workers": batch_workers}}, f)
  return path


class LoopVsBenchTest(absltest.TestCase):

  def test_rows_compare_each_arm_and_the_speedup_in_both(self):
    root = tempfile.mkdtemp()
    bench = os.path.join(root, "bench.jsonl")
    with open(bench, "w") as f:
      for row in (_bench_row("bf16", 170000.0), _bench_row("bf16_mods", 160000.0),
                  _bench_row("loka", 120000.0, shared_state=False)):
        f.write(json.dumps(row) + "\n")
    # The first window (compiles) is left out of the median.
    loops = [_loop(root, "loop_bf16_mods", [0.4, 6.0, 6.2, 6.1], batch_workers=2),
             _loop(root, "loop_loka", [0.2, 8.0, 8.1, 8.2], batch_workers=-1, started=6)]
    rows = loop_rows.rows(bench, loops, "/x/plan.json", "cmd", "abc", "2026-12-04")
    self.assertEqual([r["arm"] for r in rows], ["bf16+Mods", "LoKA"])
    base, loka = rows
    self.assertEqual(base["bench_steps_per_s"], 6.25)        # 1e6 / 160000 us
    self.assertEqual(base["window_steps_per_s"], [6.0, 6.2, 6.1])
    self.assertEqual(base["loop_steps_per_s"], 6.1)
    self.assertEqual(base["loop_over_bench"], 0.976)          # 6.1 / 6.25
    self.assertIsNone(base["plan"])
    self.assertEqual(loka["plan"], "plan.json")
    self.assertEqual(loka["speedup_bench"], 1.3333)            # 160000 / 120000
    self.assertEqual(loka["speedup_loop"], 1.3279)             # 8.1 / 6.1
    # Whether the bench timed each arm on bf16's shared state or on its own.
    self.assertEqual((base["bench_shared_state"], loka["bench_shared_state"]), (True, False))
    # Batch workers: the setting, or the workers the loop started and the step it did.
    self.assertEqual((base["batch_workers"], base["batch_workers_from_step"]), (2, None))
    self.assertEqual((loka["batch_workers"], loka["batch_workers_from_step"]), (6, 14))
    # The rows pass RESULTS' reader.
    out = os.path.join(root, "rows.jsonl")
    with open(out, "w") as f:
      for r in rows:
        f.write(json.dumps(jsonio.with_digest(r)) + "\n")
    self.assertLen(user_speed.load_rows([out]), 2)

  def test_a_missing_arm_is_left_out_and_a_misnamed_directory_refused(self):
    root = tempfile.mkdtemp()
    bench = os.path.join(root, "bench.jsonl")
    with open(bench, "w") as f:
      f.write(json.dumps(_bench_row("bf16_mods", 100000.0)) + "\n")
    loops = [_loop(root, "loop_bf16_mods", [1.0, 9.0]), os.path.join(root, "loop_loka")]
    rows = loop_rows.rows(bench, loops, "", "cmd", "abc", "2026-12-04")
    self.assertEqual([r["arm"] for r in rows], ["bf16+Mods"])
    self.assertNotIn("speedup_loop", rows[0])
    self.assertEqual(rows[0]["batch_workers"], 0)   # no config.json, no line: none
    with self.assertRaisesRegex(ValueError, "loop_<variant>"):
      loop_rows.rows(bench, [os.path.join(root, "run")], "", "cmd", "abc", "2026-12-04")


if __name__ == "__main__":
  absltest.main()
