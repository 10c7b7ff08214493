"""Back-off targets and rankings from the probe report: the fastest more accurate kernel,
a fused op one gradient at a time, and the worst sites by the report's error or time."""
import dataclasses
import os
import tempfile
from unittest import mock

import chex
import numpy as np
from absl.testing import absltest, parameterized

import report_builders as hm
from loka_jax.dispatch import validate
from loka_jax.dispatch.validate import backoff
from loka_jax.plan.file import add_validation, read_plan, save_plan
from loka_jax.plan.file import FALLBACK
from loka_jax.kernels import registry
from validate_helpers import (BAD_SITE, GOOD_SITE, OTHER_SITE, context, kernels, plan_of,
                              ranking_report, register_test_kernels, unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class MorePreciseTest(chex.TestCase):
  """Back-off targets from a hand-made report: the fastest eligible more accurate kernel."""

  def _report(self):
    kernels = {"xla_fp8_tensorwise": hm.entry(sqnr=21.0, speedup=(1.6, 1.7, 1.8)),
               "xla_fp8_rowwise": hm.entry(sqnr=27.0, speedup=(1.2, 1.3, 1.4)),
               "xla_fp8_rowwise_precise": hm.entry(sqnr=29.0, speedup=(1.1, 1.15, 1.2)),
               "xla_fp8_tensorwise_precise": hm.entry(sqnr=26.0, speedup=(1.0, 1.02, 1.04))}
    return hm.report({"s": hm.site(hm.same_passes(kernels))})

  def test_picks_the_fastest_more_accurate_eligible(self):
    report = self._report()
    plan = plan_of({})
    got, _ = validate.more_precise_kernel(report, plan, "s", "grad_lhs", "xla_fp8_tensorwise")
    self.assertEqual(got, "xla_fp8_rowwise")        # 27 dB > 21 dB, fastest such
    got, _ = validate.more_precise_kernel(report, plan, "s", "fwd", "xla_fp8_rowwise")
    self.assertEqual(got, "xla_fp8_rowwise_precise")  # tensorwise_precise: not > 1.05x
    got, why = validate.more_precise_kernel(report, plan, "s", "fwd", "xla_fp8_rowwise_precise")
    self.assertEqual(got, FALLBACK)
    self.assertIn("no eligible candidate", why)
    got, why = validate.more_precise_kernel(report, plan, "s", "fwd", "test_two_bit")
    self.assertEqual(got, FALLBACK)
    self.assertIn("not evaluated", why)


class FusedBackOffTest(chex.TestCase):
  """A delayed-scaling site that validation finds too rough steps down one quantized gradient
  at a time when training is at fault, and straight to bf16 when its forward is."""

  def _report(self, sampled=False):
    """`sampled`: the probe's estimates of a pass two ops share differ by its samples (the
    forward: 40.8, 41.3 and 41.0 dB; the shared grad_lhs 25.6 and 25.4), as on the GPU."""
    scope = {"time_scope": "grad_lhs+grad_rhs", "base_us": 200.0}

    def fused(fwd_sqnr, grad_lhs, grad_rhs, bwd_speedup):
      return {"fwd": hm.entry(sqnr=fwd_sqnr if sampled else 41.0, speedup=(1.40, 1.42, 1.45)),
              "grad_lhs": hm.entry(sqnr=grad_lhs, speedup=bwd_speedup, **scope),
              "grad_rhs": hm.entry(sqnr=grad_rhs, speedup=bwd_speedup, **scope)}

    ops = {"flax_fp8_delayed": fused(40.8, 25.6, 21.0, (1.40, 1.45, 1.5)),
           "flax_fp8_delayed_grad_lhs": fused(41.3, 25.4 if sampled else 25.6, 55.6,
                                              (1.20, 1.25, 1.3)),
           "flax_fp8_delayed_fwd": fused(41.0, 51.5, 55.6, (0.99, 1.0, 1.01))}
    return hm.report({"s": hm.site({p: {k: v[p] for k, v in ops.items()}
                                    for p in hm.PASSES})})

  @parameterized.parameters(False, True)
  def test_training_steps_down_one_gradient_at_a_time(self, sampled):
    report = self._report(sampled)
    ctx = mock.Mock(report=report)
    plan = plan_of({"s": "flax_fp8_delayed"})
    steps = []
    for _ in range(3):
      plan = validate.back_off_site(plan, ctx, "s", "test", step="quality_shadow")
      steps.append(set(kernels(plan, "s").values()))
    self.assertEqual(steps, [{"flax_fp8_delayed_grad_lhs"}, {"flax_fp8_delayed_fwd"},
                             {FALLBACK}])
    self.assertIn("flax_fp8_delayed_grad_lhs: as accurate as flax_fp8_delayed in every pass, "
                  "more in grad_rhs", plan["validation"][0]["reason"])

  @parameterized.parameters(False, True)
  def test_a_rough_forward_goes_to_bf16(self, sampled):
    # Every delayed op shares the forward: none improves it, whatever the probe estimated.
    plan = validate.back_off_site(plan_of({"s": "flax_fp8_delayed"}),
                                  mock.Mock(report=self._report(sampled)), "s", "test",
                                  step="quality_held_out", must_improve=("fwd",))
    self.assertEqual(set(kernels(plan, "s").values()), {FALLBACK})
    self.assertIn("no eligible fused op", plan["validation"][0]["reason"])

  def test_the_delayed_ops_name_their_shared_passes_alike(self):
    numerics = {k: {p: registry.get(k).pass_numerics(p) for p in hm.PASSES}
                for k in ("flax_fp8_delayed", "flax_fp8_delayed_grad_lhs",
                          "flax_fp8_delayed_fwd", "xla_fp8_rowwise", "xla_bf16")}
    self.assertLen({n["fwd"] for k, n in numerics.items() if k.startswith("flax")}, 1)
    self.assertEqual(numerics["flax_fp8_delayed"]["grad_lhs"],
                     numerics["flax_fp8_delayed_grad_lhs"]["grad_lhs"])
    self.assertEqual(numerics["flax_fp8_delayed_grad_lhs"]["grad_rhs"],
                     numerics["flax_fp8_delayed_fwd"]["grad_rhs"])
    self.assertNotEqual(numerics["flax_fp8_delayed"]["grad_rhs"],
                        numerics["flax_fp8_delayed_grad_lhs"]["grad_rhs"])
    self.assertNotEqual(numerics["flax_fp8_delayed_fwd"]["grad_lhs"],
                        numerics["flax_fp8_delayed_grad_lhs"]["grad_lhs"])
    others = [n[p] for k, n in numerics.items() if not k.startswith("flax") for p in n]
    self.assertLen(set(others), len(others))   # every other pass its kernel's own

  def test_the_speed_step_goes_to_bf16(self):
    plan = validate.back_off_site(plan_of({"s": "flax_fp8_delayed"}),
                                  mock.Mock(report=self._report()), "s", "test",
                                  step="speed", to_fallback=True)
    self.assertEqual(set(kernels(plan, "s").values()), {FALLBACK})


class ReportRankingTest(chex.TestCase):
  """Past `max_measured_sites` FP8 sites, back-off candidates are ranked from the report."""

  def test_error_and_time_scores(self):
    report = hm.report({
        "fast": hm.site(hm.same_passes({"xla_fp8_rowwise": hm.entry(sqnr=35.0,
                                                                   speedup=(1.4, 1.5, 1.6))})),
        "slow": hm.site(hm.same_passes({"xla_fp8_rowwise": hm.entry(sqnr=20.0,
                                                                   speedup=(0.7, 0.8, 0.9))}))})
    plan = plan_of({"fast": "xla_fp8_rowwise", "slow": "xla_fp8_rowwise"})
    candidates = {s: plan.choice_for(s) for s in ("fast", "slow")}
    errors = validate.report_scores(report, plan, candidates, "error")
    self.assertEqual(errors, {"fast": -35.0, "slow": -20.0})   # lowest SQNR = highest score
    # A site off the report cannot move the check (-inf); the record holds it as null, so
    # the plan carrying the record still writes as JSON.
    unknown = {**candidates, "gone": plan.choice_for("fast")}
    scores = validate.report_scores(report, plan, unknown, "error")
    self.assertEqual(scores["gone"], -np.inf)
    recorded = backoff.recorded_scores(scores)
    self.assertEqual(recorded, {"fast": -35.0, "slow": -20.0, "gone": None})
    path = os.path.join(tempfile.mkdtemp(prefix="loka_scores_"), "plan.json")
    save_plan(add_validation(plan, {"step": "quality_held_out", "report_scores": recorded}),
              path)
    self.assertEqual(read_plan(path)["validation"][-1]["report_scores"], recorded)
    times = validate.report_scores(report, plan, candidates, "time")
    base = hm.BASE_US
    # Three passes each: plan time minus xla_bf16 time at the median.
    np.testing.assert_allclose(times["fast"], 3 * (base / 1.5 - base))
    np.testing.assert_allclose(times["slow"], 3 * (base / 0.8 - base))
    self.assertEqual(validate.worst_by_report(times), ["slow"])
    many = {f"s{i}": float(i) for i in range(9)}
    self.assertEqual(validate.worst_by_report(many), ["s8", "s7", "s6"])  # ceil(9 / 4)
    unmovable = {"a": -np.inf, "b": -np.inf, "c": -30.0}
    self.assertEqual(validate.worst_by_report(unmovable), ["c"])
    with self.assertRaises(ValueError):
      validate.report_scores(report, plan, candidates, "speed")

  def test_held_out_backs_off_the_worst_ranked_site_without_measuring_each(self):
    base = context()
    self.assertContainsSubset([BAD_SITE, GOOD_SITE, OTHER_SITE], base.site_names())
    ctx = dataclasses.replace(base, report=ranking_report(
        {BAD_SITE: 8.0, GOOD_SITE: 30.0, OTHER_SITE: 31.0}))
    plan = plan_of({BAD_SITE: "test_two_bit", GOOD_SITE: "xla_fp8_rowwise",
                    OTHER_SITE: "xla_fp8_rowwise"})
    config = validate.ValidationConfig(max_rel_logloss=0.002, max_measured_sites=2)
    out = validate.check_held_out(plan, ctx, config)
    self.assertEqual(kernels(out, BAD_SITE), {p: FALLBACK for p in hm.PASSES})
    for site in (GOOD_SITE, OTHER_SITE):   # one back-off round sufficed
      self.assertEqual(kernels(out, site), {p: "xla_fp8_rowwise" for p in hm.PASSES})
    rounds = [r for r in validate.validation_records(out, "quality_held_out") if "round" in r]
    self.assertFalse(rounds[0]["passed"])
    self.assertNotIn("contributions", rounds[0])
    self.assertEqual(rounds[0]["report_scores"][BAD_SITE], -8.0)
    self.assertTrue(rounds[-1]["passed"] and rounds[-1]["final"])

  def test_one_program_measures_past_the_cap_where_the_report_ranks_wrong(self):
    # The report ranks GOOD_SITE worst (8 dB) and BAD_SITE best (40 dB); in the model
    # BAD_SITE's two-bit forward is what moves the loss. Ranked, round 0 backs off the wrong
    # site; measured in one program, only the right one.
    ctx = dataclasses.replace(context(), report=ranking_report(
        {BAD_SITE: 40.0, GOOD_SITE: 8.0, OTHER_SITE: 31.0}))
    plan = plan_of({BAD_SITE: "test_two_bit", GOOD_SITE: "xla_fp8_rowwise",
                    OTHER_SITE: "xla_fp8_rowwise"})
    outs = {one: validate.check_held_out(plan, ctx, validate.ValidationConfig(
        max_rel_logloss=0.002, max_measured_sites=2, held_out_one_program=one))
            for one in (False, True)}
    self.assertEqual(kernels(outs[False], GOOD_SITE), {p: FALLBACK for p in hm.PASSES})
    self.assertEqual(kernels(outs[True], GOOD_SITE), {p: "xla_fp8_rowwise" for p in hm.PASSES})
    self.assertEqual(kernels(outs[True], BAD_SITE), {p: FALLBACK for p in hm.PASSES})
    first = [r for r in validate.validation_records(outs[True], "quality_held_out")
             if "round" in r][0]
    self.assertNotIn("report_scores", first)
    self.assertEqual(sorted(first["contributions"]), sorted([BAD_SITE, GOOD_SITE, OTHER_SITE]))
    # The training checks' cap follows their own one-program flag the same way.
    candidates = {s: plan.choice_for(s) for s in (BAD_SITE, GOOD_SITE, OTHER_SITE)}
    capped = validate.ValidationConfig(max_measured_sites=2)
    self.assertTrue(validate.backoff._ranked_by_report(ctx, capped, candidates,
                                               capped.gradient_one_program))
    self.assertFalse(validate.backoff._ranked_by_report(ctx, capped, candidates, one_program=True))


if __name__ == "__main__":
  absltest.main()
