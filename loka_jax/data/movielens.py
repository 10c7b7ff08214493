"""MovieLens-100K as CTR data, read from the `recbole==1.2.1` wheel without importing recbole.

The wheel ships `recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}`: tab-separated
"atomic" files whose header names each column as `name:type`. The data's licence forbids
redistribution, so it is fetched with pip into a cache directory and never committed.

Examples: one per rating, label = rating >= 4, in time order; the last `test_fraction` of all
ratings by timestamp is the held-out set. Each example carries the user's earlier ratings as a
right-aligned behaviour sequence (item, rating), most recent event last.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from loka_jax import jsonio
from loka_jax.data import sources
from loka_jax.data.sources import DataFileError
from loka_jax.data.spec import FeatureSpec, validate_batch

RECBOLE_REQUIREMENT = "recbole==1.2.1"
RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
RECBOLE_WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
MEMBER_DIR = "recbole/dataset_example/ml-100k"
PARTS = ("inter", "user", "item")
DEFAULT_CACHE = os.path.join("~", ".cache", "loka_jax", "movielens")
CACHE_VERSION = 2   # the parsed cache's layout; 2: with its digest (`DIGEST_KEY`)

SPARSE_NAMES = ("user", "item", "age_bucket", "gender", "occupation", "zip_prefix",
                "release_year", "genres")
DENSE_NAMES = ("age", "item_popularity", "user_history_length", "time")
SEQ_NAMES = ("item", "rating")
AGE_EDGES = (18, 25, 35, 45, 50, 56)   # buckets <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
YEAR_BASE, YEAR_SPAN = 1900, 110       # release year id = 1 + clip(year - 1900, 0, 110)
_TRAIN_STREAM = 11

_REQUIRED = {
    "inter": ("user_id", "item_id", "rating", "timestamp"),
    "user": ("user_id", "age", "gender", "occupation", "zip_code"),
    "item": ("item_id", "release_year", "class"),
}


@dataclasses.dataclass(frozen=True)
class MovieLensConfig:
  """How ratings become CTR examples (JSON keys = field names)."""
  seq_len: int = 32               # behaviour-sequence length (earlier ratings of the user)
  test_fraction: float = 0.2      # the latest ratings by timestamp form the held-out set
  label_threshold: float = 4.0    # label = rating >= threshold
  genre_bag: int = 6              # bag size (genres per movie; ML-100K has at most 6)

  def __post_init__(self):
    if self.seq_len < 1 or self.genre_bag < 1:
      raise ValueError(f"movielens config: seq_len and genre_bag must be >= 1: {self}")
    if not 0 < self.test_fraction < 1:
      raise ValueError(f"movielens config: test_fraction={self.test_fraction} must lie in (0, 1)")


# ---- fetching --------------------------------------------------------------------------------


def fetch_recbole_wheel(cache_dir: Optional[str] = None, timeout_s: float = 600) -> str:
  """The path of the recbole wheel in `cache_dir`, downloaded with pip on first use."""
  cache_dir = os.path.expanduser(cache_dir or DEFAULT_CACHE)
  wheel = os.path.join(cache_dir, RECBOLE_WHEEL)
  if not os.path.exists(wheel):
    os.makedirs(cache_dir, exist_ok=True)
    # Download into a private folder, then move: an interrupted pip leaves no half wheel behind.
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
      cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             RECBOLE_REQUIREMENT, "-d", tmp]
      try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
      except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {' '.join(cmd)}: {e}. Without network, copy "
                           f"{RECBOLE_WHEEL} into {cache_dir} or give the source a "
                           "data_path") from e
      got = os.path.join(tmp, RECBOLE_WHEEL)
      if done.returncode != 0 or not os.path.exists(got):
        tail = (done.stderr or done.stdout or "").strip()[-1500:]
        raise RuntimeError(f"pip could not download {RECBOLE_REQUIREMENT} (exit "
                           f"{done.returncode}): {tail}\nWithout network, copy {RECBOLE_WHEEL} "
                           f"into {cache_dir} or give the source a data_path")
      os.replace(got, wheel)
    logging.info("downloaded %s to %s", RECBOLE_WHEEL, wheel)
  digest = jsonio.file_sha256(wheel)
  if digest != RECBOLE_WHEEL_SHA256:
    raise DataFileError(f"{wheel} is corrupt or truncated (sha256 {digest}, expected "
                        f"{RECBOLE_WHEEL_SHA256}); delete it and run again to re-download")
  return wheel


# ---- reading the atomic files --------------------------------------------------------------------
def read_raw_files(path: str) -> Dict[str, Tuple[str, bytes]]:
  """{part: (where, bytes)} of ml-100k.{inter,user,item} from a wheel/zip or a directory."""
  if os.path.isdir(path):
    out = {}
    for part in PARTS:
      name = os.path.join(path, f"ml-100k.{part}")
      if not os.path.isfile(name):
        raise FileNotFoundError(f"{path} has no ml-100k.{part} (expected ml-100k.inter, "
                                ".user and .item)")
      with open(name, "rb") as f:
        out[part] = (name, f.read())
    return out
  if not os.path.isfile(path):
    raise FileNotFoundError(f"MovieLens source {path!r} does not exist")
  try:
    with zipfile.ZipFile(path) as z:
      names = set(z.namelist())
      out = {}
      for part in PARTS:
        member = f"{MEMBER_DIR}/ml-100k.{part}"
        if member not in names:
          raise DataFileError(f"{path} has no member {member}; is it the {RECBOLE_WHEEL} wheel?")
        out[part] = (f"{path}:{member}", z.read(member))
      return out
  except (zipfile.BadZipFile, zlib.error, EOFError) as e:
    raise DataFileError(f"{path} is not a readable zip/wheel ({e}): corrupt or truncated; "
                        "delete it and run again to re-download") from e


class _Table:
  """The required columns of one atomic file as lists of strings, with their line numbers."""

  def __init__(self, where: str, raw: bytes, required: Sequence[str]):
    self.where = where
    lines = raw.decode("utf-8", errors="replace").split("\n")
    header = lines[0].rstrip("\r").split("\t")
    names = [h.split(":")[0] for h in header]
    missing = [r for r in required if r not in names]
    if missing:
      raise DataFileError(f"{where}, line 1: the header lacks column(s) {missing}; it has "
                          f"{header} (atomic headers look like 'user_id:token')")
    index = [names.index(r) for r in required]
    self.columns: Dict[str, List[str]] = {r: [] for r in required}
    self.lines: List[int] = []
    for lineno, line in enumerate(lines[1:], start=2):
      line = line.rstrip("\r")
      if not line:
        continue  # the trailing newline, or blank lines
      fields = line.split("\t")
      if len(fields) != len(names):
        raise DataFileError(f"{where}, line {lineno}: {len(fields)} tab-separated fields, the "
                            f"header has {len(names)} ({names})")
      for r, i in zip(required, index):
        self.columns[r].append(fields[i])
      self.lines.append(lineno)

  def __len__(self):
    return len(self.lines)

  def numbers(self, column: str, kind=float, allow_empty: bool = False,
              empty_value=-1) -> np.ndarray:
    """A numeric column; anything unparsable or non-finite is an error naming line and column."""
    out = []
    for value, lineno in zip(self.columns[column], self.lines):
      if allow_empty and not value.strip():
        out.append(empty_value)
        continue
      try:
        number = kind(value)
      except ValueError:
        number = None
      if number is None or not np.isfinite(number):
        raise DataFileError(f"{self.where}, line {lineno}, column {column!r}: {value!r} is not "
                            f"a finite {'integer' if kind is int else 'number'}")
      out.append(number)
    return np.asarray(out, np.int64 if kind is int else np.float64)

  def id_index(self, column: str) -> Dict[str, int]:
    """Maps each id token to 1..n in sorted order (0 stays free for 'unknown'); no duplicates."""
    tokens = self.columns[column]
    seen: Dict[str, int] = {}
    for token, lineno in zip(tokens, self.lines):
      if token in seen:
        raise DataFileError(f"{self.where}, line {lineno}, column {column!r}: id {token!r} "
                            f"repeats line {seen[token]}")
      if not token.strip():
        raise DataFileError(f"{self.where}, line {lineno}, column {column!r}: empty id")
      seen[token] = lineno
    return {t: i + 1 for i, t in enumerate(sorted(seen, key=_token_order))}

  def lookup(self, column: str, index: Dict[str, int], table: str) -> np.ndarray:
    out = np.empty(len(self), np.int32)
    for k, (token, lineno) in enumerate(zip(self.columns[column], self.lines)):
      found = index.get(token)
      if found is None:
        raise DataFileError(f"{self.where}, line {lineno}, column {column!r}: id {token!r} has "
                            f"no row in the {table} file (out of vocabulary)")
      out[k] = found
    return out


def _token_order(token: str):
  """Numeric ids sort by value, others after them by text."""
  return (0, int(token), "") if token.isdigit() else (1, 0, token)


def _vocabulary(values: Sequence[str]) -> List[str]:
  return sorted({v for v in values if v})


def parse_files(raw: Dict[str, Tuple[str, bytes]]) -> Dict[str, np.ndarray]:
  """Parses the three atomic files into arrays (ids remapped to 1..n, 0 = unknown)."""
  inter = _Table(*raw["inter"], _REQUIRED["inter"])
  user = _Table(*raw["user"], _REQUIRED["user"])
  item = _Table(*raw["item"], _REQUIRED["item"])
  if not len(inter) or not len(user) or not len(item):
    raise DataFileError(f"MovieLens files hold no rows: inter {len(inter)}, user {len(user)}, "
                        f"item {len(item)}")
  user_index, item_index = user.id_index("user_id"), item.id_index("item_id")
  num_users, num_items = len(user_index), len(item_index)

  def by_index(table: _Table, index: Dict[str, int], column: str, values: np.ndarray):
    out = np.zeros((len(index) + 1,) + values.shape[1:], values.dtype)
    rows = np.array([index[t] for t in table.columns[column]])
    out[rows] = values
    return out

  occupations = _vocabulary(user.columns["occupation"])
  occ_id = {o: i + 1 for i, o in enumerate(occupations)}
  gender_id = {"M": 1, "F": 2}
  zips = [z.strip()[:1] for z in user.columns["zip_code"]]
  zip_id = np.array([0 if not z else (1 + int(z)) if z.isdigit() else 11 for z in zips], np.int32)
  user_cols = {
      "age": user.numbers("age", int, allow_empty=True),
      "gender": np.array([gender_id.get(g.strip().upper(), 0) for g in user.columns["gender"]]),
      "occupation": np.array([occ_id.get(o, 0) for o in user.columns["occupation"]]),
      "zip": zip_id,
  }
  genre_lists = [c.split() for c in item.columns["class"]]
  genres = sorted({g for gl in genre_lists for g in gl})
  genre_id = {g: i + 1 for i, g in enumerate(genres)}
  width = max(1, max(len(gl) for gl in genre_lists))
  item_genres = np.zeros((len(item), width), np.int32)
  for row, gl in enumerate(genre_lists):
    item_genres[row, :len(gl)] = [genre_id[g] for g in gl]
  years = []
  for value in item.columns["release_year"]:  # the real file holds 'V' and 'unkonwn': unknown
    value = value.strip()
    years.append(int(value) if value.isdigit() else 0)
  rating = inter.numbers("rating", float)
  return {
      "version": np.int64(CACHE_VERSION),
      "inter_user": inter.lookup("user_id", user_index, "user"),
      "inter_item": inter.lookup("item_id", item_index, "item"),
      "inter_rating": rating.astype(np.float32),
      "inter_time": inter.numbers("timestamp", float),
      "user_age": by_index(user, user_index, "user_id", user_cols["age"]),
      "user_gender": by_index(user, user_index, "user_id", user_cols["gender"].astype(np.int32)),
      "user_occupation": by_index(user, user_index, "user_id",
                                  user_cols["occupation"].astype(np.int32)),
      "user_zip": by_index(user, user_index, "user_id", user_cols["zip"]),
      "item_year": by_index(item, item_index, "item_id", np.asarray(years, np.int64)),
      "item_genres": by_index(item, item_index, "item_id", item_genres),
      "occupations": np.asarray(occupations, dtype=str),
      "genres": np.asarray(genres, dtype=str),
      "num_users": np.int64(num_users),
      "num_items": np.int64(num_items),
  }


_PARSED_KEYS = ("version", "inter_user", "inter_item", "inter_rating", "inter_time", "user_age",
                "user_gender", "user_occupation", "user_zip", "item_year", "item_genres",
                "occupations", "genres", "num_users", "num_items")


DIGEST_KEY = "digest"   # the cache's own entry: JSON {array: {dtype, shape, crc32}}


def array_record(value: np.ndarray) -> Dict[str, object]:
  """dtype, shape and CRC-32 of the bytes (C order) of one array of the parsed cache."""
  value = np.ascontiguousarray(value)
  return {"dtype": value.dtype.str, "shape": list(value.shape),
          "crc32": f"{zlib.crc32(value.reshape(-1).view(np.uint8)):08x}"}


def cache_digest(parsed: Dict[str, np.ndarray]) -> str:
  """The digest entry of a parsed cache: every array's `array_record`, as JSON."""
  return json.dumps({k: array_record(parsed[k]) for k in _PARSED_KEYS}, sort_keys=True)


