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


class PairedQualityTest(chex.TestCase):
  """The quality rule: seeds pair, d_s = (arm - reference) / reference, bound +0.02%."""

  def test_only_seeds_both_arms_hold_pair(self):
    # Seeds 0, 1, 2 pair; 3 (arm only) and 9 (reference only) do not. Changes -0.01%, 0,
    # +0.01%: mean 0, sd 1e-4, half-width 4.303e-4 / sqrt(3) = 2.484338e-4: unresolved.
    arm = {0: 0.49995, 1: 0.5, 2: 0.50005, 3: 0.7}
    ref = {0: 0.5, 1: 0.5, 2: 0.5, 9: 0.1}
    out = verdict.paired_quality(arm, ref)
    self.assertEqual(out["seeds"], [0, 1, 2])
    np.testing.assert_allclose(out["changes"], [-1e-4, 0.0, 1e-4], atol=1e-15)
    self.assertEqual((out["verdict"], out["n"], out["bound"]), (verdict.UNRESOLVED, 3, 2e-4))
    np.testing.assert_allclose(out["ci"], [-2.484338e-4, 2.484338e-4], rtol=1e-6)
    # gap 2e-4, sd 1e-4: n = 4 gives 3.182 / 2 = 1.591 < 2 (n = 3: 4.303 / 1.732 = 2.484)
    self.assertEqual(out["pairs_to_resolve"], 4)

  def test_met_missed_and_better(self):
    ref = {0: 0.4, 1: 0.4, 2: 0.4}
    arm = lambda changes: {s: 0.4 * (1 + d) for s, d in enumerate(changes)}  # noqa: E731
    # 0, 1e-4, 2e-4: mean 1e-4, upper end 1e-4 + 2.484338e-4 = 3.484e-4 > 2e-4: unresolved
    self.assertEqual(verdict.paired_quality(arm((0, 1e-4, 2e-4)), ref)["verdict"],
                     verdict.UNRESOLVED)
    # 0, 2e-5, 4e-5: upper end 2e-5 + 4.303 * 2e-5 / sqrt(3) = 6.969e-5 <= 2e-4: met
    met = verdict.paired_quality(arm((0, 2e-5, 4e-5)), ref)
    self.assertEqual(met["verdict"], verdict.MET)
    self.assertAlmostEqual(met["ci"][1], 6.968675e-5, places=10)
    # 1e-3, 2e-3, 3e-3: lower end 2e-3 - 4.303e-3 / sqrt(3) = -4.843e-4: unresolved;
    # 5e-3, 5.1e-3, 5.2e-3: lower end 5.1e-3 - 2.484338e-4 = 4.8516e-3 > 2e-4: missed
    self.assertEqual(verdict.paired_quality(arm((1e-3, 2e-3, 3e-3)), ref)["verdict"],
                     verdict.UNRESOLVED)
    self.assertEqual(verdict.paired_quality(arm((5e-3, 5.1e-3, 5.2e-3)), ref)["verdict"],
                     verdict.MISSED)
    # 1% better at every seed: met, never missed
    self.assertEqual(verdict.paired_quality(arm((-0.01, -0.011, -0.009)), ref)["verdict"],
                     verdict.MET)

  def test_one_or_no_pair_is_unresolved_with_no_seed_count(self):
    one = verdict.paired_quality({0: 0.402}, {0: 0.4, 1: 0.4})
    self.assertEqual((one["verdict"], one["n"], one["ci"], one["pairs_to_resolve"]),
                     (verdict.UNRESOLVED, 1, None, None))
    self.assertAlmostEqual(one["mean"], 0.005, places=12)
    self.assertIn("one paired seed", one["why"])
    none = verdict.paired_quality({0: 0.4}, {1: 0.4})
    self.assertEqual((none["verdict"], none["n"], none["mean"]), (verdict.UNRESOLVED, 0, None))
    self.assertIn("no seed holds both arms", none["why"])

  def test_a_plan_without_fp8_is_not_applicable(self):
    out = verdict.paired_quality({0: 0.5, 1: 0.6}, {0: 0.4, 1: 0.4}, applicable=False)
    self.assertEqual((out["verdict"], out["ci"]), (verdict.NOT_APPLICABLE, None))
    self.assertAlmostEqual(out["mean"], 0.375, places=12)  # (0.25 + 0.5) / 2, still listed
    self.assertNotIn("pairs_to_resolve", out)

  def test_the_default_bound_is_two_hundredths_of_a_percent(self):
    self.assertEqual(verdict.paired_quality({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0})["bound"], 2e-4)


class PairsToResolveTest(absltest.TestCase):

  def test_the_least_number_of_pairs_that_resolves(self):
    # Changes -1 and +1: mean 0, sd sqrt(2); against a bound of 1 the half-width
    # t(n-1) sqrt(2) / sqrt(n) first drops below 1 at n = 11 (t(10) = 2.228: 0.950), not at
    # n = 10 (t(9) = 2.262: 1.012); t from a printed table.
    out = verdict.noninferiority([-1.0, 1.0], 1.0)
    self.assertEqual((out["verdict"], out["pairs_to_resolve"]), ("unresolved", 11))

  def test_a_mean_on_the_bound_is_not_resolvable(self):
    self.assertIsNone(verdict.noninferiority([0.0, 2.0], 1.0)["pairs_to_resolve"])


if __name__ == "__main__":
  absltest.main()
