"""train/verdict.py: paired non-inferiority, on changes whose interval is computed by hand.

For two changes a, b: mean (a + b) / 2, sd |a - b| / sqrt(2), half-width t(1) |a - b| / 2.
For three equally spaced changes m - d, m, m + d: sd d, half-width t(2) d / sqrt(3).
"""
import math

import chex
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from loka_jax.train import verdict

T1, T2 = 12.706, 4.303    # Student's t, 97.5% quantile, df = 1 and 2


class T975Test(parameterized.TestCase):

  @parameterized.parameters((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571),
                            (9, 2.262), (10, 2.228), (19, 2.093), (20, 2.086), (29, 2.045),
                            (30, 2.042))
  def test_known_quantiles(self, df, quantile):
    self.assertAlmostEqual(verdict.t975(df), quantile, places=3)

  def test_scipy_agrees_to_three_decimals(self):
    try:
      from scipy import stats
    except ImportError:
      self.skipTest("scipy is not installed")
    for df in range(1, 31):
      self.assertAlmostEqual(verdict.t975(df), stats.t.ppf(0.975, df), delta=6e-4, msg=df)

  def test_above_30_the_normal_quantile(self):
    for df in (31, 100, 10 ** 6):
      self.assertEqual(verdict.t975(df), 1.960)

  def test_no_degrees_of_freedom(self):
    with self.assertRaisesRegex(ValueError, "at least 2 pairs"):
      verdict.t975(0)


class NoninferiorityTest(chex.TestCase):

  def test_met(self):
    # -0.03, -0.02, -0.01: mean -0.02, half-width 4.303 * 0.01 / sqrt(3) = 0.024843
    out = verdict.noninferiority([-0.03, -0.02, -0.01], 0.01)
    self.assertEqual(out["verdict"], verdict.MET)
    self.assertEqual(out["n"], 3)
    self.assertAlmostEqual(out["mean"], -0.02, places=12)
    half = T2 * 0.01 / math.sqrt(3)
    np.testing.assert_allclose(out["ci"], [-0.02 - half, -0.02 + half], rtol=1e-9)
    self.assertAlmostEqual(out["ci"][1], 0.0048432, places=6)
    self.assertEqual(out["bound"], 0.01)
    self.assertNotIn("pairs_to_resolve", out)
    self.assertNotIn("error", out)

  def test_missed(self):
    # 0.03, 0.04, 0.05: lower end 0.04 - 0.024843 = 0.015157 > 0.01
    out = verdict.noninferiority([0.03, 0.04, 0.05], 0.01)
    self.assertEqual(out["verdict"], verdict.MISSED)
    self.assertAlmostEqual(out["ci"][0], 0.0151568, places=6)
    self.assertNotIn("pairs_to_resolve", out)

  def test_unresolved_says_how_many_pairs_would_resolve_it(self):
    # 0, 0.002: mean 0.001, sd 0.002 / sqrt(2), half-width 12.706 * 0.001
    out = verdict.noninferiority([0.0, 0.002], 2e-4)
    self.assertEqual(out["verdict"], verdict.UNRESOLVED)
    np.testing.assert_allclose(out["ci"], [0.001 - T1 * 0.001, 0.001 + T1 * 0.001], rtol=1e-9)
    # resolved once t(n-1) * sd / sqrt(n) < |bound - mean| = 8e-4, i.e. t(n-1)/sqrt(n) < 0.5657:
    # n = 14: 2.160 / 3.742 = 0.577 (not yet); n = 15: 2.145 / 3.873 = 0.554
    self.assertEqual(out["pairs_to_resolve"], 15)

  def test_a_mean_on_the_bound_never_resolves(self):
    out = verdict.noninferiority([0.0, 4e-4], 2e-4)
    self.assertEqual(out["verdict"], verdict.UNRESOLVED)
    self.assertIsNone(out["pairs_to_resolve"])

  def test_equal_changes_have_a_zero_width_interval(self):
    self.assertEqual(verdict.noninferiority([0.0, 0.0], 2e-4)["verdict"], verdict.MET)
    self.assertEqual(verdict.noninferiority([2e-4, 2e-4], 2e-4)["verdict"], verdict.MET)
    self.assertEqual(verdict.noninferiority([1e-3, 1e-3], 2e-4)["verdict"], verdict.MISSED)

  def test_better_than_the_reference_is_never_a_miss(self):
    # far better on average but noisy: unresolved, not missed
    out = verdict.noninferiority([-0.5, -0.4], 2e-4)
    self.assertEqual(out["verdict"], verdict.UNRESOLVED)
    self.assertEqual(verdict.noninferiority([-0.5, -0.49, -0.51], 2e-4)["verdict"], verdict.MET)
    rng = np.random.default_rng(0)
    for _ in range(200):
      n = int(rng.integers(2, 40))
      changes = rng.normal(-abs(rng.normal()), abs(rng.normal()) + 1e-3, n)
      bound = float(abs(rng.normal()) * 1e-3)
      if np.mean(changes) <= bound:
        self.assertNotEqual(verdict.noninferiority(changes, bound)["verdict"], verdict.MISSED)

  def test_a_change_that_is_not_finite_is_a_miss_with_an_error(self):
    for bad in (float("nan"), float("inf"), float("-inf")):
      out = verdict.noninferiority([0.0, bad, 0.0], 2e-4)
      self.assertEqual(out["verdict"], verdict.MISSED, bad)
      self.assertEqual(out["error"], "a paired change is not finite")
      self.assertIsNone(out["mean"])
      self.assertIsNone(out["ci"])
      self.assertEqual(out["n"], 3)

  def test_fewer_than_two_pairs(self):
    for changes in ([], [0.0], [[0.0, 1.0]]):
      with self.assertRaisesRegex(ValueError, "at least 2 paired changes"):
        verdict.noninferiority(changes, 2e-4)

  def test_relative_changes(self):
    np.testing.assert_allclose(verdict.relative_changes([1.1, 2.0, 2.5], [1.0, 2.0, 5.0]),
                               [0.1, 0.0, -0.5], rtol=1e-12)
    with self.assertRaisesRegex(ValueError, "equal 1-D shapes"):
      verdict.relative_changes([1.0, 2.0], [1.0])


if __name__ == "__main__":
  absltest.main()
