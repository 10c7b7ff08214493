"""The speed check (forced on a CPU): slow sites are backed off, clearly slow ones in one
round, a step without FP8 passes is not acted on, and a round paused between sites resumes
without timing them again."""
import os
import tempfile
import time
from unittest import mock

import chex
from absl.testing import absltest

import report_builders as hm
from loka_jax.dispatch import validate
from loka_jax.plan.file import FALLBACK, read_plan, save_plan
from loka_jax.train import report as train_report
from validate_helpers import (BAD_SITE, GOOD_SITE, OTHER_SITE, context, deadline_hook, kernels,
                              plan_of, register_test_kernels, unregister_test_kernels)


# A test kernel's host stall makes a step 5-80 ms on a CPU, far above the protocol's floor for
# one step a sample: these tests time one step a sample (speed_min_sample_s=0), where the
# default would run the fast bf16 step's count (3-13) of every stalled step. Several steps a
# sample are test_short_steps_are_timed_several_to_a_sample's.
ONE_STEP_A_SAMPLE = dict(speed=True, speed_min_sample_s=0.0)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class SpeedTest(chex.TestCase):

  def test_skipped_on_a_cpu_with_the_reason(self):
    out = validate.check_speed(plan_of({GOOD_SITE: "xla_fp8_rowwise"}), context())
    (record,) = validate.validation_records(out, "speed")
    self.assertTrue(record["skipped"])
    self.assertIn("not on a GPU", record["reason"])

  def test_a_step_without_fp8_passes_is_not_acted_on(self):
    # Gradient-only FP8: the inference step runs bf16+Mods' kernels, so however its CI falls
    # it must not be counted as failing; the train step (which does run FP8) is.
    ctx = context()
    plan = plan_of({GOOD_SITE: {"grad_lhs": "xla_fp8_rowwise"}})
    config = validate.ValidationConfig(**ONE_STEP_A_SAMPLE, min_speedup=50.0)
    out = validate.check_speed(plan, ctx, config)
    rounds = [r for r in validate.validation_records(out, "speed") if "round" in r]
    self.assertLess(rounds[0]["infer"]["speedup_ci"][0], 50.0)
    self.assertEqual(rounds[0]["same_kernels_as_bf16_mods"], ["infer"])
    self.assertEqual(rounds[0]["failing"], ["train"])
    self.assertEqual(kernels(out, GOOD_SITE)["grad_lhs"], FALLBACK)
    self.assertTrue(rounds[-1]["final"])

  def test_forced_backs_off_the_slow_site(self):
    ctx = context()
    plan = plan_of({BAD_SITE: "test_slow", GOOD_SITE: "xla_fp8_rowwise"})
    config = validate.ValidationConfig(**ONE_STEP_A_SAMPLE, min_speedup=0.5)
    out = validate.check_speed(plan, ctx, config)
    self.assertEqual(kernels(out, BAD_SITE), {p: FALLBACK for p in hm.PASSES})
    records = validate.validation_records(out, "speed")
    rounds = [r for r in records if "round" in r]
    self.assertFalse(rounds[0]["passed"])
    self.assertEqual(rounds[0]["repeats"], 20)
    self.assertLess(rounds[0]["train"]["speedup_ci"][0], 0.5)
    slow = rounds[0]["in_context_slowdown"]
    self.assertGreater(slow[BAD_SITE], slow[GOOD_SITE])
    backed_off = [r["site"] for r in records if "to" in r]
    self.assertEqual(backed_off[0], BAD_SITE)  # the stall goes first
    if kernels(out, GOOD_SITE)["fwd"] == "xla_fp8_rowwise":
      self.assertTrue(rounds[-1]["passed"])
    else:
      # Emulated FP8 on a loaded CPU can itself be slow in context: then only a measurement
      # may take the good site back too (its reversion clearly faster in the first round, or
      # a later round still missing 0.5x), never a passing round.
      first_round = [r["site"] for r in records[:records.index(rounds[1])] if "to" in r]
      if GOOD_SITE not in first_round:
        self.assertFalse(rounds[1]["passed"], rounds[1])
        self.assertLess(min(rounds[1][m]["speedup_ci"][0] for m in rounds[1]["failing"]), 0.5)

  def test_every_clearly_slow_site_is_backed_off_in_one_round(self):
    # Each site stalls in its forward only (once in either step), which keeps the steps short:
    # the plan without one site still runs either step 1.7-1.9x as fast.
    stall = {"fwd": "test_stall"}
    plan = plan_of({BAD_SITE: stall, OTHER_SITE: stall})
    out = validate.check_speed(plan, context(), validate.ValidationConfig(**ONE_STEP_A_SAMPLE))
    records = validate.validation_records(out, "speed")
    first, later = records[0], records[1:]
    slowest = max(first["in_context_slowdown"], key=first["in_context_slowdown"].get)
    second = ({BAD_SITE, OTHER_SITE} - {slowest}).pop()
    backed_off = [r["site"] for r in later[:next((i for i, r in enumerate(later) if "round" in r),
                                                 len(later))]]
    self.assertEqual(backed_off[0], slowest)
    self.assertEqual(kernels(out, OTHER_SITE), {p: FALLBACK for p in hm.PASSES})
    self.assertEqual(kernels(out, BAD_SITE), {p: FALLBACK for p in hm.PASSES})
    if first["in_context_ci_low"][second] > 1.0:  # the rule: the other goes in the same round
      self.assertEqual(backed_off, [slowest, second])
      self.assertIn("CI above 1", later[1]["reason"])
      self.assertLen([r for r in records if "round" in r], 2)  # the stalls went in one round
    else:  # a burst of host load hid the stall: it waits for the next round, as the rule says
      self.assertEqual(backed_off, [slowest])

  def test_clearly_slow_sites_rank_by_slowdown_and_need_a_clear_ci(self):
    # ci_lows: each site's lowest CI lower bound over the failing steps ("without SITE" vs
    # the plan); a site other than the slowest goes only when that bound is above 1.
    ci_lows = {"a": 1.10, "b": 0.90, "c": 0.97, "d": 1.02}
    slowdowns = {"a": 1.05, "b": 1.30, "c": 1.02, "d": 1.10}
    self.assertEqual(validate.clearly_slow_sites(ci_lows, slowdowns),
                     ["b", "d", "a"])  # b is the slowest: always first, whatever its CI
    self.assertEqual(validate.clearly_slow_sites({**ci_lows, "c": 1.001}, slowdowns),
                     ["b", "d", "a", "c"])
    self.assertEqual(validate.clearly_slow_sites({"c": 1.2, "b": 1.5}, {"c": 1.0, "b": 0.9}),
                     ["c", "b"])

  def test_a_speed_round_paused_between_sites_resumes_without_timing_them_again(self):
    # A speed round times each site in context as its own pair (the plan, the plan without
    # it) and saves it at once: at DHEN large one pair compiles in about 80 s, so a round
    # over 14 sites outlasts a call and must resume where it stopped.
    plan = plan_of({BAD_SITE: "test_slow", GOOD_SITE: "xla_fp8_rowwise"})
    config = validate.ValidationConfig(**ONE_STEP_A_SAMPLE, min_speedup=0.5)
    ctx = context()
    timed = {"first": [], "resumed": [], "elsewhere": []}
    phase = ["first"]
    real = validate.in_context_slowdown

    def counting(ctx_, plan_, site, failing, config_):
      timed[phase[0]].append(site)
      return real(ctx_, plan_, site, failing, config_)
    round_steps = {"first": 0, "resumed": 0, "elsewhere": 0}   # bf16+Mods against the plan
    real_steps = validate.measure_steps

    def counting_steps(ctx_, plans, *args, **kwargs):
      round_steps[phase[0]] += "bf16" in plans
      return real_steps(ctx_, plans, *args, **kwargs)
    saved = []
    progress = validate.Progress()

    def save(p):
      saved.append(p)
      if validate.validation_records(p, "speed_site"):
        progress.should_stop = deadline_hook(time.time() + 3600.0)
        progress.longest_s["speed_site"] = 7200.0   # the next site would end past it
    progress.save = save
    with mock.patch.object(validate.speed, "in_context_slowdown", counting), \
         mock.patch.object(validate.speed, "measure_steps", counting_steps):
      with self.assertRaisesRegex(validate.ValidationPaused, "speed round 0, site"):
        validate.check_speed(plan, ctx, config, progress)
      # The next call reads the plan back from its file (plan_validating.json).
      path = os.path.join(tempfile.mkdtemp(prefix="loka_speed_resume_"), "plan.json")
      save_plan(saved[-1], path)
      partial = read_plan(path)
      (first,) = validate.validation_records(partial, "speed_site")
      self.assertEqual(timed["first"], [first["site"]])
      self.assertEqual(first["round"], 0)
      self.assertIn("ci_low", first)
      phase[0] = "resumed"
      out = validate.check_speed(partial, ctx, config, validate.Progress())
      # Timings from another card are not this one's: that call times round 0's steps and
      # its first site again (and is stopped there: the rest of its round is the resumed
      # call's).
      phase[0] = "elsewhere"
      moved = partial.to_dict()
      for r in moved["validation"]:
        if r["step"] in ("speed_steps", "speed_site"):
          r["device"] = "another GPU"
      elsewhere = validate.Progress()

      def stop_after_its_first_site(p):
        if timed["elsewhere"]:
          elsewhere.should_stop = deadline_hook(time.time() + 3600.0)
          elsewhere.longest_s["speed_site"] = 7200.0
      elsewhere.save = stop_after_its_first_site
      with self.assertRaisesRegex(validate.ValidationPaused, "speed round 0, site"):
        validate.check_speed(moved, ctx, config, elsewhere)
    self.assertEqual(round_steps["elsewhere"], 1)
    self.assertEqual(timed["elsewhere"], [first["site"]])
    # Nor are the round's steps: round 0's were recorded before its first site.
    self.assertEqual(round_steps["first"], 1)
    rounds = [r for r in validate.validation_records(out, "speed") if "round" in r]
    self.assertEqual(round_steps["resumed"], len(rounds) - 1)
    (steps0,) = [r for r in validate.validation_records(out, "speed_steps")
                 if r["round"] == 0]
    self.assertEqual(rounds[0]["train"]["speedup"], steps0["steps"]["train"]["plan"]["speedup"])
    self.assertIn("timed steps: train",
                  train_report.validation_line(steps0, measurements=True))
    other = GOOD_SITE if first["site"] == BAD_SITE else BAD_SITE
    # The saved site is not timed again; the other is, first. (On a loaded host the next
    # round may fail too and time the site left in it once more: that is round 1's own.)
    self.assertEqual(timed["resumed"][0], other)
    self.assertNotIn(first["site"], timed["resumed"])
    (round0,) = [r for r in validate.validation_records(out, "speed") if r.get("round") == 0]
    self.assertEqual(round0["in_context_slowdown"][first["site"]], first["value"])
    self.assertEqual(round0["in_context_ci_low"][first["site"]], first["ci_low"])
    self.assertGreater(round0["in_context_slowdown"][BAD_SITE],
                       round0["in_context_slowdown"][GOOD_SITE])
    self.assertEqual(kernels(out, BAD_SITE), {p: FALLBACK for p in hm.PASSES})

  def test_an_in_context_slowdown_is_not_reused_in_another_round(self):
    # A site's cost in context depends on every other site of the plan, which each round
    # changes: a value from round 0 must not stand in for round 1's.
    plan = plan_of({BAD_SITE: "test_slow", GOOD_SITE: "xla_fp8_rowwise"})
    candidates = validate.fp8_sites(plan, [BAD_SITE, GOOD_SITE])
    scope0 = {"round": 0, "failing": ["train"]}
    plan, _ = validate.measure_sites(plan, "speed", 0, candidates,
                                     lambda site, choice: (2.0, {"ci_low": 1.5}),
                                     validate.Progress(), scope0)
    self.assertEqual({r["site"]: r["ci_low"] for r in
                      validate.site_records(plan, "speed", scope0)},
                     {BAD_SITE: 1.5, GOOD_SITE: 1.5})
    measured = []
    for scope in ({"round": 1, "failing": ["train"]}, {"round": 0, "failing": ["infer"]}):
      _, values = validate.measure_sites(
          plan, "speed", scope["round"], candidates,
          lambda site, choice: measured.append(site) or (1.0, {"ci_low": 0.9}),
          validate.Progress(), scope)
      self.assertEqual(values, {BAD_SITE: 1.0, GOOD_SITE: 1.0})
    self.assertLen(measured, 4)
    # In its own round and for its own failing steps the saved value stands.
    _, values = validate.measure_sites(plan, "speed", 0, candidates,
                                       lambda site, choice: measured.append(site) or 0.0,
                                       validate.Progress(), scope0)
    self.assertEqual(values, {BAD_SITE: 2.0, GOOD_SITE: 2.0})
    self.assertLen(measured, 4)

  def test_short_steps_are_timed_several_to_a_sample(self):
    ctx = context()
    kplan = plan_of({GOOD_SITE: "xla_fp8_rowwise"}).kernel_plan()
    with mock.patch.object(validate.speed.timing, "calls_for", return_value=3) as calls_for:
      got = validate.measure_steps(ctx, {"bf16": validate.BASELINE, "plan": kplan}, "bf16",
                                   min_sample_s=0.05)
    self.assertEqual(calls_for.call_count, 2)  # once per mode, on the baseline's step
    self.assertTrue(all(c.args[1] == 0.05 for c in calls_for.call_args_list))
    for mode in ("train", "infer"):
      self.assertEqual({got[mode][n]["inner"] for n in ("bf16", "plan")}, {3})
    one = validate.measure_steps(ctx, {"bf16": validate.BASELINE, "plan": kplan}, "bf16",
                                 min_sample_s=0.0)
    self.assertEqual(one["train"]["plan"]["inner"], 1)
    with self.assertRaisesRegex(ValueError, "speed_min_sample_s"):
      validate.ValidationConfig(speed_min_sample_s=-1.0)


if __name__ == "__main__":
  absltest.main()
