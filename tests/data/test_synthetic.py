"""Synthetic data source: purity, the batch contract, the distributions the spec asks for."""
import json
import math
import os
import tempfile
import time

import chex
import numpy as np
from absl.testing import parameterized

from loka_jax.data import make, sources, synthetic
from loka_jax.data.spec import FeatureSpec, validate_batch

TINY = FeatureSpec(num_dense=8, vocab_sizes=(500, 300, 2000), bag_size=4, num_seq=2, seq_len=12,
                   seq_vocab=700)
SMALL = FeatureSpec(num_dense=13, vocab_sizes=(100000,) * 26, bag_size=4, num_seq=2,
                    seq_len=128, seq_vocab=100000)


def _auc(labels, scores):
  """Rank-sum AUC (scores are continuous: no ties to average)."""
  ranks = np.empty(len(scores))
  ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
  pos = labels == 1
  n_pos, n_neg = pos.sum(), (~pos).sum()
  return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def _logloss_ne(labels, probs):
  ctr = labels.mean()
  base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
  ll = -np.mean(labels * np.log(probs) + (1 - labels) * np.log(1 - probs))
  return ll / base


class PurityTest(chex.TestCase):

  def test_same_step_same_batch_across_instances(self):
    a = synthetic.SyntheticSource(TINY, seed=3).train_batch(17, 64)
    b = synthetic.SyntheticSource(TINY, seed=3).train_batch(17, 64)
    chex.assert_trees_all_equal(a, b)

  def test_other_step_or_seed_changes_the_batch(self):
    src = synthetic.SyntheticSource(TINY, seed=3)
    base = src.train_batch(17, 64)
    for other in (src.train_batch(18, 64),
                  synthetic.SyntheticSource(TINY, seed=4).train_batch(17, 64)):
      self.assertFalse(np.array_equal(base["dense"], other["dense"]))
      self.assertFalse(np.array_equal(base["sparse_ids"], other["sparse_ids"]))

  def test_call_order_does_not_matter(self):
    src = synthetic.SyntheticSource(TINY)
    late = src.train_batch(5, 32)
    for step in range(5):
      src.train_batch(step, 32)
    chex.assert_trees_all_equal(late, src.train_batch(5, 32))

  def test_eval_set_fixed_and_independent_of_batch_size(self):
    src = synthetic.SyntheticSource(TINY, num_eval=1000)
    small = list(src.eval_batches(250))
    large = list(src.eval_batches(500))
    self.assertLen(small, 4)
    self.assertLen(large, 2)
    for key in small[0]:
      np.testing.assert_array_equal(np.concatenate([small[0][key], small[1][key]]), large[0][key])
    again = list(src.eval_batches(250))
    chex.assert_trees_all_equal(small, again)

  def test_eval_drops_the_partial_batch(self):
    src = synthetic.SyntheticSource(TINY, num_eval=1000)
    self.assertEqual(src.num_eval_examples(), 1000)
    self.assertLen(list(src.eval_batches(300)), 3)

  def test_eval_stream_differs_from_training(self):
    src = synthetic.SyntheticSource(TINY, num_eval=256)
    ev = next(src.eval_batches(256))
    for step in range(4):
      self.assertFalse(np.array_equal(ev["dense"], src.train_batch(step, 256)["dense"]))

  def test_task_is_shared_across_seeds(self):
    a = synthetic.SyntheticSource(TINY, seed=0, num_eval=512)
    b = synthetic.SyntheticSource(TINY, seed=9, num_eval=512)
    chex.assert_trees_all_equal(next(a.eval_batches(512)), next(b.eval_batches(512)))
    self.assertEqual(a.oracle_ne, b.oracle_ne)


