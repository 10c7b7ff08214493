"""docs/RESULTS.md is exactly what `python3 -m experiments.report results` makes from the rows
docs/results/manifest.json lists, and a broken manifest is a one-line error."""
import json
import os
import tempfile

from absl import app
from absl.testing import absltest

from cli_helpers import REPO, run_module
from experiments.tools import results

MANIFEST = os.path.join(REPO, "docs", "results", "manifest.json")


class ResultsPageTest(absltest.TestCase):

  def test_the_committed_page_is_what_the_manifest_makes(self):
    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
      committed = f.read()
    self.assertEqual(results.page(MANIFEST), committed,
                     "docs/RESULTS.md is stale: run `python3 -m experiments.report results`")

  def test_the_page_reads_every_listed_row_file_and_counts_the_targets(self):
    with open(MANIFEST) as f:
      manifest = json.load(f)
    text = results.page(MANIFEST)
    self.assertIn(manifest["device"], text)
    for name in manifest["rows"]:
      self.assertIn(name, text)
    self.assertRegex(text, r"\d+ targets met, \d+ missed")
    self.assertIn("## Targets at a glance", text)

  def test_a_manifest_naming_a_missing_file_is_one_line_naming_it(self):
    folder = tempfile.mkdtemp(prefix="loka_manifest_")
    path = os.path.join(folder, "manifest.json")
    with open(path, "w") as f:
      json.dump({"device": "NVIDIA H200", "rows": ["gone.jsonl"], "served_quality": []}, f)
    with self.assertRaisesRegex(app.UsageError, r"names 1 missing file\(s\): gone.jsonl"):
      results.load_manifest(path)
    with open(path, "w") as f:
      json.dump({"rows": []}, f)
    with self.assertRaisesRegex(app.UsageError, "needs 'device'"):
      results.load_manifest(path)

  def test_check_fails_on_a_stale_page(self):
    stale = os.path.join(tempfile.mkdtemp(prefix="loka_results_"), "RESULTS.md")
    with open(stale, "w") as f:
      f.write("# Results\n")
    done = run_module("experiments.report", "results", "--check", f"--out={stale}",
                      timeout=300)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    self.assertIn("is not what", done.stderr)


if __name__ == "__main__":
  absltest.main()
