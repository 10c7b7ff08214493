"""`python3 -m experiments.timing_cache needs`: what a fresh probe would time on a card,
replayed from a hand-made report against a hand-made table, counted by hand."""
import os

from absl.testing import absltest

import bench_rows
import report_builders as hm
from cli_helpers import run_module
from loka_jax.probe import timing_table
from loka_jax.probe.eligibility import Criteria

KERNELS = ("xla_bf16", "xla_fp8_rowwise", "xla_fp8_tensorwise")


def fp8_passes(tensorwise_fwd_sqnr=30.0):
  passes = hm.same_passes({"xla_fp8_rowwise": hm.entry(), "xla_fp8_tensorwise": hm.entry()})
  passes["fwd"]["xla_fp8_tensorwise"] = hm.entry(sqnr=tensorwise_fwd_sqnr)
  return passes


class TimingNeedsCliTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = bench_rows.tempdir(self)
    # Two sites of one shape, one of another whose tensorwise forward fails the budget.
    sites = {"a": hm.site(fp8_passes()), "b": hm.site(fp8_passes()),
             "c": hm.site(fp8_passes(tensorwise_fwd_sqnr=10.0), lhs=(512, 64))}
    kernels = {k: {} for k in KERNELS}
    self.report = hm.report(sites, kernels=kernels, criteria=Criteria().to_dict())
    # The table has bf16 and rowwise at the first shape only, from one run.
    self.table = hm.dense_table(hm.H100, 256, 64, 32, {
        "xla_bf16": dict.fromkeys(hm.PASSES, 10.0),
        "xla_fp8_rowwise": dict.fromkeys(hm.PASSES, 8.0)})

  def write(self, name, value):
    return bench_rows.write_json(self.dir, name, value)

  def test_counts_what_the_table_leaves_to_time(self):
    report = self.write("report.json", self.report)
    table = os.path.join(self.dir, "table.json")
    timing_table.save_table(self.table, table)
    done = run_module("experiments.timing_cache", "needs", report, f"--table={table}")
    self.assertEqual(done.returncode, 0, done.stderr)
    # Shape of a and b: rowwise reused (3), tensorwise and bf16 measured (6). Shape of c:
    # nothing in the table; tensorwise's forward not safe (1), the other 8 passes measured.
    self.assertIn("14 kernel passes to measure, 3 reused from the table, 1 not timed (no site "
                  "of their shape admits them on accuracy), 0 not timed (dominated", done.stdout)
    self.assertIn("  a: xla_bf16/fwd, xla_bf16/grad_lhs, xla_bf16/grad_rhs, "
                  "xla_fp8_tensorwise/fwd, xla_fp8_tensorwise/grad_lhs, "
                  "xla_fp8_tensorwise/grad_rhs\n", done.stdout)
    self.assertIn("  c: ", done.stdout)
    self.assertNotIn("  b: ", done.stdout)   # one line a shape
    # Entries of another jax minor version are not the card's for this report.
    older = self.write("older.json", {**self.report, "jax": "0.10.2"})
    done = run_module("experiments.timing_cache", "needs", older, f"--table={table}")
    self.assertIn("17 kernel passes to measure, 0 reused", done.stdout)

  def test_bad_input_gets_one_line(self):
    cpu = self.write("cpu.json", hm.report({"a": hm.site(fp8_passes())}, timing_valid=False,
                                           device="cpu", kernels={k: {} for k in KERNELS},
                                           criteria=Criteria().to_dict()))
    gone = os.path.join(self.dir, "gone.json")
    unknown = self.write("unknown.json", {**self.report, "kernels": {"no_such_kernel": {}}})
    for path, says in ((cpu, "a CPU's report: its card is unknown; give --table"),
                       (gone, "gone.json: cannot read the probe report"),
                       (unknown, "unknown kernel 'no_such_kernel'")):
      done = run_module("experiments.timing_cache", "needs", path)
      self.assertNotEqual(done.returncode, 0, path)
      self.assertIn(says, done.stderr)
      self.assertNotIn("Traceback", done.stderr)


if __name__ == "__main__":
  absltest.main()
