"""MovieLens-100K source: the parser on generated atomic files in a wheel-shaped zip, the
examples built from them, every error path, and one real download (marked `network`)."""
import os
import zipfile

import chex
import numpy as np
import pytest
from absl.testing import parameterized

from loka_jax.data import make, movielens, sources
from loka_jax.data.sources import DataFileError
from loka_jax.data.spec import validate_batch

USER = ("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        "1\t24\tM\ttechnician\t85711\n"
        "2\t53\tF\tother\t94043\n"
        "3\t17\tM\twriter\t32067\n"
        "4\t25\tF\tstudent\tE2A4Q\n"
        "5\t\tM\tnone\t15213\n"
        "6\t60\tX\tlawyer\t\n")
ITEM = ("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        "1\tToy Story\t1995\tAnimation Children's Comedy\n"
        "2\tGoldenEye\t1995\tAction Adventure Thriller\n"
        "3\tFour Rooms\tV\tThriller\n"
        "4\tGet Shorty\t1994\tAction Comedy Drama\n"
        "5\tCopycat\t1923\tCrime Drama Thriller\n"
        "6\tShanghai Triad\t1995\tDrama\n"
        "7\tTwelve Monkeys\tunkonwn\tDrama Sci-Fi\n"
        "8\tBabe\t1995\tChildren's Comedy Drama\n")
GENRES = sorted({"Animation", "Children's", "Comedy", "Action", "Adventure", "Thriller", "Drama",
                 "Crime", "Sci-Fi"})
OCCUPATIONS = sorted({"technician", "other", "writer", "student", "none", "lawyer"})
INTER_HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
N_INTER = 40


def _interactions(seed=0):
  """40 ratings with distinct timestamps, in shuffled file order."""
  rng = np.random.default_rng(seed)
  users = rng.integers(1, 7, N_INTER)
  items = rng.integers(1, 9, N_INTER)
  ratings = rng.integers(1, 6, N_INTER)
  times = 880000000 + rng.permutation(N_INTER) * 1000 + rng.integers(0, 999, N_INTER)
  return [(int(u), int(i), int(r), int(t)) for u, i, r, t in zip(users, items, ratings, times)]


def _inter_text(rows):
  return INTER_HEADER + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)


def _write_zip(path, inter=None, user=USER, item=ITEM, skip=()):
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("recbole/__init__.py", "")
    for part, text in (("inter", inter if inter is not None else _inter_text(_interactions())),
                       ("user", user), ("item", item)):
      if part not in skip:
        z.writestr(f"{movielens.MEMBER_DIR}/ml-100k.{part}", text)
  return str(path)


def _source(tmp_path, config=None, **zip_kwargs):
  path = _write_zip(tmp_path / "ml.zip", **zip_kwargs)
  return movielens.MovieLensSource(config=config, data_path=path,
                                   data_cache=str(tmp_path / "cache"))


def _history(rows, index, length):
  """The user's earlier (item, rating) pairs, oldest first, at most `length` of them."""
  user, _, _, time = rows[index]
  earlier = sorted((t, i, r) for (u, i, r, t) in rows if u == user and t < time)
  return [(i, r) for _, i, r in earlier][-length:]


