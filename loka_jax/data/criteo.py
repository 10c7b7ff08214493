"""A streaming reader of Criteo-format TSV files: label, 13 integer and 26 hex categorical columns.

Files (plain or gzip) are concatenated in sorted name order into one stream of lines. The last
`num_eval` lines are the held-out set (Criteo files are in time order); the lines before them
are the training stream, shuffled within fixed windows of `shuffle_window` lines so that only a
window lives in memory. Values: an empty integer field is missing (dense 0, plus an optional
missing indicator); an empty categorical field is the reserved id 0; a hex token t becomes
int(t, 16) % (V - 1) + 1. Anything else malformed is an error naming file, line and column.
"""
from __future__ import annotations

import collections
import dataclasses
import gzip
import os
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from loka_jax.data import sources
from loka_jax.data.sources import DataFileError
from loka_jax.data.spec import FeatureSpec, validate_batch

NUM_INT, NUM_CAT = 13, 26
NUM_COLUMNS = 1 + NUM_INT + NUM_CAT
COLUMN_NAMES = ("label",) + tuple(f"I{i}" for i in range(1, NUM_INT + 1)) + tuple(
    f"C{i}" for i in range(1, NUM_CAT + 1))
DENSE_TRANSFORMS = ("log1p", "signed_log1p")
FILE_SUFFIXES = (".tsv", ".tsv.gz", ".txt", ".txt.gz")
_INDEX_STRIDE = 4096      # a byte offset is kept for every this many lines of a file
_SCAN_BLOCK = 1 << 23     # bytes per block when counting lines
_MAX_INT_DIGITS = 18      # int64-safe
_MAX_HEX_DIGITS = 16      # uint64-safe
_TRAIN_STREAM = 21
_SEQUENTIAL_WINDOW = 1 << 16  # lines read at once when the training stream is not shuffled


@dataclasses.dataclass(frozen=True)
class CriteoConfig:
  """Reader options (JSON keys = field names)."""
  vocab_size: Union[int, Tuple[int, ...]] = 100000  # rows per categorical table (one or 26)
  missing_indicators: bool = False   # add 13 dense 0/1 features: "integer field was empty"
  dense_transform: str = "log1p"     # log(1 + max(x, 0)) | signed_log1p: sign(x) log(1 + |x|)
  eval_fraction: float = 0.1         # held-out share of the lines when num_eval is not given
  shuffle_window: int = 262144       # training lines shuffled together (1: file order)

  def __post_init__(self):
    sizes = self.vocab_size if isinstance(self.vocab_size, tuple) else (self.vocab_size,)
    if len(sizes) not in (1, NUM_CAT) or any(int(v) < 2 for v in sizes):
      raise ValueError(f"criteo config: vocab_size must be one int >= 2 or {NUM_CAT} of them, "
                       f"got {self.vocab_size!r}")
    if self.dense_transform not in DENSE_TRANSFORMS:
      raise ValueError(f"criteo config: dense_transform={self.dense_transform!r}; use one of "
                       f"{DENSE_TRANSFORMS}")
    if not 0 < self.eval_fraction < 1:
      raise ValueError(f"criteo config: eval_fraction={self.eval_fraction} must lie in (0, 1)")
    if self.shuffle_window < 1:
      raise ValueError(f"criteo config: shuffle_window={self.shuffle_window} must be >= 1")

  @property
  def vocab_sizes(self) -> Tuple[int, ...]:
    if isinstance(self.vocab_size, tuple):
      return tuple(int(v) for v in self.vocab_size)
    return (int(self.vocab_size),) * NUM_CAT


