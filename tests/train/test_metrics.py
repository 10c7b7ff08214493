"""Log loss, NE and AUC against hand computations and brute-force pair counting."""
import itertools
import math

import chex
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax.train import metrics


def pairwise_auc(scores, labels):
  """AUC by counting every (positive, negative) pair: 1 if ordered right, 1/2 if tied."""
  pos = [s for s, y in zip(scores, labels) if y == 1]
  neg = [s for s, y in zip(scores, labels) if y == 0]
  wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
  return wins / (len(pos) * len(neg))


class LogLossTest(chex.TestCase):

  def test_matches_the_textbook_formula(self):
    logits = np.array([2.0, -1.0, 0.0, 0.5], np.float32)
    labels = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    # -y log(sigmoid z) - (1 - y) log(1 - sigmoid z), written out per element.
    expected = [math.log(1 + math.exp(-2.0)), math.log(1 + math.exp(-1.0)), math.log(2.0),
                -math.log(1 - 1 / (1 + math.exp(-0.5)))]
    np.testing.assert_allclose(metrics.bce_with_logits(logits, labels), expected, rtol=1e-6)
    np.testing.assert_allclose(metrics.bce_with_logits_np(logits, labels), expected, rtol=1e-12)

  def test_huge_logits_stay_finite(self):
    logits = np.array([1000.0, -1000.0, 1000.0, -1000.0], np.float32)
    labels = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
    # A confident wrong answer costs |z|; a confident right one costs ~exp(-|z|) = 0.
    np.testing.assert_allclose(metrics.bce_with_logits(logits, labels), [1000, 1000, 0, 0],
                               atol=1e-6)
    self.assertTrue(np.isfinite(metrics.bce_with_logits_np(logits * 1e30, labels)).all())


class NormalizedEntropyTest(chex.TestCase):

  def test_entropy_by_hand(self):
    self.assertAlmostEqual(metrics.binary_entropy(0.25),
                           -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), places=12)
    self.assertEqual(metrics.binary_entropy(0.0), 0.0)
    self.assertEqual(metrics.binary_entropy(1.0), 0.0)

  def test_predicting_the_base_rate_gives_ne_one(self):
    labels = np.array([1, 0, 0, 0, 1, 0, 0, 0], np.float32)   # base CTR 0.25
    acc = metrics.EvalAccumulator()
    acc.add(np.full(8, math.log(0.25 / 0.75)), labels)
    result = acc.result()
    self.assertAlmostEqual(result["ne"], 1.0, places=12)
    self.assertAlmostEqual(result["base_ctr"], 0.25)
    self.assertAlmostEqual(result["logloss"],
                           -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), places=12)

  def test_ne_by_hand(self):
    logits = np.array([1.5, -0.5, -2.0, 0.3])
    labels = np.array([1.0, 0.0, 0.0, 1.0])
    p = 1 / (1 + np.exp(-logits))
    logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    acc = metrics.EvalAccumulator()
    acc.add(logits, labels)
    self.assertAlmostEqual(acc.result()["ne"], logloss / math.log(2.0), places=12)

  def test_one_class_has_no_ne(self):
    self.assertTrue(math.isnan(metrics.normalized_entropy(0.3, 0.0)))


class AucTest(chex.TestCase):

  def test_counted_by_hand(self):
    # positives 0.35, 0.8; negatives 0.1, 0.4: 3 of 4 pairs ordered right.
    self.assertEqual(metrics.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]), 0.75)

  def test_ties_count_half(self):
    # positives 0.5, 0.9; negatives 0.5, 0.2: (0.5, 0.5) is a tie -> 3.5 of 4.
    self.assertEqual(metrics.auc([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1]), 0.875)

  def test_perfect_and_reversed(self):
    self.assertEqual(metrics.auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]), 1.0)
    self.assertEqual(metrics.auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]), 0.0)

  def test_average_ranks_by_hand(self):
    np.testing.assert_array_equal(metrics.average_ranks([3, 1, 3, 2, 3]), [4, 1, 4, 2, 4])
    np.testing.assert_array_equal(metrics.average_ranks([2.0, 2.0]), [1.5, 1.5])

  @parameterized.parameters(0, 1, 2)
  def test_matches_pair_counting_with_many_ties(self, seed):
    rng = np.random.default_rng(seed)
    scores = np.round(rng.normal(size=300), 1)  # rounding makes many ties
    labels = (rng.random(300) < 0.3).astype(int)
    self.assertAlmostEqual(metrics.auc(scores, labels), pairwise_auc(scores, labels), places=12)

  def test_single_class_is_nan(self):
    self.assertTrue(math.isnan(metrics.auc([0.1, 0.2], [1, 1])))

  def test_length_mismatch_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "3 scores but 2 labels"):
      metrics.auc([0.1, 0.2, 0.3], [0, 1])