def _read_cache(cache: str, source: str) -> Dict[str, np.ndarray]:
  """The parsed arrays of the cache file `cache`, each checked against the digest written
  with them; any unreadable, missing or changed part is a one-line DataFileError naming the
  file and the remedy (the cache is rebuilt from `source`)."""
  remedy = f"delete it: it is rebuilt from {source}"
  try:
    with np.load(cache, allow_pickle=False) as z:
      parsed = {k: z[k] for k in _PARSED_KEYS}
      written = json.loads(str(z[DIGEST_KEY][()]))
  except Exception as e:  # any unreadable cache means the same thing to the user
    reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    raise DataFileError(f"MovieLens cache {cache} is corrupt or truncated ({reason}); "
                        f"{remedy}") from e
  for key in _PARSED_KEYS:
    found = array_record(parsed[key])
    expected = written.get(key) if isinstance(written, dict) else None
    if found != expected:
      raise DataFileError(f"MovieLens cache {cache}: array {key!r} does not match its digest "
                          f"(it holds {found}, written as {expected}): changed or damaged "
                          f"after it was written; {remedy}")
  return parsed


def _content_hash(raw: Dict[str, Tuple[str, bytes]]) -> str:
  digest = hashlib.sha256()
  for part in PARTS:
    digest.update(raw[part][1])
  return digest.hexdigest()