class ExamplesTest(chex.TestCase):

  @pytest.fixture(autouse=True)
  def _tmp(self, tmp_path):
    self.tmp = tmp_path

  def test_features_and_split(self):
    src = _source(self.tmp, config={"seq_len": 5})
    self.assertEqual(src.features.vocab_sizes,
                     (7, 9, 8, 3, len(OCCUPATIONS) + 1, 12, 112, len(GENRES) + 1))
    self.assertEqual((src.features.num_dense, src.features.bag_size, src.features.num_seq,
                      src.features.seq_len, src.features.seq_vocab), (4, 6, 2, 5, 9))
    self.assertEqual(src.num_train_examples(), 32)
    self.assertEqual(src.num_eval_examples(), 8)
    self.assertIsNone(src.oracle_ne)
    self.assertIsInstance(src, sources.DataSource)

  def test_eval_rows_are_the_latest_ratings(self):
    rows = _interactions()
    src = _source(self.tmp, config={"seq_len": 5})
    (batch,) = list(src.eval_batches(8))
    validate_batch(batch, src.features)
    by_time = sorted(range(N_INTER), key=lambda k: rows[k][3])
    latest = by_time[-8:]
    np.testing.assert_array_equal(batch["sparse_ids"][:, 0, 0], [rows[k][0] for k in latest])
    np.testing.assert_array_equal(batch["sparse_ids"][:, 1, 0], [rows[k][1] for k in latest])
    np.testing.assert_array_equal(batch["label"], [float(rows[k][2] >= 4) for k in latest])
    for b, k in enumerate(latest):
      expected = _history(rows, k, 5)
      mask = batch["seq_mask"][b]
      self.assertEqual(int(mask.sum()), len(expected))
      self.assertTrue(mask[5 - len(expected):].all())  # right-aligned, most recent last
      got = list(zip(batch["seq_ids"][b, 0][mask].tolist(), batch["seq_ids"][b, 1][mask].tolist()))
      self.assertEqual(got, expected)
      self.assertTrue((batch["seq_ids"][b][:, ~mask] == 0).all())

  def test_user_and_item_attributes(self):
    src = _source(self.tmp)
    data = {k: np.concatenate([src._train[k], src._test[k]]) for k in src._train}
    sparse = data["sparse_ids"]
    by_user = {int(u): sparse[np.argmax(sparse[:, 0, 0] == u)] for u in np.unique(sparse[:, 0, 0])}
    # (age bucket, gender, occupation, zip prefix) by hand from USER.
    expected = {1: (2, 1, "technician", 9), 2: (6, 2, "other", 10), 3: (1, 1, "writer", 4),
                4: (3, 2, "student", 11), 5: (0, 1, "none", 2), 6: (7, 0, "lawyer", 0)}
    for user, row in by_user.items():
      age, gender, occupation, zip_id = expected[user]
      self.assertEqual(row[2:6, 0].tolist(),
                       [age, gender, OCCUPATIONS.index(occupation) + 1, zip_id], f"user {user}")
    genres_of = {1: ["Animation", "Children's", "Comedy"], 3: ["Thriller"],
                 5: ["Crime", "Drama", "Thriller"], 7: ["Drama", "Sci-Fi"]}
    years = {1: 96, 3: 0, 5: 24, 7: 0}
    for item, names in genres_of.items():
      rows = np.flatnonzero(sparse[:, 1, 0] == item)
      self.assertNotEmpty(rows, f"item {item} is rated in the generated data")
      row, mask = sparse[rows[0]], data["sparse_mask"][rows[0]]
      self.assertEqual(row[6, 0], years[item])
      self.assertEqual(row[7][mask[7]].tolist(), [GENRES.index(g) + 1 for g in names])
      self.assertTrue(mask[:7, 0].all() and not mask[:7, 1:].any())

  def test_dense_features(self):
    src = _source(self.tmp)
    data = {k: np.concatenate([src._train[k], src._test[k]]) for k in src._train}
    dense = data["dense"]
    self.assertTrue(np.isfinite(dense).all())
    time = dense[:, 3]
    self.assertEqual((float(time.min()), float(time.max())), (0.0, 1.0))
    self.assertTrue((np.diff(time) >= 0).all(), "examples are in time order")
    # The history-length feature grows with the number of earlier ratings (the sequence mask).
    history = data["seq_mask"].sum(1)
    order = np.argsort(history, kind="stable")
    self.assertTrue((np.diff(dense[order, 2]) >= -1e-6).all())

  def test_training_epochs_cover_the_training_set(self):
    src = _source(self.tmp)
    key = lambda b: sorted(zip(b["sparse_ids"][:, 0, 0].tolist(), b["sparse_ids"][:, 1, 0].tolist(),
                               b["dense"][:, 3].tolist()))
    train_rows = key(src._train)
    epoch0 = [src.train_batch(s, 8) for s in range(4)]
    epoch1 = [src.train_batch(s, 8) for s in range(4, 8)]
    for epoch in (epoch0, epoch1):
      merged = {k: np.concatenate([b[k] for b in epoch]) for k in epoch[0]}
      self.assertEqual(key(merged), train_rows)
    self.assertFalse(np.array_equal(epoch0[0]["label"], epoch1[0]["label"])
                     and np.array_equal(epoch0[0]["dense"], epoch1[0]["dense"]))
    chex.assert_trees_all_equal(src.train_batch(3, 8), epoch0[3])
    again = _source(self.tmp)
    chex.assert_trees_all_equal(again.train_batch(5, 7), src.train_batch(5, 7))

  def test_eval_drops_the_partial_batch(self):
    src = _source(self.tmp)
    self.assertLen(list(src.eval_batches(3)), 2)
    capped = movielens.MovieLensSource(data_path=str(self.tmp / "ml.zip"), num_eval=5,
                                       data_cache=str(self.tmp / "cache"))
    self.assertEqual(capped.num_eval_examples(), 5)

  def test_cache_round_trip_and_corruption(self):
    path = _write_zip(self.tmp / "ml.zip")
    cache = self.tmp / "cache"
    first = movielens.load_parsed(path, str(cache))
    (npz,) = [p for p in os.listdir(cache) if p.endswith(".npz")]
    second = movielens.load_parsed(path, str(cache))
    chex.assert_trees_all_equal(first, second)
    data = (cache / npz).read_bytes()
    (cache / npz).write_bytes(data[: len(data) // 2])
    with self.assertRaisesRegex(DataFileError, "corrupt or truncated.*delete it"):
      movielens.load_parsed(path, str(cache))

  def test_a_changed_array_that_still_loads_fails_the_cache_digest(self):
    # Rewritten as a valid npz (its zip CRCs and npy headers all fit) with one rating changed
    # and the written digest kept: only the digest can tell.
    path = _write_zip(self.tmp / "ml.zip")
    cache = self.tmp / "cache"
    movielens.load_parsed(path, str(cache))
    (npz,) = [p for p in os.listdir(cache) if p.endswith(".npz")]
    with np.load(cache / npz) as z:
      arrays = {k: z[k] for k in z.files}
    arrays["inter_rating"] = arrays["inter_rating"].copy()
    arrays["inter_rating"][3] += 1.0
    with open(cache / npz, "wb") as f:
      np.savez(f, **arrays)
    with self.assertRaisesRegex(DataFileError, rf"{npz}: array 'inter_rating' does not match "
                                               r"its digest .*; delete it: it is rebuilt from "
                                               rf".*ml\.zip$"):
      movielens.load_parsed(path, str(cache))
    os.remove(cache / npz)                                # as the message says: rebuilt
    self.assertEqual(movielens.load_parsed(path, str(cache))["inter_rating"].tolist(),
                     [float(r) for _, _, r, _ in _interactions()])

  def test_directory_source(self):
    folder = self.tmp / "files"
    folder.mkdir()
    (folder / "ml-100k.inter").write_text(_inter_text(_interactions()))
    (folder / "ml-100k.user").write_text(USER)
    (folder / "ml-100k.item").write_text(ITEM)
    src = movielens.MovieLensSource(data_path=str(folder), data_cache=str(self.tmp / "c"))
    self.assertEqual(src.num_train_examples() + src.num_eval_examples(), N_INTER)


class ErrorsTest(parameterized.TestCase):

  @pytest.fixture(autouse=True)
  def _tmp(self, tmp_path):
    self.tmp = tmp_path

  def _fails(self, pattern, **zip_kwargs):
    with self.assertRaisesRegex(DataFileError, pattern):
      _source(self.tmp, **zip_kwargs)

  def test_wrong_field_count_names_the_line(self):
    rows = _inter_text(_interactions()).splitlines()
    rows[4] = "1\t2\t3"
    self._fails(r"ml-100k\.inter, line 5: 3 tab-separated fields", inter="\n".join(rows) + "\n")

  @parameterized.parameters("abc", "nan", "inf", "")
  def test_bad_rating_names_line_and_column(self, token):
    rows = _inter_text(_interactions()).splitlines()
    rows[3] = f"1\t2\t{token}\t880000000"
    self._fails(r"line 4, column 'rating'", inter="\n".join(rows) + "\n")

  def test_unknown_item_is_out_of_vocabulary(self):
    rows = _inter_text(_interactions()).splitlines()
    rows[7] = "1\t99\t4\t880000000"
    self._fails(r"line 8, column 'item_id': id '99' has no row in the item file",
                inter="\n".join(rows) + "\n")

  def test_missing_header_column(self):
    self._fails(r"lacks column\(s\) \['timestamp'\]",
                inter="user_id:token\titem_id:token\trating:float\n1\t1\t4\n")

  def test_duplicate_user(self):
    self._fails(r"ml-100k\.user, line 8, column 'user_id': id '2' repeats line 3",
                user=USER + "2\t30\tM\tother\t11111\n")

  def test_bad_age(self):
    self._fails(r"ml-100k\.user, line 2, column 'age': 'old'",
                user=USER.replace("1\t24\tM", "1\told\tM"))

  def test_missing_member(self):
    self._fails(r"has no member .*ml-100k\.item", skip=("item",))

  def test_truncated_zip(self):
    path = _write_zip(self.tmp / "ml.zip")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
      f.write(data[: len(data) // 2])
    with self.assertRaisesRegex(DataFileError, "corrupt or truncated; delete it"):
      movielens.MovieLensSource(data_path=path, data_cache=str(self.tmp / "cache"))

  def test_corrupt_wheel_in_cache(self):
    cache = self.tmp / "cache"
    cache.mkdir()
    _write_zip(cache / movielens.RECBOLE_WHEEL)  # a zip, but not the published wheel
    with self.assertRaisesRegex(DataFileError, "corrupt or truncated.*delete it"):
      make.make_source("movielens", data_cache=str(cache))

  def test_unknown_config_key(self):
    with self.assertRaisesRegex(ValueError, r"unknown movielens config key\(s\) \['seqlen'\]"):
      _source(self.tmp, config={"seqlen": 3})

  def test_missing_source(self):
    with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
      movielens.MovieLensSource(data_path=str(self.tmp / "nope.whl"))


@pytest.mark.network
def test_real_download(tmp_path):
  """Fetches the real wheel with pip (about 2 MB) and checks facts of ML-100K."""
  src = make.make_source("movielens", data_cache=str(tmp_path), spec={"seq_len": 16})
  assert os.path.exists(tmp_path / movielens.RECBOLE_WHEEL)
  total = src.num_train_examples() + src.num_eval_examples()
  assert total == 100000
  assert src.num_eval_examples() == 20000
  vocab = src.features.vocab_sizes
  assert (vocab[0], vocab[1], vocab[4], vocab[7]) == (944, 1683, 22, 20)  # 943 users, 1682 items
  labels = np.concatenate([src._train["label"], src._test["label"]])
  assert int(labels.sum()) == 55375  # ratings of 4 or 5
  batch = src.train_batch(0, 256)
  validate_batch(batch, src.features)
  assert batch["seq_mask"].any()
