"""`experiments.report drift_run`'s row (experiments/tools/drift_rows.py): the numbers come
from the run's files and the final metrics experiments.train printed, and a run that is not a
drift run, or a final without the valve's entry, is refused naming the file."""
import json
import os

from absl.testing import absltest

import bench_rows
from experiments.tools import drift_rows


class DriftRowTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = bench_rows.tempdir(self)
    self.run_dir = os.path.join(self.dir, "run")
    os.makedirs(self.run_dir)
    self.write("run/config.json", {"run": {
        "model": "wukong", "preset": "large", "precision": "loka", "plan": "/x/plan_a.json",
        "drift_every": 25, "drift_max_overhead": 0.02}, "train": {}})
    with open(os.path.join(self.run_dir, "metrics.jsonl"), "w") as f:
      for step, rate in ((25, 1.5), (50, 7.9), (75, 8.1)):
        f.write(json.dumps({"step": step, "steps_per_sec": rate}) + "\n")
      f.write("{torn\n")   # a torn last line is left out, not fatal

  def write(self, name, obj):
    return bench_rows.write_json(self.dir, name, obj)

  def test_the_row_holds_the_valves_numbers(self):
    final = os.path.join(self.dir, "final.json")
    with open(final, "w") as f:   # as experiments.train prints it, after the valve's lines
      f.write("[drift] step 25: site kept {not json}\n" + json.dumps(
          {"steps": 401, "logloss": 0.5, "drift": {
              "refreshes": 3, "refresh_steps": [25, 50, 180], "seconds": [90.0, 0.5, 0.3],
              "switches": 0, "next_refresh": 310, "stepping_s": 50.0, "share": 0.65,
              "share_after_first": 0.016}}, indent=1) + "\n")
    row = drift_rows.row(self.run_dir, final, "NVIDIA H200", "0.11.2", "2026-12-04", "abc",
                         "bash call.sh")
    self.assertEqual(row["kind"], "drift_run")
    self.assertEqual((row["model"], row["preset"], row["plan"]), ("wukong", "large", "plan_a.json"))
    self.assertEqual((row["cadence"], row["max_overhead"], row["steps"]), (25, 0.02, 401))
    self.assertEqual(row["refresh_steps"], [25, 50, 180])
    self.assertEqual(row["refresh_s"], [90.0, 0.5, 0.3])
    self.assertEqual(row["later_refresh_s"], 0.4)      # the median of 0.5 and 0.3
    self.assertEqual(row["step_ms"], 125.0)            # 50 s over the 400 gaps between steps
    self.assertEqual(row["window_steps_per_s"], [1.5, 7.9, 8.1])
    self.assertEqual((row["share"], row["share_after_first"]), (0.65, 0.016))

  def test_a_run_without_the_valve_is_refused_naming_the_file(self):
    final = self.write("plain.json", {"steps": 10, "logloss": 0.5})
    with self.assertRaisesRegex(drift_rows.DriftRowError, r"plain.json: no \"drift\" entry"):
      drift_rows.row(self.run_dir, final, "cpu", "0", "d", "c", "cmd")
    with open(os.path.join(self.dir, "cut.json"), "w") as f:
      f.write("{\n \"steps\": 4")
    with self.assertRaisesRegex(drift_rows.DriftRowError, "cut.json: holds no final metrics"):
      drift_rows.row(self.run_dir, os.path.join(self.dir, "cut.json"), "cpu", "0", "d", "c",
                     "cmd")
    with self.assertRaisesRegex(drift_rows.DriftRowError, "missing.json: cannot read"):
      drift_rows.row(self.run_dir, os.path.join(self.dir, "missing.json"), "cpu", "0", "d",
                     "c", "cmd")
    self.write("run/config.json", {"run": {"model": "wukong", "preset": "large"}})
    with self.assertRaisesRegex(drift_rows.DriftRowError, "config.json: not a drift run"):
      drift_rows.row(self.run_dir, final, "cpu", "0", "d", "c", "cmd")


if __name__ == "__main__":
  absltest.main()
