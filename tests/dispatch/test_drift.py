"""Drift valve: shift measures on statistics of real random data fire on a synthetic shift
(outlier channels) and not without one (a fresh sample, a pure rescale); re-selection
switches only the kernels that are no longer safe, and records it."""
import copy

import chex
import numpy as np
from absl.testing import absltest

import report_builders as hm
from loka_jax import dispatch
from loka_jax.dispatch import drift, selection
from loka_jax.probe.eligibility import Criteria

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9


def flushed(x):
  """Fraction of nonzero values that e4m3 tensorwise scaling (amax -> 448) rounds to zero."""
  x = np.abs(x[x != 0])
  scaled = x / (x.max() / E4M3_MAX)
  return float(np.mean(scaled < E4M3_MIN_SUBNORMAL / 2))


def activation_stats(x):
  """A report-style `stats` entry of an activation [rows, features]."""
  std = x.std(axis=0)
  med = float(np.median(std))
  frac = flushed(x)
  return {"std": {"min": float(std.min()), "median": med, "max": float(std.max())},
          "std_max_over_median": float(std.max() / med),
          "amax": {"last": float(np.abs(x).max()), "delayed_saturation_mean": 0.0},
          "flush": {"fwd": {"mean": {"e4m3": {"tensorwise": frac}},
                            "max": {"e4m3": {"tensorwise": frac}}}}}


def weight_stats(w):
  """A report-style `stats` entry of a weight [in, out] (contracting axis first)."""
  col = np.sqrt(np.mean(w ** 2, axis=1))
  return {"rms": float(np.sqrt(np.mean(w ** 2))), "abs_max": float(np.abs(w).max()),
          "col_rms_max_over_median": float(col.max() / np.median(col)),
          "amax": {"last": float(np.abs(w).max())},
          "flush": {"fwd": {"mean": {"e4m3": {"tensorwise": flushed(w)}},
                            "max": {"e4m3": {"tensorwise": flushed(w)}}}}}


def site_stats(x, w):
  return {"lhs": activation_stats(x), "rhs": weight_stats(w)}


class DriftMeasureTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(11)
    self.x = self.rng.standard_normal((4096, 64)).astype(np.float32)
    self.w = (self.rng.standard_normal((64, 32)) * 0.1).astype(np.float32)
    self.old = site_stats(self.x, self.w)

  def test_no_shift_without_one(self):
    fresh = self.rng.standard_normal((4096, 64)).astype(np.float32)
    for new in (site_stats(fresh, self.w),            # another sample of the same data
                site_stats(10.0 * fresh, 3.0 * self.w)):  # a pure rescale: scaling absorbs it
      d = drift.site_drift("s", self.old, new)
      self.assertFalse(d.shifted, d.reasons)
      self.assertLess(d.measures["lhs.crest_log2"], 0.5)
      self.assertLess(d.measures["lhs.spread_log2"], 0.5)
      self.assertIn("rhs.spread_log2", d.measures)

  def test_outlier_channels_fire_the_valve(self):
    shifted = self.rng.standard_normal((4096, 64)).astype(np.float32)
    shifted[:, [3, 40]] *= 1000.0  # 2 of 64 channels along the contraction blow up
    d = drift.site_drift("s", self.old, site_stats(shifted, self.w))
    self.assertTrue(d.shifted)
    for measure in ("lhs.crest_log2", "lhs.spread_log2", "lhs.underflow"):
      self.assertIn(measure, " ".join(d.reasons))
    self.assertGreater(d.measures["lhs.underflow"], 0.005)
    self.assertEqual(d.to_dict()["site"], "s")

  def test_weight_outliers_and_bounds(self):
    w = self.w.copy()
    w[5] *= 50.0  # one input row of the weight grows
    d = drift.site_drift("s", self.old, site_stats(self.x, w))
    self.assertTrue(d.shifted)
    self.assertTrue(any(r.startswith("rhs.spread_log2") for r in d.reasons), d.reasons)
    loose = drift.DriftBound(max_crest_log2=10, max_spread_log2=10, max_underflow_increase=1)
    self.assertFalse(drift.site_drift("s", self.old, site_stats(self.x, w), loose).shifted)

  def test_drifted_sites_compares_reports(self):
    shifted = self.x.copy()
    shifted[:, 0] *= 1e4
    old = {"a": self.old, "b": self.old}
    new = {"a": site_stats(shifted, self.w), "b": copy.deepcopy(self.old), "c": self.old}
    drifts = drift.drifted_sites({"sites": {n: {"stats": s} for n, s in old.items()}},
                                 {"sites": {n: {"stats": s} for n, s in new.items()}})
    self.assertEqual(sorted(drifts), ["a", "b"])  # c is new: nothing to compare
    self.assertEqual({n: d.shifted for n, d in drifts.items()}, {"a": True, "b": False})


class ReselectTest(chex.TestCase):

  def test_unsafe_kernels_are_switched_safe_ones_kept(self):
    good = {"xla_fp8_rowwise": hm.entry(sqnr=30.0, speedup=(1.3, 1.4, 1.5)),
            "xla_fp8_tensorwise": hm.entry(sqnr=29.0, speedup=(1.1, 1.2, 1.3))}
    before = hm.report({"a": hm.site(hm.same_passes(good)), "b": hm.site(hm.same_passes(good)),
                        "c": hm.site(hm.same_passes(good))})
    plan = selection.select(before, Criteria())
    self.assertEqual(plan["sites"]["a"]["fwd"]["kernel"], "xla_fp8_rowwise")
    after = copy.deepcopy(before)
    # a: an outlier channel now breaks rowwise forward; tensorwise still holds
    after["sites"]["a"]["passes"]["fwd"]["xla_fp8_rowwise"] = hm.entry(
        sqnr=14.0, underflow=0.3, speedup=(1.3, 1.4, 1.5))
    # b: drifted, but its kernels stay safe; c: broken, but the valve did not fire for it
    after["sites"]["c"]["passes"]["fwd"]["xla_fp8_rowwise"] = hm.entry(sqnr=10.0)
    drifts = {n: drift.SiteDrift(n, n != "c", {"lhs.spread_log2": 3.0 if n != "c" else 0.1},
                                 ("lhs.spread_log2 3 > 1",) if n != "c" else ())
              for n in ("a", "b", "c")}
    new_plan, steps = dispatch.reselect_drifted(plan, after, drifts, Criteria())
    kernels = lambda p, s: {q: p["sites"][s][q]["kernel"] for q in hm.PASSES}
    self.assertEqual(kernels(new_plan, "a"), {"fwd": "xla_fp8_tensorwise",
                                              "grad_lhs": "xla_fp8_rowwise",
                                              "grad_rhs": "xla_fp8_rowwise"})
    self.assertIn("drift: xla_fp8_rowwise: SQNR 14.0 dB < 25 dB",
                  new_plan["sites"]["a"]["fwd"]["reason"])
    self.assertEqual(kernels(new_plan, "b"), kernels(plan, "b"))
    self.assertEqual(kernels(new_plan, "c"), kernels(plan, "c"))
    self.assertEqual([(s["site"], s["action"]) for s in steps],
                     [("a", "switched"), ("b", "kernels still safe: kept")])
    self.assertEqual(steps[0]["switched"], {"fwd": ["xla_fp8_rowwise", "xla_fp8_tensorwise"]})
    self.assertEqual([v["step"] for v in new_plan["validation"]], ["drift", "drift"])
    self.assertEqual(plan["validation"], [])  # the input plan is unchanged


if __name__ == "__main__":
  absltest.main()
