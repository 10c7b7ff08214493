"""notebooks/04_your_model.ipynb runs top to bottom at tiny size: a plain Flax two-tower model
probed in its own loop, its sites named by their Linen paths, the towers' dot product listed as
unrouted, a plan trained and plotted against all-bf16, validated and saved."""
import os
import re

import chex
from absl.testing import absltest

from cli_helpers import REPO
from notebook_helpers import outputs, run_tiny

NOTEBOOK = os.path.join(REPO, "notebooks", "04_your_model.ipynb")
# The notebook's Dense layers by Linen path, with their tiny shapes (batch 64; 16 embedding
# + 4 dense features -> 32 -> 32 per tower).
SITES = {"user_tower/dense_0": "64x20 . 20x32", "user_tower/dense_1": "64x32 . 32x32",
         "item_tower/dense_0": "64x20 . 20x32", "item_tower/dense_1": "64x32 . 32x32"}
VERDICTS = ("met", "missed", "unresolved", "not applicable")


class YourModelNotebookTest(chex.TestCase):

  def test_runs_the_tiny_two_tower(self):
    nb, text = run_tiny(NOTEBOOK)
    self.assertEqual(outputs(nb, "error"), [])

    # The user's own bf16 loop learns from the teacher, and the probe saw its batches.
    first, last = map(float, re.search(r"bf16 training: loss ([\d.]+) -> ([\d.]+)", text).groups())
    self.assertLess(last, first)
    self.assertIn("the probe observed 4 batches", text)

    # Every Dense layer is a site of the report's table, named by its path, at its shape.
    for site, shape in SITES.items():
      self.assertRegex(text, rf"(?m)^{re.escape(site)}\s+{re.escape(shape)}\s+xla_")
      self.assertRegex(text, rf"(?m)^{re.escape(site)}\s+fwd\s+xla_")   # ... and of the plan
    # The towers' einsum is no site: listed as unrouted, users x width by items x width.
    unrouted = text.split("unrouted products", 1)[1].split("\nsite ", 1)[0]
    products = re.findall(r"(?m)^  (dot_general .*)$", unrouted)
    self.assertLen(products, 1)         # the embedding lookups are gathers, the norms sums
    self.assertRegex(products[0], r"^dot_general \[64, 32\] x \[64, 32\]")

    self.assertRegex(text, r"final training loss: plan [\d.]+, all-bf16 [\d.]+")
    images = [o for o in outputs(nb, "display_data") if "image/png" in o["data"]]
    self.assertLen(images, 1)

    verdict = re.search(r"(?m)^verdict: (.+)$", text).group(1).strip()
    self.assertIn(verdict, VERDICTS)
    for round_verdict in re.findall(r"(?m)^round \d+: \d+ FP8 forwards, verdict (.+)$", text):
      self.assertIn(round_verdict.strip(), VERDICTS)
    self.assertRegex(text, r"relative held-out loss change [+-][\d.]+% \(95% CI "
                     if verdict != "not applicable" else r"plan runs no FP8 product")

    # The saved plan reads back, with its validation rounds.
    import loka_jax
    path = re.search(r"(?m)^saved (\S+plan\.json)$", text).group(1)
    plan = loka_jax.read_plan(path)
    self.assertEqual(sorted(plan["sites"]), sorted(SITES))
    self.assertEqual(plan["validation"][-1]["verdict"], verdict)


if __name__ == "__main__":
  absltest.main()
