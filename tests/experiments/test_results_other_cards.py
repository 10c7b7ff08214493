"""RESULTS' quality on other devices (experiments/tools/results_other_cards.py): rows measured on a
card other than the page's, or on the CPU, are judged by the paired rule in a section of their
own, with the commit and command the manifest records for their file, and a paired plot per
card; a file holding the page's own card's rows or speed rows, or an entry without its
provenance, is refused in one line."""
import json
import os

from absl import app
from absl.testing import absltest

from bench_rows import tempdir
from experiments.tools import results, results_other_cards as other_cards
from experiments.tools.results_sections import ManifestError
from loka_jax import jsonio

H100 = "NVIDIA H100 80GB HBM3"
# Held-out log loss per seed: naive FP8 is 1.0%, 1.2% and 0.8% above bf16+Mods.
LOGLOSS = {"bf16_mods": (0.5, 0.6, 0.4), "fp8_naive": (0.505, 0.6072, 0.4032)}


def _row(arm, seed, logloss, device=H100, suite="quality"):
  # Arms at one seed share its data order and initial weights; every row one held-out set.
  return {"suite": suite, "data": "movielens", "model": "dlrm", "preset": "tiny", "arm": arm,
          "seed": seed, "device": device, "jax": "0.11.2",
          "precision": "fp8_all" if arm.startswith("fp8") else "bf16",
          "mods": ["all"] if arm == "bf16_mods" else [], "logloss": logloss, "ne": logloss,
          "auc": 0.7, "num_eval_examples": 1000, "steps": 100, "peak_loss": 0.7,
          "peak_step": 1, "eval_fingerprint": "e", "train_fingerprint": f"t{seed}",
          "init_fingerprint": f"i{seed}"}


class OtherCardsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempdir(self)

  def write(self, name, rows):
    path = os.path.join(self.dir, name)
    jsonio.append_rows(path, rows)
    return path

  def rows_file(self, name="quality_movielens_tiny_h100_2026-12-05.jsonl"):
    return self.write(name, [_row(arm, seed, loss) for arm, losses in LOGLOSS.items()
                             for seed, loss in enumerate(losses)])

  def test_the_section_judges_by_the_paired_rule_and_names_the_rows_provenance(self):
    path = self.rows_file()
    text = other_cards.section([(path, "abc1234", "bash call.sh")], "NVIDIA H200",
                               os.path.join(self.dir, "paired"))
    # Mean +1.0%, sd 0.2%: half-width t(2) 4.303 x 0.2% / sqrt(3) = 0.497%, so the interval
    # [+0.503%, +1.497%] lies above +0.02%: missed.
    self.assertIn("### On the NVIDIA H100 80GB HBM3", text)
    self.assertIn("| movielens:dlrm/tiny | naive FP8 | bf16+Mods | 3 | +1.000% | "
                  "[+0.503%, +1.497%] | missed (peer) | - |", text)
    self.assertIn("](results/paired_h100_80gb_hbm3.png)", text)
    self.assertIn("| movielens | dlrm | tiny | fp8_naive | 0,1,2 | 0.50513 |", text)
    self.assertIn("Rows: `quality_movielens_tiny_h100_2026-12-05.jsonl`: NVIDIA H100 80GB "
                  "HBM3, jax 0.11.2, 2026-12-05, commit abc1234, `bash call.sh`.", text)

  def test_cpu_rows_get_a_section_of_their_own_named_for_the_cpu(self):
    cpu = self.write("quality_movielens_tiny_cpu_2026-12-05.jsonl",
                     [_row(arm, seed, loss, device="cpu") for arm, losses in LOGLOSS.items()
                      for seed, loss in enumerate(losses)])
    text = other_cards.section([(self.rows_file(), "abc1234", "bash call.sh"),
                                (cpu, "def5678", "python3 -m experiments.bench")],
                               "NVIDIA H200", os.path.join(self.dir, "paired"))
    self.assertIn("### On the NVIDIA H100 80GB HBM3", text)
    self.assertIn("### On the CPU", text)
    self.assertIn("](results/paired_cpu.png)", text)
    self.assertIn("`quality_movielens_tiny_cpu_2026-12-05.jsonl`: cpu, jax 0.11.2, "
                  "2026-12-05, commit def5678, `python3 -m experiments.bench`", text)

  def test_each_cards_plot_is_drawn_and_check_sees_a_missing_one(self):
    paths, stem = [self.rows_file()], os.path.join(self.dir, "paired")
    self.assertEqual(other_cards.missing_plots(paths, "NVIDIA H200", stem),
                     [stem + "_h100_80gb_hbm3.png"])
    self.assertEqual(other_cards.write_plots(paths, "NVIDIA H200", stem),
                     [stem + "_h100_80gb_hbm3.png"])
    with open(stem + "_h100_80gb_hbm3.png", "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    self.assertEqual(other_cards.missing_plots(paths, "NVIDIA H200", stem), [])

  def test_rows_of_the_pages_card_or_of_a_speed_suite_are_refused_naming_the_file(self):
    path = self.rows_file()
    with self.assertRaisesRegex(ManifestError, "quality_movielens_tiny_h100_2026-12-05.jsonl "
                                "holds rows of the NVIDIA H100 80GB HBM3, the page's own card"):
      other_cards.section([(path, "c", "cmd")], H100)
    speed = self.write("speed.jsonl", [{**_row("bf16", 0, 0.5), "suite": "models"}])
    with self.assertRaisesRegex(ManifestError, "speed.jsonl holds a 'models' row"):
      other_cards.section([(speed, "c", "cmd")], "NVIDIA H200")

  def test_a_manifest_entry_without_its_commit_or_command_is_one_line(self):
    self.rows_file("rows.jsonl")
    manifest = os.path.join(self.dir, "manifest.json")
    entry = {"file": "rows.jsonl", "commit": "abc1234", "command": "bash call.sh"}
    for entries, says in (([{"file": "rows.jsonl", "commit": "abc1234"}],
                           r"quality_other_cards\[0\] needs 'file', 'commit' and 'command'"),
                          (["rows.jsonl"], r"quality_other_cards\[0\] needs"),
                          ([{**entry, "file": "gone.jsonl"}],
                           r"names 1 missing file\(s\): gone.jsonl")):
      with open(manifest, "w") as f:
        json.dump({"device": "NVIDIA H200", "rows": [], "served_quality": [],
                   "quality_other_cards": entries}, f)
      with self.assertRaisesRegex(app.UsageError, says):
        results.load_manifest(manifest)
    with open(manifest, "w") as f:
      json.dump({"device": "NVIDIA H200", "rows": [], "served_quality": [],
                 "quality_other_cards": [entry], "quality_other_cards_plot": "paired"}, f)
    loaded = results.load_manifest(manifest)
    self.assertEqual(loaded.quality_other_cards,
                     ((os.path.join(self.dir, "rows.jsonl"), "abc1234", "bash call.sh"),))
    self.assertEqual(loaded.quality_other_cards_plot, os.path.join(self.dir, "paired"))


if __name__ == "__main__":
  absltest.main()