class AccumulatorTest(chex.TestCase):

  def test_streaming_equals_one_shot(self):
    rng = np.random.default_rng(7)
    logits = rng.normal(size=250) * 2
    labels = (rng.random(250) < 0.4).astype(np.float32)
    streamed = metrics.EvalAccumulator()
    for start in range(0, 250, 64):
      chunk = slice(start, start + 64)
      # A short last batch arrives padded with junk rows; `valid` drops them.
      pad = 64 - len(logits[chunk])
      streamed.add(np.r_[logits[chunk], np.full(pad, 99.0)], np.r_[labels[chunk], np.ones(pad)],
                   valid=64 - pad)
    p = 1 / (1 + np.exp(-logits))
    logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    result = streamed.result()
    self.assertEqual(result["num_examples"], 250)
    self.assertAlmostEqual(result["logloss"], logloss, places=10)
    self.assertAlmostEqual(result["auc"], pairwise_auc(logits, labels), places=12)
    base_ctr = labels.astype(np.float64).mean()
    self.assertAlmostEqual(result["ne"], logloss / metrics.binary_entropy(base_ctr), places=10)

  def test_empty_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "no eval examples"):
      metrics.EvalAccumulator().result()


class PairedLogLossTest(chex.TestCase):

  def test_change_and_error_by_hand(self):
    rng = np.random.default_rng(0)
    labels = (rng.random(400) < 0.3).astype(np.float64)
    base = rng.normal(size=400)
    moved = base + rng.normal(scale=0.05, size=400)
    loss = lambda z: np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0) - labels * z
    d = loss(moved) - loss(base)
    rel, se = metrics.paired_logloss_change(moved, base, labels)
    self.assertAlmostEqual(rel, d.mean() / loss(base).mean(), places=12)
    self.assertAlmostEqual(se, math.sqrt(np.var(d, ddof=1) / 400) / loss(base).mean(),
                           places=12)
    # The same logits: no change and no spread.
    self.assertEqual(metrics.paired_logloss_change(base, base, labels), (0.0, 0.0))

  def test_a_constant_shift_has_no_spread_but_noise_has(self):
    labels = np.array([0.0, 1.0] * 50)
    base = np.zeros(100)
    # Every example moves its loss by the same amount: the error is 0 to rounding.
    _, se = metrics.paired_logloss_change(base + 0.1, base, np.ones(100))
    self.assertLess(se, 1e-12)
    _, se = metrics.paired_logloss_change(base + np.linspace(-1, 1, 100), base, labels)
    self.assertGreater(se, 1e-3)

  def test_mismatched_or_too_few_examples_are_refused(self):
    with self.assertRaisesRegex(ValueError, "one per example"):
      metrics.paired_logloss_change(np.zeros(3), np.zeros(4), np.zeros(3))
    with self.assertRaisesRegex(ValueError, "two or more"):
      metrics.paired_logloss_change(np.zeros(1), np.zeros(1), np.zeros(1))

  def test_the_accumulator_keeps_every_score_in_order(self):
    acc = metrics.EvalAccumulator()
    acc.add(np.array([0.5, -1.0, 2.0]), np.array([1, 0, 1]), valid=2)
    acc.add(np.array([[3.0]]), np.array([0]))
    logits, labels = acc.scores()
    np.testing.assert_array_equal(logits, [0.5, -1.0, 3.0])
    np.testing.assert_array_equal(labels, [1, 0, 0])


class JsonSafeTest(chex.TestCase):

  def test_non_finite_becomes_null_with_error(self):
    out = metrics.json_safe({"ne": float("nan"), "auc": np.float32(0.7), "steps": np.int64(3),
                             "loss": float("inf")})
    self.assertIsNone(out["ne"])
    self.assertIsNone(out["loss"])
    self.assertAlmostEqual(out["auc"], 0.7, places=6)
    self.assertIsInstance(out["steps"], int)
    self.assertIn("ne=nan", out["error"])
    self.assertIn("loss=inf", out["error"])

  def test_finite_has_no_error(self):
    self.assertNotIn("error", metrics.json_safe({"ne": 0.8}))


if __name__ == "__main__":
  absltest.main()
