"""Result rows carry the sha256 of their content: a row changed after it was written is
measured again by the run that owns the file, and refused by name when a report reads it."""
import io
import json
import os
import tempfile
from contextlib import redirect_stdout

from absl.testing import absltest

from experiments.bench import collect, results

ROW = {"suite": "models", "model": "dlrm", "preset": "tiny", "variant": "bf16",
       "device": "cpu", "train": {"speedup": 1.0}}


class RowDigestTest(absltest.TestCase):

  def write(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rows_"), "models.jsonl")
    results.ResultsFile(path, ("model", "variant")).append(ROW)
    return path

  def test_a_clean_row_reads_back_without_its_digest(self):
    path = self.write()
    with open(path) as f:
      self.assertIn("sha256", json.loads(f.readline()))
    self.assertEqual(list(results.ResultsFile(path, ("model", "variant")).rows()), [ROW])
    self.assertEqual(collect.read_rows([path]), [ROW])

  def test_a_changed_row_is_measured_again_or_refused_by_name(self):
    path = self.write()
    with open(path) as f:
      text = f.read()
    with open(path, "w") as f:
      f.write(text.replace('"speedup": 1.0', '"speedup": 1.5'))
    out = io.StringIO()
    with redirect_stdout(out):
      again = results.ResultsFile(path, ("model", "variant"))
    self.assertFalse(again.done(("dlrm", "bf16")))
    self.assertIn(f"{path}:1: the row does not match its sha256", out.getvalue())
    with self.assertRaisesRegex(collect.RowsError, f"^{path}:1: the row does not match"):
      collect.read_rows([path])

  def test_rows_written_before_rows_carried_a_digest_still_read(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rows_"), "models.jsonl")
    with open(path, "w") as f:
      f.write(json.dumps(ROW) + "\n")
    self.assertEqual(collect.read_rows([path]), [ROW])


if __name__ == "__main__":
  absltest.main()