class ContractTest(chex.TestCase):

  @parameterized.named_parameters(
      ("with_sequences", TINY),
      ("no_sequences", FeatureSpec(num_dense=3, vocab_sizes=(50,) * 4, bag_size=2)),
      ("no_dense", FeatureSpec(num_dense=0, vocab_sizes=(40, 60), bag_size=1, num_seq=1,
                               seq_len=5, seq_vocab=30)),
  )
  def test_batches_follow_the_contract(self, features):
    src = make.make_source("synthetic", features=features, spec={"num_eval": 300})
    self.assertIsInstance(src, sources.DataSource)
    batch = src.train_batch(0, 37)
    validate_batch(batch, features)
    for field, (shape, dtype) in features.shapes(37).items():
      chex.assert_shape(batch[field], shape)
      self.assertEqual(batch[field].dtype, dtype, field)
    self.assertTrue(set(np.unique(batch["label"])) <= {0.0, 1.0})
    for ev in src.eval_batches(100):
      validate_batch(ev, features)

  def test_padded_slots_hold_zero_and_ids_in_range(self):
    batch = synthetic.SyntheticSource(TINY).train_batch(1, 2000)
    self.assertTrue((batch["sparse_ids"][~batch["sparse_mask"]] == 0).all())
    vocab = np.array(TINY.vocab_sizes)[None, :, None]
    self.assertTrue((batch["sparse_ids"] < vocab).all() and (batch["sparse_ids"] >= 0).all())
    self.assertTrue(batch["sparse_mask"][:, :, 0].all(), "every bag has a first id by default")

  def test_sequences_are_right_aligned_and_consistent(self):
    src = synthetic.SyntheticSource(TINY, spec={"seq_min_length": 3})
    batch = src.train_batch(2, 3000)
    mask, ids = batch["seq_mask"], batch["seq_ids"]
    lengths = mask.sum(1)
    self.assertGreaterEqual(lengths.min(), 3)
    self.assertEqual(lengths.max(), TINY.seq_len)
    expected = np.arange(TINY.seq_len)[None, :] >= (TINY.seq_len - lengths)[:, None]
    np.testing.assert_array_equal(mask, expected)  # padding first, latest event last
    self.assertTrue((ids[np.broadcast_to(~mask[:, None], ids.shape)] == 0).all())
    # The second attribute is a fixed function of the item (its category).
    items, cats = ids[:, 0][mask], ids[:, 1][mask]
    first_cat = {}
    for item, cat in zip(items.tolist(), cats.tolist()):
      self.assertEqual(first_cat.setdefault(item, cat), cat)

  def test_spec_features_override_the_preset(self):
    own = {"num_dense": 2, "vocab_sizes": [10, 20], "bag_size": 1}
    src = make.make_source("synthetic", features=TINY, spec={"features": own})
    self.assertEqual(src.features, FeatureSpec(2, (10, 20), 1))
    validate_batch(src.train_batch(0, 8), src.features)

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "unknown data source"):
      make.make_source("imagenet")
    with self.assertRaisesRegex(ValueError, "unknown id_policy 'drop'"):
      make.make_source("synthetic", features=TINY, id_policy="drop")
    with self.assertRaisesRegex(ValueError, "seed"):
      synthetic.SyntheticSource(TINY, seed=-1)
    with self.assertRaisesRegex(ValueError, "zipf_exponent lists 2 values"):
      synthetic.SyntheticSource(TINY, spec={"zipf_exponent": [1.0, 1.1]})
    with self.assertRaisesRegex(ValueError, "dense_families has 1 entries"):
      synthetic.SyntheticSource(TINY, spec={"dense_families": ["normal"]})


