"""The hand-made ProbeReports of report_builders.py (the Dispatch tests' reports) are valid
`loka.probe/1` reports, and its timing tables valid `loka.timings/1` tables."""
import chex
from absl.testing import absltest

from loka_jax.probe import timing_table
from report_builders import BASE_US, H100, PASSES, dense_table, entry, report, same_passes, site


class HandMadeReportsTest(chex.TestCase):

  def test_builders_make_valid_reports_and_tables(self):
    r = report({"a/dense_0": site(same_passes({"xla_fp8_rowwise": entry()}))})
    self.assertEqual(sorted(r["sites"]["a/dense_0"]["passes"]), sorted(PASSES))
    e = r["sites"]["a/dense_0"]["passes"]["fwd"]["xla_fp8_rowwise"]
    # time and speedup agree: baseline time / kernel time = speedup at each CI end
    self.assertAlmostEqual(BASE_US / e["time_us"][1], e["speedup"][1])
    table = dense_table(H100, 256, 64, 32, {"xla_bf16": {"fwd": 10.0}})
    timing_table.validate(table, "<table>")

  def test_a_broken_hand_made_report_is_refused(self):
    bad = site(same_passes({"xla_fp8_rowwise": entry()}))
    bad["passes"]["fwd"]["xla_fp8_rowwise"]["sqnr_db"] = [40.0, 30.0, 20.0]
    with self.assertRaisesRegex(ValueError, "lower bound"):
      report({"a": bad})


if __name__ == "__main__":
  absltest.main()
