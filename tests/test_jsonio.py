"""`loka_jax.jsonio`: JSON-lines appends that survive a line a killed writer left torn."""
import os
import shutil
import tempfile

from absl.testing import absltest

from loka_jax import jsonio


class AppendTest(absltest.TestCase):

  def test_a_row_appended_after_a_torn_line_is_read_whole(self):
    folder = tempfile.mkdtemp(prefix="loka_jsonio_")
    self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
    path = os.path.join(folder, "rows.jsonl")
    jsonio.append_rows(path, [{"seed": 0}])
    with open(path, "a") as f:
      f.write('{"seed": 1, "ne"')   # a kill mid-write: no newline
    jsonio.append_rows(path, [{"seed": 2}])
    read = list(jsonio.jsonl_rows(path))
    self.assertEqual([n for n, _, _ in read], [1, 2, 3])
    self.assertIsNotNone(read[1][2])   # the torn line alone fails to parse
    for _, row, error in (read[0], read[2]):
      self.assertIsNone(error)
      jsonio.check_digest(row, path, "row", "measure it again", ValueError)
    self.assertEqual([read[0][1]["seed"], read[2][1]["seed"]], [0, 2])
    # A file that ends whole gets no blank line.
    jsonio.append_lines(path, ['{"seed": 3}'])
    with open(path) as f:
      lines = f.read().splitlines()
    self.assertLen(lines, 4)
    self.assertEqual(lines[-1], '{"seed": 3}')


if __name__ == "__main__":
  absltest.main()
