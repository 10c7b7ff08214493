"""Criteo TSV reader on generated files: values, missing fields, gzip, the split, the training
stream, and an error naming file, line and column for every kind of malformed input."""
import collections
import gzip
import math
from unittest import mock

import chex
import numpy as np
import pytest
from absl.testing import parameterized

from loka_jax.data import criteo, make, sources
from loka_jax.data.sources import DataFileError
from loka_jax.data.spec import validate_batch

V = 1000


def _random_rows(n, seed):
  """Rows as lists of 40 strings: labels, ints (some negative or empty), hex (some empty)."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    row = [str(int(rng.integers(0, 2)))]
    for _ in range(13):
      row.append("" if rng.random() < 0.2 else str(int(rng.integers(-5, 5000))))
    for _ in range(26):
      row.append("" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}")
    rows.append(row)
  return rows


def _write(path, rows, gz=False, trailing_newline=True):
  text = "\n".join("\t".join(r) for r in rows) + ("\n" if trailing_newline else "")
  opener = gzip.open if gz else open
  with opener(path, "wt") as f:
    f.write(text)
  return str(path)


def _expected(row, transform="log1p"):
  """Label, dense and ids of one row, by the documented rules, in plain Python."""
  dense = []
  for token in row[1:14]:
    if not token:
      dense.append(0.0)
    elif transform == "log1p":
      dense.append(math.log1p(max(int(token), 0)))
    else:
      x = int(token)
      dense.append(math.copysign(math.log1p(abs(x)), x) if x else 0.0)
  ids = [int(t, 16) % (V - 1) + 1 if t else 0 for t in row[14:]]
  return float(row[0]), dense, ids


class ReaderTest(chex.TestCase):

  @pytest.fixture(autouse=True)
  def _tmp(self, tmp_path):
    self.tmp = tmp_path

  def _source(self, path, **config):
    config.setdefault("vocab_size", V)
    return criteo.CriteoSource(str(path), config=config, num_eval=config.pop("num_eval", None))

  @parameterized.parameters("log1p", "signed_log1p")
  def test_values_by_hand(self, transform):
    rows = [["1", "5", "-3", "", "0", "12345678901", "7", "8", "9", "10", "11", "12", "13", "14"]
            + ["a1b2c3d4", "", "FFFFFFFF", "0"] + ["00000001"] * 22,
            ["0"] + [""] * 13 + [""] * 26]
    rows += _random_rows(8, seed=1)
    path = _write(self.tmp / "day.tsv", rows)
    src = self._source(path, dense_transform=transform, missing_indicators=True)
    self.assertEqual(src.features.num_dense, 26)
    batch = src._read(0, len(rows))
    dense = criteo.dense_features(batch["ints"], batch["missing"], transform, True)
    for r, row in enumerate(rows):
      label, expected_dense, ids = _expected(row, transform)
      self.assertEqual(batch["label"][r], label)
      np.testing.assert_allclose(dense[r, :13], expected_dense, rtol=1e-6)
      np.testing.assert_array_equal(dense[r, 13:], [float(not t) for t in row[1:14]])
      np.testing.assert_array_equal(batch["cat_ids"][r], ids)
    self.assertEqual(batch["ints"][0, 1], -3)
    self.assertEqual(batch["ints"][0, 4], 12345678901)

  def test_gzip_directory_and_split(self):
    parts = [_random_rows(300, seed=s) for s in range(3)]
    folder = self.tmp / "days"
    folder.mkdir()
    _write(folder / "day_0.tsv", parts[0])
    _write(folder / "day_1.tsv.gz", parts[1], gz=True)
    _write(folder / "day_2.tsv.gz", parts[2], gz=True, trailing_newline=False)
    (folder / "notes.md").write_text("not data")
    src = self._source(folder, num_eval=250)
    self.assertLen(src.files, 3)
    self.assertEqual((src.num_lines(), src.num_train_examples(), src.num_eval_examples()),
                     (900, 650, 250))
    everything = parts[0] + parts[1] + parts[2]
    batches = list(src.eval_batches(100))
    self.assertLen(batches, 2)  # 250 held out: the partial batch of 50 is dropped
    for b, batch in enumerate(batches):
      validate_batch(batch, src.features)
      for r in range(100):
        label, dense, ids = _expected(everything[650 + 100 * b + r])
        self.assertEqual(batch["label"][r], label)
        np.testing.assert_allclose(batch["dense"][r], dense, rtol=1e-6)
        np.testing.assert_array_equal(batch["sparse_ids"][r, :, 0], ids)

  @parameterized.parameters(False, True)
  def test_scan_blocks_and_index_stride(self, gz):
    """Tiny scan blocks and index strides: lines straddle blocks, seeks land mid-file."""
    rows = _random_rows(120, seed=10)
    path = _write(self.tmp / ("s.tsv.gz" if gz else "s.tsv"), rows, gz=gz)
    with mock.patch.object(criteo, "_SCAN_BLOCK", 777), \
         mock.patch.object(criteo, "_INDEX_STRIDE", 7):
      src = self._source(path, num_eval=20)
      self.assertEqual(src.num_lines(), 120)
      self.assertLen(src._offsets[0], 18)  # lines 0, 7, ..., 119
      for start in (0, 6, 7, 50, 99):
        got = src._read(start, start + 21)
        for r in range(21):
          label, _, ids = _expected(rows[start + r])
          self.assertEqual(got["label"][r], label)
          np.testing.assert_array_equal(got["cat_ids"][r], ids)
      rows[93] = rows[93][:30]
      bad = _write(self.tmp / ("b.tsv.gz" if gz else "b.tsv"), rows, gz=gz)
      with self.assertRaisesRegex(DataFileError, r"line 94: 30 tab-separated columns"):
        self._source(bad)

  def test_default_eval_fraction(self):
    src = self._source(_write(self.tmp / "d.tsv", _random_rows(200, seed=0)))
    self.assertEqual((src.num_train_examples(), src.num_eval_examples()), (180, 20))

  @parameterized.parameters(1, 64, 5000)
  def test_each_epoch_is_the_training_set_once(self, window):
    rows = _random_rows(400, seed=2)
    half = len(rows) // 2
    folder = self.tmp / "split"
    folder.mkdir()
    _write(folder / "a.tsv", rows[:half])
    _write(folder / "b.tsv.gz", rows[half:], gz=True)
    src = self._source(folder, shuffle_window=window, num_eval=40)
    key = lambda label, ids: (float(label),) + tuple(int(i) for i in ids)
    expected = collections.Counter(key(*_expected(r)[::2]) for r in rows[:360])
    for epoch in range(2):
      got = collections.Counter()
      for step in range(epoch * 9, epoch * 9 + 9):  # 9 batches of 40 = 360 lines
        batch = src.train_batch(step, 40)
        validate_batch(batch, src.features)
        got.update(key(l, i) for l, i in zip(batch["label"], batch["sparse_ids"][:, :, 0]))
      self.assertEqual(got, expected)
    if window == 1:  # file order
      first = src.train_batch(0, 40)
      np.testing.assert_array_equal(first["label"], [float(r[0]) for r in rows[:40]])

  def test_batches_are_pure(self):
    path = _write(self.tmp / "d.tsv", _random_rows(500, seed=3))
    a = self._source(path, shuffle_window=100)
    b = self._source(path, shuffle_window=100)
    for step in (7, 0, 3):
      chex.assert_trees_all_equal(a.train_batch(step, 33), b.train_batch(step, 33))
    other_seed = criteo.CriteoSource(path, config={"vocab_size": V, "shuffle_window": 100},
                                     seed=1)
    self.assertFalse(np.array_equal(a.train_batch(0, 33)["sparse_ids"],
                                    other_seed.train_batch(0, 33)["sparse_ids"]))

  def test_make_source(self):
    path = _write(self.tmp / "d.tsv", _random_rows(50, seed=4))
    src = make.make_source("criteo", data_path=path, spec={"vocab_size": 77}, num_eval=10)
    self.assertIsInstance(src, sources.DataSource)
    self.assertEqual(src.features.vocab_sizes, (77,) * 26)
    self.assertIsNone(src.oracle_ne)
    with self.assertRaisesRegex(ValueError, "needs data_path"):
      make.make_source("criteo")


class ErrorTest(parameterized.TestCase):

  @pytest.fixture(autouse=True)
  def _tmp(self, tmp_path):
    self.tmp = tmp_path

  def _rows_with(self, line, column, token, n=30):
    rows = _random_rows(n, seed=5)
    rows[line - 1][column - 1] = token
    return rows

  @parameterized.parameters("nan", "inf", "-inf", "1.5", "1e3", "abc", "--3", "-", "3-",
                            " 4", "0x10", "1234567890123456789")
  def test_bad_integer_names_file_line_and_column(self, token):
    path = _write(self.tmp / "bad.tsv", self._rows_with(17, 5, token))
    src = criteo.CriteoSource(path, config={"shuffle_window": 8}, num_eval=5)
    with self.assertRaisesRegex(DataFileError,
                                r"bad\.tsv, line 17, column 5 \(I4\): .* is not an integer"):
      for step in range(4):
        src.train_batch(step, 8)

  @parameterized.parameters("xyz12345", "12 34", "-1a", "0123456789abcdef0")
  def test_bad_hex_names_file_line_and_column(self, token):
    path = _write(self.tmp / "bad.tsv.gz", self._rows_with(26, 20, token), gz=True)
    src = criteo.CriteoSource(path, num_eval=5)  # line 26 is held out
    with self.assertRaisesRegex(DataFileError,
                                r"bad\.tsv\.gz, line 26, column 20 \(C6\): .* not a hexadecimal"):
      list(src.eval_batches(5))

  @parameterized.parameters("2", "", "-1", "yes")
  def test_bad_label(self, token):
    path = _write(self.tmp / "bad.tsv", self._rows_with(3, 1, token))
    src = criteo.CriteoSource(path, num_eval=5)
    with self.assertRaisesRegex(DataFileError, r"line 3, column 1 \(label\)"):
      src.train_batch(0, 10)

  @parameterized.parameters((False, 39), (False, 41), (True, 39), (True, 1))
  def test_wrong_column_count_names_file_and_line(self, gz, columns):
    rows = _random_rows(5000, seed=6)
    rows[4321] = rows[4321][:columns] + ["7"] * max(0, columns - 40)
    name = "cols.tsv.gz" if gz else "cols.tsv"
    path = _write(self.tmp / name, rows, gz=gz)
    pattern = rf"{name}, line 4322: {columns} tab-separated columns, expected 40"
    with self.assertRaisesRegex(DataFileError, pattern):
      criteo.CriteoSource(path)

  def test_wrong_column_count_on_unterminated_last_line(self):
    rows = _random_rows(10, seed=7)
    rows[-1] = rows[-1][:12]
    path = _write(self.tmp / "end.tsv", rows, trailing_newline=False)
    with self.assertRaisesRegex(DataFileError, r"end\.tsv, line 10: 12 tab-separated columns"):
      criteo.CriteoSource(path)

  def test_blank_line_is_an_error(self):
    rows = _random_rows(10, seed=8)
    text = "\n".join("\t".join(r) for r in rows[:4]) + "\n\n" + "\n".join(
        "\t".join(r) for r in rows[4:]) + "\n"
    (self.tmp / "blank.tsv").write_text(text)
    with self.assertRaisesRegex(DataFileError, r"blank\.tsv, line 5: 1 tab-separated columns"):
      criteo.CriteoSource(str(self.tmp / "blank.tsv"))

  def test_bad_paths_and_config(self):
    with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
      criteo.CriteoSource(str(self.tmp / "missing"))
    empty = self.tmp / "empty"
    empty.mkdir()
    with self.assertRaisesRegex(FileNotFoundError, "holds no files"):
      criteo.CriteoSource(str(empty))
    path = _write(self.tmp / "d.tsv", _random_rows(10, seed=9))
    with self.assertRaisesRegex(ValueError, "cannot hold num_eval=10"):
      criteo.CriteoSource(path, num_eval=10)
    with self.assertRaisesRegex(ValueError, "dense_transform"):
      criteo.CriteoSource(path, config={"dense_transform": "log"})
    with self.assertRaisesRegex(ValueError, "vocab_size"):
      criteo.CriteoSource(path, config={"vocab_size": [10, 20]})
    with self.assertRaisesRegex(ValueError, r"unknown criteo config key\(s\) \['window'\]"):
      criteo.CriteoSource(path, config={"window": 3})