class DistributionTest(chex.TestCase):

  @parameterized.parameters(0.8, 1.2)
  def test_zipf_exponent_recovered(self, exponent):
    features = FeatureSpec(num_dense=1, vocab_sizes=(5000,), bag_size=1)
    src = synthetic.SyntheticSource(features, spec={"zipf_exponent": exponent})
    ids = np.concatenate([src.train_batch(s, 50000)["sparse_ids"].ravel() for s in range(4)])
    counts = np.sort(np.bincount(ids, minlength=5000))[::-1]
    ranks = np.arange(1, 201)
    slope = np.polyfit(np.log(ranks), np.log(counts[:200]), 1)[0]
    self.assertAlmostEqual(-slope, exponent, delta=0.08)

  def test_per_table_exponents(self):
    features = FeatureSpec(num_dense=1, vocab_sizes=(3000, 3000), bag_size=1)
    src = synthetic.SyntheticSource(features, spec={"zipf_exponent": [0.5, 1.5]})
    batch = src.train_batch(0, 100000)
    top_share = [np.sort(np.bincount(batch["sparse_ids"][:, t, 0]))[-1] / 100000 for t in range(2)]
    # Analytic head mass: 1 / H(3000, s).
    for share, s in zip(top_share, (0.5, 1.5)):
      head = 1.0 / np.sum(np.arange(1, 3001, dtype=np.float64) ** -s)
      self.assertAlmostEqual(share, head, delta=0.01 + 0.1 * head)

  def test_bag_lengths_follow_the_probabilities(self):
    probs = [0.1, 0.2, 0.3, 0.4]
    features = FeatureSpec(num_dense=1, vocab_sizes=(100,) * 4, bag_size=4)
    src = synthetic.SyntheticSource(
        features, spec={"bag_length_probs": probs, "multi_hot_fraction": 0.5})
    mask = src.train_batch(0, 40000)["sparse_mask"]
    lengths = mask.sum(-1)
    for table in (0, 1):  # multi-hot
      freq = np.bincount(lengths[:, table], minlength=5)[1:] / lengths.shape[0]
      np.testing.assert_allclose(freq, probs, atol=0.01)
    self.assertTrue((lengths[:, 2:] == 1).all())  # single-hot
    # Contiguous: real ids fill the leading slots.
    np.testing.assert_array_equal(mask, np.arange(4)[None, None, :] < lengths[..., None])

  def test_empty_bags(self):
    features = FeatureSpec(num_dense=1, vocab_sizes=(100,) * 3, bag_size=2)
    src = synthetic.SyntheticSource(features, spec={"empty_bag_prob": 0.3})
    lengths = src.train_batch(0, 20000)["sparse_mask"].sum(-1)
    self.assertAlmostEqual(float((lengths == 0).mean()), 0.3, delta=0.02)

  def test_outlier_channels_at_the_configured_rate(self):
    features = FeatureSpec(num_dense=10, vocab_sizes=(100,), bag_size=1)
    spec = {"num_outlier_features": 3, "outlier_prob": 0.01, "outlier_scale": 1e4}
    src = synthetic.SyntheticSource(features, spec=spec)
    self.assertLen(src.outlier_features, 3)
    n = 60000
    dense = np.concatenate([src.train_batch(s, n // 3)["dense"] for s in range(3)])
    huge = np.abs(dense) / src.dense_scale[None, :] >= 1e4
    rate = huge.mean(0)
    others = [i for i in range(10) if i not in src.outlier_features]
    sigma = math.sqrt(0.01 * 0.99 / n)
    for i in src.outlier_features:
      self.assertAlmostEqual(rate[i], 0.01, delta=5 * sigma)
    self.assertEqual(rate[others].sum(), 0.0)

  def test_dense_families(self):
    features = FeatureSpec(num_dense=3, vocab_sizes=(100,), bag_size=1)
    spec = {"dense_families": ["normal", "lognormal", "student_t"], "num_outlier_features": 0,
            "student_t_df": 3.0, "lognormal_sigma": 1.0}
    src = synthetic.SyntheticSource(features, spec=spec)
    x = src.train_batch(0, 200000)["dense"] / src.dense_scale[None, :]
    normal, lognormal, student = x[:, 0], x[:, 1], x[:, 2]
    self.assertAlmostEqual(float(normal.std()), 1.0, delta=0.02)
    self.assertGreater(lognormal.min(), 0.0)
    self.assertAlmostEqual(float(np.log(lognormal).std()), 1.0, delta=0.02)
    kurtosis = lambda v: np.mean((v - v.mean()) ** 4) / v.var() ** 2
    self.assertAlmostEqual(float(kurtosis(normal)), 3.0, delta=0.1)
    self.assertGreater(kurtosis(student), 6.0)  # t(3) has infinite kurtosis
    # Heavy tail: P(|t3| > 5) = 0.0154, far above the normal's 6e-7.
    self.assertAlmostEqual(float((np.abs(student) > 5).mean()), 0.0154, delta=0.002)

  @parameterized.parameters(0.1, 0.25, 0.5)
  def test_label_mean_near_base_ctr(self, ctr):
    src = synthetic.SyntheticSource(TINY, spec={"base_ctr": ctr})
    labels = np.concatenate([src.train_batch(s, 10000)["label"] for s in range(3)])
    self.assertAlmostEqual(float(labels.mean()), ctr, delta=0.012)


class TeacherTest(chex.TestCase):

  def test_default_oracle_ne_in_range(self):
    src = synthetic.SyntheticSource(TINY)
    self.assertGreater(src.oracle_ne, 0.5)
    self.assertLess(src.oracle_ne, 0.9)
    self.assertAlmostEqual(src.oracle_ne, 0.8, delta=0.03)

  def test_oracle_ne_matches_a_hand_computation(self):
    src = synthetic.SyntheticSource(TINY, num_eval=8192)
    batch = next(src.eval_batches(8192))
    probs = src.teacher_probs(batch)
    self.assertAlmostEqual(src.oracle_ne, _logloss_ne(batch["label"], probs), places=6)
    self.assertGreater(_auc(batch["label"], probs), 0.75)

  def test_target_ne_is_tunable(self):
    src = synthetic.SyntheticSource(TINY, spec={"target_oracle_ne": 0.6})
    self.assertAlmostEqual(src.oracle_ne, 0.6, delta=0.03)

  def test_fixed_logit_scale(self):
    weak = synthetic.SyntheticSource(TINY, spec={"teacher_logit_scale": 0.3})
    strong = synthetic.SyntheticSource(TINY, spec={"teacher_logit_scale": 3.0})
    self.assertGreater(weak.oracle_ne, 0.95)
    self.assertLess(strong.oracle_ne, 0.7)

  @parameterized.parameters("dense", "sparse", "seq")
  def test_each_input_group_alone_carries_signal(self, group):
    weights = {"dense": 0.0, "sparse": 0.0, "seq": 0.0, group: 1.0}
    src = synthetic.SyntheticSource(TINY, spec={"teacher_weights": weights}, num_eval=8192)
    self.assertLess(src.oracle_ne, 0.85)

  def test_labels_follow_teacher_probabilities(self):
    src = synthetic.SyntheticSource(TINY)
    batch = src.train_batch(0, 40000)
    probs = src.teacher_probs(batch)
    bins = np.digitize(probs, [0.1, 0.3, 0.6])
    for b in range(4):
      sel = bins == b
      if sel.sum() > 500:
        self.assertAlmostEqual(float(batch["label"][sel].mean()), float(probs[sel].mean()),
                               delta=4 * math.sqrt(0.25 / sel.sum()))

  def test_no_inputs_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "no signal"):
      synthetic.SyntheticSource(FeatureSpec(num_dense=0, vocab_sizes=(), bag_size=1))


class SpecTest(chex.TestCase):

  def test_json_round_trip(self):
    spec = synthetic.SyntheticSpec(zipf_exponent=(0.9, 1.3), bag_length_probs=(0.5, 0.5),
                                   dense_mix={"normal": 1.0, "student_t": 2.0},
                                   outlier_scale=1e5, base_ctr=0.1, teacher_logit_scale=2.0)
    text = spec.to_json()
    self.assertEqual(json.loads(text)["zipf_exponent"], [0.9, 1.3])
    self.assertEqual(synthetic.SyntheticSpec.from_json(text), spec)
    self.assertEqual(synthetic.SyntheticSpec.from_dict(spec.to_dict()), spec)

  def test_load_from_file(self):
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "spec.json")
      with open(path, "w") as f:
        json.dump({"base_ctr": 0.3, "zipf_exponent": 1.2}, f)
      spec = synthetic.SyntheticSpec.load(path)
      self.assertEqual((spec.base_ctr, spec.zipf_exponent), (0.3, 1.2))
      src = make.make_source("synthetic", features=TINY, spec=path)
      self.assertEqual(src.spec, spec)

  def test_unknown_keys_are_named(self):
    with self.assertRaisesRegex(ValueError, r"\['base_crt', 'zipf'\]"):
      synthetic.SyntheticSpec.from_dict({"base_crt": 0.3, "zipf": 1.0})

  @parameterized.parameters(
      ({"base_ctr": 1.5}, "base_ctr"),
      ({"dense_mix": {"cauchy": 1.0}}, "dense_mix"),
      ({"outlier_prob": -0.1}, "outlier_prob"),
      ({"target_oracle_ne": 1.2}, "target_oracle_ne"),
      ({"teacher_weights": {"dense": 1.0, "image": 1.0}}, "teacher_weights"),
      ({"features": {"num_dense": 1, "vocab_sizes": [0]}}, "FeatureSpec"),
  )
  def test_bad_values(self, values, name):
    with self.assertRaisesRegex(ValueError, name):
      synthetic.SyntheticSpec.from_dict(values)

  def test_bad_json(self):
    with self.assertRaisesRegex(ValueError, "not valid JSON"):
      synthetic.SyntheticSpec.from_json("{not json")


class SpecFileTest(chex.TestCase):

  def test_a_bad_spec_file_is_a_data_file_error_naming_the_file(self):
    folder = tempfile.mkdtemp(prefix="loka_spec_")
    for text, said in (('{"num_dense": 3}', r"unknown synthetic spec key\(s\) \['num_dense'\]"),
                       ('{"base_ctr": ', "is not valid JSON"),
                       ('[1, 2]', "must be a JSON object, got list")):
      path = os.path.join(folder, "spec.json")
      with open(path, "w") as f:
        f.write(text)
      with self.assertRaisesRegex(sources.DataFileError, f"{path}.*{said}|{said}.*{path}"):
        make.make_source("synthetic", features=TINY, spec=path)


class SpeedTest(chex.TestCase):

  def test_small_batch_is_fast(self):
    src = synthetic.SyntheticSource(SMALL)
    src.train_batch(0, 4096)  # warm caches
    times = []
    for step in range(1, 6):
      start = time.thread_time()  # CPU time of this thread: robust to a busy CI machine
      batch = src.train_batch(step, 4096)
      times.append(time.thread_time() - start)
    chex.assert_shape(batch["seq_ids"], (4096, 2, 128))
    # Target 50 ms; the bar leaves room for slow CI cores but catches per-example Python loops.
    self.assertLess(float(np.median(times)), 0.15)