def load_parsed(source: str, cache_dir: Optional[str]) -> Dict[str, np.ndarray]:
  """Parsed arrays of `source`, through an npz cache in `cache_dir` keyed by the files' hash.
  The cache carries the dtype, shape and CRC-32 of every array (`DIGEST_KEY`), checked when
  it is read: a changed or damaged cache is an error naming it, never other data."""
  raw = read_raw_files(source)
  if cache_dir is None:
    return parse_files(raw)
  cache_dir = os.path.expanduser(cache_dir)
  cache = os.path.join(cache_dir, f"ml-100k.parsed.{_content_hash(raw)[:16]}.v{CACHE_VERSION}.npz")
  if os.path.exists(cache):
    parsed = _read_cache(cache, source)
    if int(parsed["version"]) != CACHE_VERSION:
      raise DataFileError(f"MovieLens cache {cache} has version {int(parsed['version'])}, "
                          f"expected {CACHE_VERSION}; delete it: it is rebuilt from {source}")
    return parsed
  parsed = parse_files(raw)
  os.makedirs(cache_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".ml-100k.", suffix=".npz")
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **parsed, **{DIGEST_KEY: np.asarray(cache_digest(parsed))})
    os.replace(tmp, cache)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return parsed


# ---- examples --------------------------------------------------------------------------------
def _standardize(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
  std = float(reference.std())
  return ((values - reference.mean()) / (std if std > 0 else 1.0)).astype(np.float32)


def build_examples(parsed: Dict[str, np.ndarray], config: MovieLensConfig):
  """(train, test, FeatureSpec): batch-contract arrays of every rating, split by time."""
  user, item = parsed["inter_user"].astype(np.int64), parsed["inter_item"].astype(np.int64)
  rating, time = parsed["inter_rating"], parsed["inter_time"]
  n = user.size
  order = np.lexsort((np.arange(n), time))            # global time order, ties by file order
  n_test = max(1, int(round(config.test_fraction * n)))
  if n_test >= n:
    raise ValueError(f"MovieLens: {n} ratings leave no training examples at "
                     f"test_fraction={config.test_fraction}")
  user, item, rating, time = user[order], item[order], rating[order], time[order]
  train = np.arange(n) < n - n_test

  # Per-user chronological position: sort by user, keeping time order within a user.
  by_user = np.argsort(user, kind="stable")
  sorted_user = user[by_user]
  first = np.r_[True, sorted_user[1:] != sorted_user[:-1]]
  group_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
  prior = np.empty(n, np.int64)
  prior[by_user] = np.arange(n) - group_start          # the user's earlier ratings
  L = config.seq_len
  rating_id = np.clip(np.rint(rating), 0, 5).astype(np.int32)
  # Position L - k holds the k-th most recent earlier event: sorted position j - k of the user.
  back = np.arange(L, 0, -1)[None, :]
  seq_mask = np.empty((n, L), bool)
  seq_mask[by_user] = prior[by_user][:, None] >= back
  src = by_user[np.maximum(np.arange(n)[:, None] - back, 0)]
  src_of = np.empty((n, L), np.int64)
  src_of[by_user] = src
  seq_ids = np.empty((n, 2, L), np.int32)
  seq_ids[:, 0] = np.where(seq_mask, item.astype(np.int32)[src_of], 0)
  seq_ids[:, 1] = np.where(seq_mask, rating_id[src_of], 0)

  bag = config.genre_bag
  genres = parsed["item_genres"][:, :bag]
  genre_ids = np.zeros((n, bag), np.int32)
  genre_ids[:, :genres.shape[1]] = genres[item]
  genre_mask = genre_ids > 0
  genre_mask[:, 0] = True                              # no genre: the reserved id 0, kept real

  age = parsed["user_age"][user]
  age_bucket = np.where(age < 0, 0, 1 + np.searchsorted(AGE_EDGES, age, side="right"))
  year = parsed["item_year"][item]
  year_id = np.where(year > 0, 1 + np.clip(year - YEAR_BASE, 0, YEAR_SPAN), 0)
  singles = [user, item, age_bucket, parsed["user_gender"][user],
             parsed["user_occupation"][user], parsed["user_zip"][user], year_id]
  sparse_ids = np.zeros((n, len(SPARSE_NAMES), bag), np.int32)
  sparse_mask = np.zeros((n, len(SPARSE_NAMES), bag), bool)
  for f, values in enumerate(singles):
    sparse_ids[:, f, 0] = values
    sparse_mask[:, f, 0] = True
  sparse_ids[:, -1], sparse_mask[:, -1] = genre_ids, genre_mask

  known_age = np.where(age < 0, np.nan, age).astype(np.float64)
  age_ref = known_age[train & ~np.isnan(known_age)]
  age_feature = _standardize(np.nan_to_num(known_age, nan=age_ref.mean()), age_ref)
  popularity = np.log1p(np.bincount(item[train], minlength=int(parsed["num_items"]) + 1)[item])
  history = np.log1p(prior.astype(np.float64))
  span = max(float(time.max() - time.min()), 1.0)
  dense = np.stack([age_feature, _standardize(popularity, popularity[train]),
                    _standardize(history, history[train]),
                    ((time - time.min()) / span).astype(np.float32)], axis=1)

  features = FeatureSpec(
      num_dense=len(DENSE_NAMES),
      vocab_sizes=(int(parsed["num_users"]) + 1, int(parsed["num_items"]) + 1,
                   len(AGE_EDGES) + 2, 3, len(parsed["occupations"]) + 1, 12, YEAR_SPAN + 2,
                   len(parsed["genres"]) + 1),
      bag_size=bag, num_seq=2, seq_len=L, seq_vocab=max(int(parsed["num_items"]) + 1, 6))
  examples = {"dense": dense.astype(np.float32), "sparse_ids": sparse_ids,
              "sparse_mask": sparse_mask, "seq_ids": seq_ids, "seq_mask": seq_mask,
              "label": (rating >= config.label_threshold).astype(np.float32)}
  split = lambda rows: {k: np.ascontiguousarray(v[rows]) for k, v in examples.items()}
  return split(train), split(~train), features


class MovieLensSource:
  """MovieLens-100K CTR examples: shuffled epochs for training, the latest ratings for eval."""

  name = "movielens"
  oracle_ne = None

  def __init__(self, config=None, data_path: Optional[str] = None,
               data_cache: Optional[str] = None, seed: int = 0, num_eval: Optional[int] = None,
               id_policy: str = "error"):
    self.config = sources.load_config(MovieLensConfig, config, "movielens config")
    cache_dir = os.path.expanduser(data_cache or DEFAULT_CACHE)
    source = data_path if data_path is not None else fetch_recbole_wheel(cache_dir)
    parsed = load_parsed(source, cache_dir)
    train, test, self.features = build_examples(parsed, self.config)
    self.seed, self.id_policy = int(seed), id_policy
    self.sparse_names, self.dense_names, self.seq_names = SPARSE_NAMES, DENSE_NAMES, SEQ_NAMES
    if num_eval is not None:
      if num_eval < 1:
        raise ValueError(f"num_eval must be >= 1, got {num_eval}")
      test = {k: v[:num_eval] for k, v in test.items()}
    self._train = validate_batch(train, self.features, id_policy)
    self._test = validate_batch(test, self.features, id_policy)
    for data in (self._train, self._test):
      for value in data.values():
        value.setflags(write=False)
    self._orders: Dict[int, np.ndarray] = {}

  def num_train_examples(self) -> int:
    return int(self._train["label"].shape[0])

  def num_eval_examples(self) -> int:
    return int(self._test["label"].shape[0])

  def _epoch(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      if len(self._orders) >= 2:
        self._orders.pop(min(self._orders))
      self._orders[epoch] = sources.epoch_order(self.seed, _TRAIN_STREAM, epoch,
                                                self.num_train_examples())
    return self._orders[epoch]

  def train_batch(self, step: int, batch_size: int) -> Dict[str, np.ndarray]:
    """Examples step*B .. step*B+B-1 of the endless stream of shuffled epochs."""
    if step < 0 or batch_size < 1:
      raise ValueError(f"train_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
    size = self.num_train_examples()
    position = int(step) * int(batch_size) + np.arange(batch_size, dtype=np.int64)
    epochs, offsets = np.divmod(position, size)
    rows = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
      sel = epochs == epoch
      rows[sel] = self._epoch(int(epoch))[offsets[sel]]
    return {k: v[rows] for k, v in self._train.items()}

  def eval_batches(self, batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
    """The held-out ratings in time order, full batches only (the last partial one dropped)."""
    if batch_size < 1:
      raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
    total = self.num_eval_examples()
    for start in range(0, total - batch_size + 1, batch_size):
      yield {k: v[start:start + batch_size] for k, v in self._test.items()}
