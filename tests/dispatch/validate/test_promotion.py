"""The speed promotion: xla_bf16 sites go to the FP8 kernel that loses least alone, and a
promotion is kept only when the whole step pays; a paused promotion resumes with the
proposals it lacks."""
import dataclasses
from unittest import mock

import chex
import numpy as np
from absl.testing import absltest

import report_builders as hm
from loka_jax.dispatch import validate
from loka_jax.plan.file import FALLBACK, add_validation, promote
from loka_jax.train import report as train_report
from validate_helpers import (BAD_SITE, GOOD_SITE, OTHER_SITE, context, deadline_hook, kernels,
                              plan_of, promotion_report, register_test_kernels,
                              unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class PromotionTest(chex.TestCase):
  """Sites that selection left in bf16 because each pass alone is slower are promoted to FP8
  when the whole step is faster, and only then."""

  def _context(self, report):
    """The shared context with `report`. Timing a step donates the context's state and puts a
    new copy on the copy made here, so the shared one gets it back afterwards."""
    base = context()
    ctx = dataclasses.replace(base, report=report)
    self.addCleanup(lambda: setattr(base, "state", ctx.state))
    return ctx

  def test_proposes_per_sort_the_safe_kernel_that_loses_least_alone(self):
    plan = plan_of({BAD_SITE: "xla_fp8_rowwise"})          # already FP8: not promotable
    names = [GOOD_SITE, OTHER_SITE, BAD_SITE, "layer_0/lcb"]  # lcb: not in the report
    got = {p.kernel: p for p in validate.promotions(promotion_report(), plan, names)}
    self.assertEqual(sorted(got), ["flax_fp8_delayed", "xla_fp8_tensorwise"])
    # Tensorwise loses least of the per-pass kernels; the two-bit kernel is fast but unsafe.
    self.assertEqual(got["xla_fp8_tensorwise"].sites, (GOOD_SITE, OTHER_SITE))
    np.testing.assert_allclose(got["xla_fp8_tensorwise"].alone,
                               3 / (1 / 0.80 + 2 / 0.70), rtol=1e-6)
    # The delayed op's weight gradient is 12 dB at OTHER_SITE: below the 20 dB budget there.
    self.assertEqual(got["flax_fp8_delayed"].sites, (GOOD_SITE,))
    # Two per sort: the per-pass runner-up (rowwise, slower alone) follows tensorwise; the
    # fused sort has no second kernel.
    two = validate.promotions(promotion_report(), plan, names, per_sort=2)
    self.assertEqual([p.kernel for p in two],
                     ["flax_fp8_delayed", "xla_fp8_tensorwise", "xla_fp8_rowwise"])
    self.assertEqual(two[2].sites, (GOOD_SITE, OTHER_SITE))
    self.assertLess(two[2].alone, two[1].alone)
    self.assertEqual(validate.promotions(promotion_report(), plan, names, per_sort=1),
                     [got["flax_fp8_delayed"], got["xla_fp8_tensorwise"]])
    with self.assertRaisesRegex(ValueError, "promotion_per_sort must be >= 1"):
      validate.ValidationConfig(promotion_per_sort=0)

  def test_a_site_validation_backed_off_is_never_promoted_again(self):
    plan = validate.back_off_site(plan_of({GOOD_SITE: "xla_fp8_tensorwise"}),
                                  mock.Mock(report=None), GOOD_SITE, "test", step="speed",
                                  to_fallback=True)
    self.assertEqual(validate.promotable_sites(plan, [GOOD_SITE, OTHER_SITE]), [OTHER_SITE])
    got = validate.promotions(promotion_report(), plan, [GOOD_SITE, OTHER_SITE])
    self.assertEqual([p.sites for p in got], [(OTHER_SITE,)])

  def test_promote_puts_the_kernel_in_every_pass_and_records_it(self):
    plan = plan_of({BAD_SITE: "xla_fp8_rowwise"})
    out = promote(plan, [GOOD_SITE, OTHER_SITE], "xla_fp8_tensorwise", "test",
                           step=validate.PROMOTION)
    for site in (GOOD_SITE, OTHER_SITE):
      self.assertEqual(kernels(out, site), {p: "xla_fp8_tensorwise" for p in hm.PASSES})
      self.assertEqual(out["sites"][site]["fwd"]["promoted_from"], FALLBACK)
    self.assertEqual(kernels(out, BAD_SITE), {p: "xla_fp8_rowwise" for p in hm.PASSES})
    self.assertEqual(out["validation"][-1]["sites"], sorted([GOOD_SITE, OTHER_SITE]))
    self.assertEqual(plan["validation"], [])  # the original is unchanged
    with self.assertRaisesRegex(ValueError, "does not run xla_bf16"):
      promote(plan, [BAD_SITE], "xla_fp8_tensorwise", "test")

  def test_pays_only_when_training_is_provably_faster_and_inference_not_slower(self):
    def summaries(train_ci, infer_ci):
      return {"train": {"p": {"speedup_ci": train_ci}}, "infer": {"p": {"speedup_ci": infer_ci}}}
    self.assertTrue(validate.promotion_pays(summaries([1.01, 1.05], [0.97, 1.02]), "p"))
    self.assertFalse(validate.promotion_pays(summaries([0.99, 1.05], [1.1, 1.2]), "p"))
    self.assertFalse(validate.promotion_pays(summaries([1.01, 1.05], [0.95, 0.99]), "p"))

  def test_skipped_on_a_cpu_unless_forced(self):
    ctx = self._context(promotion_report())
    out = validate.check_promotion(plan_of({}), ctx, validate.ValidationConfig(speed=True))
    (record,) = validate.validation_records(out, validate.PROMOTION)
    self.assertTrue(record["skipped"] and record["final"])
    self.assertIn("not on a GPU", record["reason"])

  def test_a_validation_resumed_from_before_promotion_keeps_its_rounds(self):
    ctx = self._context(promotion_report())
    begun = add_validation(plan_of({}), {"step": "quality_held_out", "round": 0})
    out = validate.check_promotion(begun, ctx, validate.ValidationConfig(promote=True))
    (record,) = validate.validation_records(out, validate.PROMOTION)
    self.assertTrue(record["skipped"])
    self.assertIn("quality_held_out already judged this plan", record["reason"])

  def test_a_promotion_slower_in_the_step_is_not_kept(self):
    # The only proposal stalls 4 ms in every pass: timed for real, its step cannot be faster.
    report = hm.report({GOOD_SITE: hm.site(hm.same_passes(
        {"test_slow": hm.entry(sqnr=40.0, speedup=(0.90, 0.95, 1.0))}))}, model="wukong")
    ctx = self._context(report)
    plan = plan_of({})
    out = validate.check_promotion(plan, ctx, validate.ValidationConfig(promote=True))
    (record,) = validate.validation_records(out, validate.PROMOTION)
    self.assertEqual(list(record["proposals"]), ["test_slow"])
    self.assertFalse(record["proposals"]["test_slow"]["pays"])
    self.assertLess(record["proposals"]["test_slow"]["train"]["speedup_ci"][0], 1.0)
    self.assertIsNone(record["promoted"])
    self.assertEqual(out["sites"], plan["sites"])

  def test_the_fastest_paying_proposal_is_kept_and_validated_after(self):
    # Which plan is faster on a GPU cannot be shown on a CPU: the step timings are given, and
    # the test checks what is timed and what is kept.
    timed = {}

    def measure(ctx, plans, baseline, *args):
      timed.update(plans)
      speed = {"plan": (1.0, [1.0, 1.0]), "promote xla_fp8_tensorwise": (1.08, [1.04, 1.12]),
               "promote flax_fp8_delayed": (1.03, [1.01, 1.05])}
      return {m: {n: {"speedup": speed[n][0], "speedup_ci": speed[n][1]} for n in plans}
              for m in ("train", "infer")}

    ctx = self._context(promotion_report())
    config = validate.ValidationConfig(promote=True, speed=False, shadow_steps=0,
                                       max_rel_logloss=1.0)
    with mock.patch.object(validate.promotion, "measure_steps", side_effect=measure):
      out = validate.validate_end_to_end(plan_of({}), ctx, config)
    self.assertEqual(sorted(timed), ["plan", "promote flax_fp8_delayed",
                                     "promote xla_fp8_tensorwise"])
    self.assertEqual(timed["promote xla_fp8_tensorwise"].choice_for(OTHER_SITE).for_pass("fwd"),
                     "xla_fp8_tensorwise")
    self.assertEqual(timed["plan"].choice_for(OTHER_SITE).for_pass("fwd"), FALLBACK)
    for site in (GOOD_SITE, OTHER_SITE, BAD_SITE):
      self.assertEqual(kernels(out, site), {p: "xla_fp8_tensorwise" for p in hm.PASSES})
    (record,) = validate.validation_records(out, validate.PROMOTION)
    self.assertEqual(record["promoted"], "xla_fp8_tensorwise")
    self.assertTrue(record["proposals"]["flax_fp8_delayed"]["pays"])
    # The held-out check then judged the promoted plan.
    (held,) = validate.validation_records(out, "quality_held_out")
    self.assertTrue(held["passed"])
    (done,) = validate.validation_records(out, "validated")
    self.assertEqual(done["promoted"], sorted([GOOD_SITE, OTHER_SITE, BAD_SITE]))
    self.assertNotIn(validate.PROMOTION, done["passed"])
    lines = train_report.validation_lines(out)
    self.assertIn("promoted 3 sites -> xla_fp8_tensorwise", lines)
    self.assertIn("xla_fp8_tensorwise at 3 sites: train 1.080x [1.040, 1.120]", lines)
    self.assertIn("(promoted: ", lines)

  def test_a_promotion_paused_between_proposals_resumes_with_the_ones_it_lacks(self):
    # Each proposal is its own pair with the plan (two whole-model compiles), saved once
    # timed: several proposals of a large preset outlast one call. The clock is the test's:
    # each pair takes 100 s of it, and the first call's deadline is 150 s away.
    clock = [1000.0]
    timed = []
    speeds = {"promote xla_fp8_tensorwise": (1.08, [1.04, 1.12]),
              "promote flax_fp8_delayed": (1.03, [1.01, 1.05])}

    def measure(ctx, plans, baseline, *args):
      (name,) = [n for n in plans if n != "plan"]
      timed.append(name)
      clock[0] += 100.0
      return {m: {"plan": {"speedup": 1.0, "speedup_ci": [1.0, 1.0]},
                  name: {"speedup": speeds[name][0], "speedup_ci": speeds[name][1]}}
              for m in ("train", "infer")}

    ctx = self._context(promotion_report())
    config = validate.ValidationConfig(promote=True)
    saved = []
    fake_time = mock.Mock(time=lambda: clock[0])
    with mock.patch.object(validate.promotion, "measure_steps", side_effect=measure), \
        mock.patch.object(validate.records, "time", fake_time):
      progress = validate.Progress(save=saved.append,
                                   should_stop=deadline_hook(clock[0] + 150.0, fake_time.time))
      with self.assertRaisesRegex(validate.ValidationPaused, "speed promotion, proposal"):
        validate.check_promotion(plan_of({}), ctx, config, progress)
      partial = saved[-1]
      (first,) = validate.validation_records(partial, validate.PROPOSAL)
      self.assertEqual(timed, [f"promote {first['kernel']}"])
      self.assertEqual(first["seconds"], 100.0)
      out = validate.check_promotion(partial, ctx, config, validate.Progress())
    self.assertEqual(sorted(timed), sorted(speeds))   # the second call timed only the other
    (record,) = validate.validation_records(out, validate.PROMOTION)
    self.assertEqual(record["promoted"], "xla_fp8_tensorwise")
    self.assertEqual(record["proposals"][first["kernel"]]["train"], first["train"])
    self.assertTrue(all(p["pays"] for p in record["proposals"].values()))
    # The promoted plan keeps both proposals' records.
    self.assertLen(validate.validation_records(out, validate.PROPOSAL), 2)
    for site in (GOOD_SITE, OTHER_SITE):
      self.assertEqual(kernels(out, site), {p: "xla_fp8_tensorwise" for p in hm.PASSES})


if __name__ == "__main__":
  absltest.main()
