"""notebooks/03_dispatch.ipynb runs top to bottom at tiny size: the error-budget sweep table,
the speedup-vs-NE plot, and the speed axis marked as estimated on a CPU."""
import os
import re

import chex
from absl.testing import absltest

from cli_helpers import REPO
from notebook_helpers import outputs, run_tiny

NOTEBOOK = os.path.join(REPO, "notebooks", "03_dispatch.ipynb")


class DispatchNotebookTest(chex.TestCase):

  def test_sweeps_the_budget_at_tiny_size(self):
    nb, text = run_tiny(NOTEBOOK)
    self.assertEqual(outputs(nb, "error"), [])
    self.assertIn("probed 3 sites", text)
    row = r"^\s+(\d+)dB\s+(\d+)\s+([\d.]+)x\s+(\S+(?: \S+)?)\s+([\d.]+)\s+([+-][\d.]+)%"
    rows = re.findall(row, text, flags=re.M)
    self.assertLen(rows, 5)                                   # one row per SQNR bar
    fp8_passes = [int(r[1]) for r in rows]
    # A looser bar never puts fewer passes on FP8; the loosest puts some, the tightest none.
    self.assertEqual(fp8_passes, sorted(fp8_passes, reverse=True))
    self.assertGreater(fp8_passes[0], 0)
    self.assertEqual(fp8_passes[-1], 0)
    self.assertAlmostEqual(float(rows[-1][2]), 1.0)          # all-bf16 plan: no speedup
    self.assertEqual(float(rows[-1][5]), 0.0)                # ... and the bf16 NE exactly
    self.assertIn("(estimated)", text)                       # a CPU has no measured timing
    images = [o for o in outputs(nb, "display_data") if "image/png" in o["data"]]
    self.assertLen(images, 1)


if __name__ == "__main__":
  absltest.main()