def _is_gzip(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(2) == b"\x1f\x8b"


def _open(path: str):
  return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def list_files(data_path: str) -> List[str]:
  """The input files: `data_path` itself, or the Criteo files of a directory in name order."""
  if os.path.isfile(data_path):
    return [data_path]
  if not os.path.isdir(data_path):
    raise FileNotFoundError(f"criteo data_path {data_path!r} does not exist")
  names = sorted(n for n in os.listdir(data_path) if n.endswith(FILE_SUFFIXES))
  if not names:
    raise FileNotFoundError(f"criteo data_path {data_path!r} holds no files ending in "
                            f"{FILE_SUFFIXES}")
  return [os.path.join(data_path, n) for n in names]


def _column_error(where: str, lineno: int, columns: int) -> DataFileError:
  return DataFileError(f"{where}, line {lineno}: {columns} tab-separated columns, expected "
                       f"{NUM_COLUMNS} (label, {NUM_INT} integer, {NUM_CAT} categorical)")


def scan_file(path: str) -> Tuple[int, np.ndarray]:
  """(line count, byte offsets of lines 0, STRIDE, 2*STRIDE, ...); checks every column count
  and that the file reads to its end (a truncated or corrupt gzip file is an error naming it)."""
  try:
    return _scan(path)
  except (EOFError, OSError, zlib.error) as e:  # gzip raises all three for damaged streams
    raise DataFileError(
        f"{path}: cannot read the file to its end ({type(e).__name__}: {e}); it is truncated "
        "or corrupt (an interrupted download or copy?): fetch it again, or move it out of "
        "the data directory") from e


def _scan(path: str) -> Tuple[int, np.ndarray]:
  offsets = [0]
  lines = 0          # complete lines seen
  pos = 0            # bytes consumed
  carry_tabs = 0     # tabs of the line still open at the end of the previous block
  carry_bytes = 0    # its length so far
  with _open(path) as f:
    while True:
      block = f.read(_SCAN_BLOCK)
      if not block:
        break
      buf = np.frombuffer(block, np.uint8)
      newlines = np.flatnonzero(buf == 10)
      tabs = np.flatnonzero(buf == 9)
      if newlines.size:
        per_line = np.diff(np.r_[0, np.searchsorted(tabs, newlines)])
        per_line[0] += carry_tabs
        bad = np.flatnonzero(per_line != NUM_COLUMNS - 1)
        if bad.size:
          raise _column_error(path, lines + int(bad[0]) + 1, int(per_line[bad[0]]) + 1)
        starts = lines + 1 + np.arange(newlines.size)  # 0-based numbers of the next lines
        marks = np.flatnonzero(starts % _INDEX_STRIDE == 0)
        offsets.extend((pos + newlines[marks] + 1).tolist())
        carry_tabs = int(tabs.size - np.searchsorted(tabs, newlines[-1]))
        carry_bytes = len(block) - int(newlines[-1]) - 1
        lines += int(newlines.size)
      else:
        carry_tabs += int(tabs.size)
        carry_bytes += len(block)
      pos += len(block)
  if carry_bytes:  # a last line without its newline
    if carry_tabs != NUM_COLUMNS - 1:
      raise _column_error(path, lines + 1, carry_tabs + 1)
    lines += 1
  offsets = np.asarray(offsets, np.int64)
  return lines, offsets[offsets < pos] if lines else offsets[:1]


def _digits_value(chars: np.ndarray, valid: np.ndarray, base: int) -> np.ndarray:
  """Accumulates the digit values (invalid positions skipped) of a [..., width] uint8 array."""
  dtype = np.uint64 if base == 16 else np.int64
  value = np.zeros(chars.shape[:-1], dtype)
  for pos in range(chars.shape[-1]):
    digit = chars[..., pos]
    if base == 16:
      nibble = np.where(digit <= 57, digit - 48, (digit | 32) - 87).astype(dtype)
    else:
      nibble = (digit.astype(np.int64) - 48)
    value = np.where(valid[..., pos], value * dtype(base) + nibble, value)
  return value


def _first_bad(bad: np.ndarray) -> Tuple[int, int]:
  row, col = np.argwhere(bad)[0]
  return int(row), int(col)


def parse_lines(lines: Sequence[bytes], where: str, first_line: int,
                vocab_sizes: Sequence[int]) -> Dict[str, np.ndarray]:
  """Parses raw lines into label [n], ints [n, 13] (int64), missing [n, 13], cat ids [n, 26]."""
  rows = [line.rstrip(b"\r\n").split(b"\t") for line in lines]
  for i, row in enumerate(rows):
    if len(row) != NUM_COLUMNS:
      raise _column_error(where, first_line + i, len(row))
  table = np.array(rows, dtype=bytes).reshape(len(rows), NUM_COLUMNS)

  def fail(row, col, what):
    token = table[row, col].decode("utf-8", errors="replace")
    raise DataFileError(f"{where}, line {first_line + row}, column {col + 1} "
                        f"({COLUMN_NAMES[col]}): {token!r} {what}")

  label = table[:, 0]
  bad = (label != b"0") & (label != b"1")
  if bad.any():
    fail(int(np.argmax(bad)), 0, "is not a label (0 or 1)")

  def chars_of(sub):
    width = max(sub.dtype.itemsize, 1)
    chars = np.frombuffer(np.ascontiguousarray(sub).tobytes(), np.uint8)
    return chars.reshape(sub.shape + (width,))

  ints = table[:, 1:1 + NUM_INT]
  missing = ints == b""
  c = chars_of(ints)
  digit = (c >= 48) & (c <= 57)
  null = c == 0
  minus = c[..., 0] == 45
  length = (~null).sum(-1)
  ok = (digit | null).all(-1) | (minus & (digit[..., 1:] | null[..., 1:]).all(-1) & (length > 1))
  ok &= ~(null[..., :-1] & ~null[..., 1:]).any(-1)  # no byte after a NUL
  ok &= length - minus <= _MAX_INT_DIGITS
  bad = ~ok & ~missing
  if bad.any():
    row, col = _first_bad(bad)
    fail(row, col + 1, "is not an integer (empty means missing; nan, inf, decimals and words "
         "are errors)")
  value = _digits_value(c, digit, 10)
  value = np.where(minus, -value, value)

  cats = table[:, 1 + NUM_INT:]
  c = chars_of(cats)
  null = c == 0
  lower = c | 32
  hexdigit = ((c >= 48) & (c <= 57)) | ((lower >= 97) & (lower <= 102))
  ok = (hexdigit | null).all(-1) & ~(null[..., :-1] & ~null[..., 1:]).any(-1)
  ok &= (~null).sum(-1) <= _MAX_HEX_DIGITS
  cat_missing = cats == b""
  bad = ~ok & ~cat_missing
  if bad.any():
    row, col = _first_bad(bad)
    fail(row, col + 1 + NUM_INT, "is not a hexadecimal token (empty means missing)")
  hashed = _digits_value(c, hexdigit, 16)
  vocab = np.asarray(vocab_sizes, np.uint64)[None, :]
  ids = (hashed % (vocab - np.uint64(1)) + np.uint64(1)).astype(np.int64)
  ids = np.where(cat_missing, 0, ids).astype(np.int32)
  return {"label": (label == b"1").astype(np.float32), "ints": value, "missing": missing,
          "cat_ids": ids}


def dense_features(ints: np.ndarray, missing: np.ndarray, transform: str,
                   indicators: bool) -> np.ndarray:
  """float32 dense features: the transformed integers (0 where missing) [+ missing flags]."""
  x = ints.astype(np.float64)
  if transform == "log1p":
    x = np.log1p(np.maximum(x, 0.0))
  else:
    x = np.sign(x) * np.log1p(np.abs(x))
  x = np.where(missing, 0.0, x)
  if indicators:
    x = np.concatenate([x, missing.astype(np.float64)], axis=1)
  return x.astype(np.float32)


class CriteoSource:
  """Criteo-format TSV files as a DataSource (see the module docstring for the split)."""

  name = "criteo"
  oracle_ne = None

  def __init__(self, data_path: str, config=None, seed: int = 0, num_eval: Optional[int] = None,
               id_policy: str = "error"):
    self.config = sources.load_config(CriteoConfig, config, "criteo config")
    self.files = list_files(data_path)
    scans = [scan_file(path) for path in self.files]
    self._counts = np.array([count for count, _ in scans], np.int64)
    self._offsets = [offsets for _, offsets in scans]
    self._starts = np.r_[0, np.cumsum(self._counts)]     # global line number of each file start
    total = int(self._starts[-1])
    if num_eval is None:
      num_eval = max(1, int(round(self.config.eval_fraction * total)))
    if num_eval < 1 or num_eval >= total:
      raise ValueError(f"criteo: {total} lines in {data_path} cannot hold num_eval={num_eval} "
                       "held-out lines and a training set")
    self._num_eval = int(num_eval)
    self._num_train = total - self._num_eval
    self.seed, self.id_policy = int(seed), id_policy
    num_dense = NUM_INT * (2 if self.config.missing_indicators else 1)
    self.features = FeatureSpec(num_dense=num_dense, vocab_sizes=self.config.vocab_sizes,
                                bag_size=1)
    self._windows: "collections.OrderedDict[int, Dict[str, np.ndarray]]" = collections.OrderedDict()
    self._orders: "collections.OrderedDict[Tuple[int, int], np.ndarray]" = collections.OrderedDict()

  def num_lines(self) -> int:
    return int(self._starts[-1])

  def num_train_examples(self) -> int:
    return self._num_train

  def num_eval_examples(self) -> int:
    return self._num_eval

  # ---- reading ---------------------------------------------------------------------------------
  def _chunks(self, start: int, stop: int, chunk: int) -> Iterator[Dict[str, np.ndarray]]:
    """Parsed pieces of global lines [start, stop), at most `chunk` lines, each within a file."""
    first = int(np.searchsorted(self._starts, start, side="right")) - 1
    for f in range(first, len(self.files)):
      lo = max(start, int(self._starts[f])) - int(self._starts[f])
      hi = min(stop, int(self._starts[f + 1])) - int(self._starts[f])
      if lo >= hi:
        if self._starts[f] >= stop:
          return
        continue
      path = self.files[f]
      with _open(path) as handle:
        handle.seek(int(self._offsets[f][lo // _INDEX_STRIDE]))
        for _ in range(lo % _INDEX_STRIDE):
          handle.readline()
        line = lo
        while line < hi:
          take = min(chunk, hi - line)
          lines = [handle.readline() for _ in range(take)]
          yield parse_lines(lines, path, line + 1, self.config.vocab_sizes)
          line += take

  def _read(self, start: int, stop: int) -> Dict[str, np.ndarray]:
    parts = list(self._chunks(start, stop, 1 << 16))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def _to_batch(self, parsed: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    n = parsed["label"].shape[0]
    batch = {
        "dense": dense_features(parsed["ints"], parsed["missing"], self.config.dense_transform,
                                self.config.missing_indicators),
        "sparse_ids": parsed["cat_ids"].reshape(n, NUM_CAT, 1),
        "sparse_mask": np.ones((n, NUM_CAT, 1), bool),
        "label": parsed["label"],
    }
    return validate_batch(batch, self.features, self.id_policy)

  # ---- training stream ---------------------------------------------------------------------
  def _window_size(self) -> int:
    lines = self.config.shuffle_window if self._shuffled else _SEQUENTIAL_WINDOW
    return min(lines, self._num_train)

  @property
  def _shuffled(self) -> bool:
    return self.config.shuffle_window > 1

  def _window(self, index: int) -> Dict[str, np.ndarray]:
    if index not in self._windows:
      size = self._window_size()
      start = index * size
      self._windows[index] = self._to_batch(self._read(start, min(start + size, self._num_train)))
      while len(self._windows) > 2:
        self._windows.popitem(last=False)
    self._windows.move_to_end(index)
    return self._windows[index]

  def _order(self, epoch: int, index: int, size: int) -> np.ndarray:
    key = (epoch, index)
    if key not in self._orders:
      self._orders[key] = np.random.default_rng(
          [self.seed, _TRAIN_STREAM, epoch, index]).permutation(size)
      while len(self._orders) > 4:
        self._orders.popitem(last=False)
    return self._orders[key]

  def train_batch(self, step: int, batch_size: int) -> Dict[str, np.ndarray]:
    """Positions step*B .. step*B+B-1 of the endless training stream: epoch after epoch, each
    window of `shuffle_window` lines permuted by (seed, epoch, window)."""
    if step < 0 or batch_size < 1:
      raise ValueError(f"train_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
    position = int(step) * int(batch_size) + np.arange(batch_size, dtype=np.int64)
    epoch, line = np.divmod(position, self._num_train)
    size = self._window_size()
    window, within = np.divmod(line, size)
    out = None
    for e, w in sorted(set(zip(epoch.tolist(), window.tolist()))):
      sel = (epoch == e) & (window == w)
      data = self._window(w)
      n_window = data["label"].shape[0]
      picked = within[sel]
      if self._shuffled:
        picked = self._order(e, w, n_window)[picked]
      if out is None:
        out = {k: np.empty((batch_size,) + v.shape[1:], v.dtype) for k, v in data.items()}
      for k, v in data.items():
        out[k][sel] = v[picked]
    return out

  # ---- held-out set ------------------------------------------------------------------------
  def eval_batches(self, batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
    """The last num_eval lines in file order, full batches only (the last partial one dropped)."""
    if batch_size < 1:
      raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
    full = (self._num_eval // batch_size) * batch_size
    if not full:
      return
    start = self._num_train
    pending: List[Dict[str, np.ndarray]] = []
    have = 0
    for piece in self._chunks(start, start + full, batch_size):
      pending.append(piece)
      have += piece["label"].shape[0]
      while have >= batch_size:
        merged = {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
        yield self._to_batch({k: v[:batch_size] for k, v in merged.items()})
        rest = {k: v[batch_size:] for k, v in merged.items()}
        have -= batch_size
        pending = [rest] if have else []
