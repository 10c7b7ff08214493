"""`experiments.report paired_spread`: the spread of each verdict's paired changes, by whether
the arms share their Mods and by recipe, on hand-made rows whose spreads are worked out by
hand."""
import os

from absl.testing import absltest

from bench_rows import quality_row, tempdir
from cli_helpers import run_module
from experiments.tools import paired_spread
from loka_jax import jsonio


def _rows(changes_vs_bf16, changes_vs_bf16_mods, **recipe):
  """DLRM `large` at three seeds: bf16 at 0.5, naive FP8 above it by `changes_vs_bf16`, and
  bf16+Mods below naive FP8 so that naive FP8 is above it by `changes_vs_bf16_mods`."""
  rows = []
  for seed, (d, c) in enumerate(zip(changes_vs_bf16, changes_vs_bf16_mods)):
    naive = 0.5 * (1 + d)
    rows += [quality_row("dlrm", "large", "bf16", seed, 0.5, **recipe),
             quality_row("dlrm", "large", "fp8_naive", seed, naive, **recipe),
             quality_row("dlrm", "large", "bf16_mods", seed, naive / (1 + c), **recipe)]
  return rows


# Naive FP8 against bf16 (the same Mods: none): sd 1.0% under constant rates, 0.5% under the
# cooldown; against bf16+Mods (other Mods): sd 4% and 2%.
ROWS = (_rows((0.01, 0.02, 0.03), (0.0, 0.04, 0.08))
        + _rows((0.01, 0.015, 0.02), (0.0, 0.02, 0.04), cooldown_steps=200))


class PairedSpreadTest(absltest.TestCase):

  def test_spreads_by_mods_and_recipe_are_the_hand_worked_ones(self):
    got = {(e["comparison"].subject, e["reference"]): (round(e["sd"], 6), e["same_mods"])
           for e in paired_spread.spreads(ROWS)}
    self.assertEqual(got, {("synthetic:dlrm/large", "bf16"): (0.01, True),
                           ("synthetic:dlrm/large", "bf16_mods"): (0.04, False),
                           ("synthetic:dlrm/large (cooldown 200)", "bf16"): (0.005, True),
                           ("synthetic:dlrm/large (cooldown 200)", "bf16_mods"): (0.02, False)})
    ratios = paired_spread.recipe_ratios(paired_spread.spreads(ROWS))
    self.assertEqual(sorted(round(r["ratio"], 6) for r in ratios), [2.0, 2.0])
    text = paired_spread.report(ROWS)
    self.assertIn("arms with the same Mods: 0.50%-1.00% (median 0.75%, 2 verdicts)", text)
    self.assertIn("arms with other Mods: 2.00%-4.00% (median 3.00%, 2 verdicts)", text)
    # Summed variances: (1^2 + 4^2) / (0.5^2 + 2^2) = 17 / 4.25 = 4.
    self.assertIn("2 comparisons: 2.00-2.00, geometric mean 2.00; summed variances 4.00", text)

  def test_the_command_reads_row_files_and_refuses_none_in_one_line(self):
    path = os.path.join(tempdir(self), "quality.jsonl")
    jsonio.append_rows(path, ROWS)
    done = run_module("experiments.report", "paired_spread", path)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("| synthetic:dlrm/large (cooldown 200) | naive FP8 | bf16 | yes | 3 | "
                  "+1.500% | 0.50% |", done.stdout)
    none = run_module("experiments.report", "paired_spread")
    self.assertEqual(none.returncode, 1)
    self.assertIn("give one or more quality row files", none.stderr)


if __name__ == "__main__":
  absltest.main()
