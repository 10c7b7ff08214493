"""Kernel usage over probe reports: what the selection picks per pass, for training and for
serving, which per-pass kernels nothing picks, and the command that prints it."""
import gzip
import json
import os
import shutil
import tempfile

from absl.testing import absltest

import report_builders as hm
from cli_helpers import run_module
from loka_jax.dispatch import usage


def _report():
  """Two sites: at `a` XLA tensorwise is the fastest within budget; at `b` it is faster still
  but fails the SQNR budget, so XLA rowwise is picked. The Pallas GEMM is eligible and slow
  everywhere; Flax's delayed op (a fused op) is eligible and slower than bf16 at `a`."""
  slow_pallas = hm.entry(sqnr=30.0, speedup=(0.4, 0.5, 0.6))
  rowwise = hm.entry(sqnr=30.0, speedup=(1.1, 1.2, 1.3))
  a = hm.same_passes({"xla_fp8_tensorwise": hm.entry(sqnr=30.0, speedup=(1.3, 1.4, 1.5)),
                      "xla_fp8_rowwise": rowwise, "pallas_fp8_rowwise": slow_pallas,
                      "flax_fp8_delayed": hm.entry(sqnr=30.0, speedup=(0.8, 0.9, 1.0))})
  b = hm.same_passes({"xla_fp8_tensorwise": hm.entry(sqnr=10.0, speedup=(1.8, 1.9, 2.0)),
                      "xla_fp8_rowwise": rowwise, "pallas_fp8_rowwise": slow_pallas})
  return hm.report({"a": hm.site(a), "b": hm.site(b)})


class KernelUsageTest(absltest.TestCase):

  def test_counts_follow_the_budget(self):
    got = usage.kernel_usage([_report(), _report()])
    # Per report: 2 sites x 3 passes timed (Flax's op only at `a`); tensorwise picked at `a`
    # (3 passes, its forward served), rowwise at `b`; tensorwise is the fastest timed in
    # every pass of both sites, though ineligible at `b`.
    self.assertEqual({k: (v["timed"], v["picked"], v["served"], v["fastest"])
                      for k, v in got.items()},
                     {"xla_bf16": (12, 0, 0, 0), "xla_fp8_tensorwise": (12, 6, 2, 12),
                      "xla_fp8_rowwise": (12, 6, 2, 0), "pallas_fp8_rowwise": (12, 0, 0, 0),
                      "flax_fp8_delayed": (6, 0, 0, 0)})
    # Within the error budget, speed aside: tensorwise (SQNR 10) not at `b`; the baseline is
    # not counted.
    self.assertEqual({k: v["safe"] for k, v in got.items()},
                     {"xla_bf16": 0, "xla_fp8_tensorwise": 6, "xla_fp8_rowwise": 12,
                      "pallas_fp8_rowwise": 12, "flax_fp8_delayed": 6})
    self.assertAlmostEqual(got["xla_fp8_tensorwise"]["max_speedup"], 1.9)
    self.assertAlmostEqual(got["pallas_fp8_rowwise"]["max_speedup"], 0.5)
    # The slow Pallas GEMM is droppable; the fused op is kept (validation may promote it),
    # and so is the baseline.
    self.assertEqual(usage.droppable(got), ["pallas_fp8_rowwise"])
    self.assertEqual(usage.kept_kernels(got), ["xla_bf16", "xla_fp8_rowwise",
                                               "xla_fp8_tensorwise", "flax_fp8_delayed"])
    # A stricter budget changes the picks: tensorwise (SQNR 30) is out everywhere.
    from loka_jax.probe.eligibility import Criteria
    strict = usage.kernel_usage([_report()], Criteria(min_sqnr_fwd_db=35.0,
                                                       min_sqnr_grad_db=35.0))
    self.assertEqual(strict["xla_fp8_tensorwise"]["picked"], 0)
    self.assertEqual(strict["xla_bf16"]["picked"], 6)

  def test_the_passes_a_report_left_untimed_count_with_the_cards_table_when_asked(self):
    # The probe timed tensorwise (1.4x) and left rowwise untimed; the card's table times
    # rowwise at 0.83x bf16 in the forward and 2x in the input gradient (no weight gradient).
    rep = hm.rowwise_untimed_report()
    directory = tempfile.mkdtemp(prefix="loka_usage_tables_")
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    hm.save_h100_table(directory, {"xla_fp8_rowwise": {"fwd": 12.0, "grad_lhs": 5.0}})
    plain = usage.kernel_usage([rep], table_dir=directory)
    self.assertEqual((plain["xla_fp8_rowwise"]["timed"], plain["xla_fp8_rowwise"]["picked"]),
                     (0, 0))
    filled = usage.kernel_usage([rep], table_dir=directory, fill_from_table=True)
    rowwise = filled["xla_fp8_rowwise"]
    self.assertEqual((rowwise["timed"], rowwise["picked"], rowwise["served"],
                      rowwise["fastest"]), (2, 1, 0, 1))
    self.assertAlmostEqual(rowwise["max_speedup"], 2.0)
    self.assertAlmostEqual(rowwise["max_fwd_speedup"], 10.0 / 12.0)
    tensorwise = filled["xla_fp8_tensorwise"]   # the forward and the weight gradient
    self.assertEqual((tensorwise["picked"], tensorwise["served"]), (2, 1))

  def test_the_command_reads_gzipped_reports_and_refuses_a_corrupt_one(self):
    tmp = tempfile.mkdtemp(prefix="loka_usage_")
    good = os.path.join(tmp, "probe_report.json.gz")
    with gzip.open(good, "wt") as f:
      json.dump(_report(), f)
    out = os.path.join(tmp, "usage.json")
    run = lambda *args: run_module("experiments.report", "kernel_usage", *args, timeout=120)
    # Every pass of this report is timed, so filling from the card's table changes no count.
    done = run(good, f"--out={out}", "--fill_from_table")
    self.assertEqual(done.returncode, 0, done.stderr)
    self.assertIn("untimed passes filled from the card table", done.stdout)
    self.assertIn("per-pass kernels no selection picked: pallas_fp8_rowwise", done.stdout)
    self.assertIn("| xla_fp8_tensorwise | 3 | 6 | 3 | 1 | 6 | 1.90x | 1.90x |", done.stdout)
    self.assertIn("| xla_bf16 | - | 6 |", done.stdout)
    self.assertIn("--probe_kernels=xla_bf16,xla_fp8_rowwise,xla_fp8_tensorwise,"
                  "flax_fp8_delayed", done.stdout)
    with open(out) as f:
      written = json.load(f)
    self.assertEqual(written["usage"]["xla_fp8_rowwise"]["picked"], 3)
    self.assertTrue(written["fill_from_table"])
    bad = os.path.join(tmp, "broken.json.gz")
    with open(bad, "wb") as f:
      f.write(b"\x1f\x8b not gzip")
    refused = run(good, bad)
    self.assertNotEqual(refused.returncode, 0)
    self.assertIn(f"{bad}: not a readable probe report", refused.stderr)


if __name__ == "__main__":
  absltest.main()
