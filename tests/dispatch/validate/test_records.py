"""Validation's records: a check reopened undoes its back-offs and reads its measurements
back; measurements are recorded as taken, survive the plan file, and are paced by their own
kind against the caller's should_stop."""
import functools
import os
import tempfile
import time
from unittest import mock

import chex
import numpy as np
from absl.testing import absltest

import report_builders as hm
from loka_jax.dispatch import validate
from loka_jax.plan.file import FALLBACK, add_validation, read_plan, save_plan
from loka_jax.train import report as train_report
from loka_jax.train.optim import OptimConfig
from validate_helpers import (BAD_SITE, GOOD_SITE, RESULTS, context, deadline_hook, kernels,
                              plan_of, read_plan_roundtrip, register_test_kernels,
                              unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class ReopenTest(chex.TestCase):
  """A check started over: its back-offs undone, its records kept and read again."""

  def test_a_reopened_check_undoes_its_back_offs_and_judges_again_from_its_records(self):
    ctx = context()
    plan = plan_of({BAD_SITE: {"grad_rhs": "test_flipped"}, GOOD_SITE: "xla_fp8_rowwise"})
    config = validate.ValidationConfig(shadow_steps=20, shadow_window=10)
    out = validate.check_shadow(plan, ctx, config)
    self.assertEqual(kernels(out, BAD_SITE)["grad_rhs"], FALLBACK)
    rounds = len([r for r in validate.validation_records(out, "quality_shadow")
                  if "round" in r])
    reopened = read_plan_roundtrip(
        validate.reopen_check(out, "quality_shadow", "the bound changed"))
    self.assertEqual(kernels(reopened, BAD_SITE), kernels(plan, BAD_SITE))
    self.assertEqual(kernels(reopened, GOOD_SITE), kernels(plan, GOOD_SITE))
    self.assertIn("reopened", reopened["sites"][BAD_SITE]["grad_rhs"]["reason"])
    self.assertFalse(validate.finished(reopened, "quality_shadow"))
    mark = reopened["validation"][-1]
    self.assertEqual((mark["rounds_before"], [r["site"] for r in mark["restored"]]),
                     (rounds, [BAD_SITE]))
    self.assertEqual(reopened["validation"][:-1], out["validation"])   # nothing dropped
    self.assertIn(f"reopened after {rounds} round(s), back-offs undone: {BAD_SITE} "
                  "(the bound changed)", train_report.validation_line(mark))
    # Judged again from round 0: every run and gradient change it needs is recorded.
    with mock.patch.object(validate.runs, "shadow_run", side_effect=AssertionError("trained")), \
         mock.patch.object(validate.training, "gradient_change",
                           side_effect=AssertionError("measured")):
      again = validate.check_shadow(reopened, ctx, config)
    self.assertTrue(validate.finished(again, "quality_shadow"))
    self.assertEqual({s: kernels(again, s) for s in (BAD_SITE, GOOD_SITE)},
                     {s: kernels(out, s) for s in (BAD_SITE, GOOD_SITE)})
    new_rounds = [r["round"] for r in validate.validation_records(again, "quality_shadow")
                  if "round" in r][rounds:]
    self.assertEqual(new_rounds, list(range(rounds)))

  def test_only_the_last_unfinished_check_can_be_reopened(self):
    from loka_jax.plan.file import add_validation
    plan = plan_of({GOOD_SITE: "xla_fp8_rowwise"})
    with self.assertRaisesRegex(ValueError, "no quality_shadow records"):
      validate.reopen_check(plan, "quality_shadow", "why")
    shadowed = add_validation(plan, {"step": "quality_shadow", "round": 0, "passed": True,
                                     "final": True})
    with self.assertRaisesRegex(ValueError, "unknown check 'shadow'"):
      validate.reopen_check(shadowed, "shadow", "why")
    with self.assertRaisesRegex(ValueError, "give the reason"):
      validate.reopen_check(shadowed, "quality_shadow", "")
    timed = add_validation(shadowed, {"step": "speed", "round": 0, "passed": True})
    with self.assertRaisesRegex(ValueError, "speed already judged the plan"):
      validate.reopen_check(timed, "quality_shadow", "why")
    # Its timed steps alone, before its first verdict, count as the speed check's too.
    for record_step in ("speed_steps", "speed_site", "quality_from_init_run"):
      begun = add_validation(shadowed, {"step": record_step, "round": 0})
      with self.assertRaisesRegex(ValueError, "already judged the plan"):
        validate.reopen_check(begun, "quality_shadow", "why")
    # The earlier promotion's records do not.
    promoted = add_validation(shadowed, {"step": "speed_promotion", "final": True})
    self.assertTrue(validate.reopen_check(promoted, "quality_shadow", "why")
                    ["validation"][-1]["reopened"])
    with self.assertRaisesRegex(ValueError, "the plan is validated"):
      validate.reopen_check(add_validation(shadowed, {"step": "validated"}), "quality_shadow",
                            "why")
    once = validate.reopen_check(shadowed, "quality_shadow", "why")
    self.assertEqual(once["validation"][-1]["restored"], [])   # it had backed nothing off
    with self.assertRaisesRegex(ValueError, "since it was last opened"):
      validate.reopen_check(once, "quality_shadow", "again")

  def test_reopened_with_the_later_checks_every_back_off_is_undone_newest_first(self):
    from loka_jax.plan.file import add_validation, back_off
    plan = plan_of({BAD_SITE: "xla_fp8_rowwise", GOOD_SITE: "xla_fp8_rowwise"})
    held = add_validation(plan, {"step": "quality_held_out", "round": 0, "passed": False})
    # held-out moves BAD_SITE's forward to bf16, then the shadow check its gradients too
    held = back_off(held, BAD_SITE, "fwd", "held-out", step="quality_held_out")
    held = add_validation(held, {"step": "quality_held_out", "round": 1, "passed": True,
                                 "final": True})
    shadow = add_validation(held, {"step": "quality_shadow", "round": 0, "passed": False})
    shadow = back_off(shadow, BAD_SITE, None, "shadow", step="quality_shadow")
    shadow = back_off(shadow, GOOD_SITE, None, "shadow", step="quality_shadow")
    timed = add_validation(shadow, {"step": "speed_steps", "round": 0})
    self.assertEqual(validate.held_out_backed_off(timed), {BAD_SITE: "held-out"})
    with self.assertRaisesRegex(ValueError, "reopen the later ones too"):
      validate.reopen_check(timed, "quality_held_out", "why")
    out = validate.reopen_check(timed, "quality_held_out", "why", later=True)
    for site in (BAD_SITE, GOOD_SITE):
      self.assertEqual(kernels(out, site), kernels(plan, site), site)
    marks = [r for r in out["validation"] if r.get("reopened")]
    # the shadow check first (its back-offs are newer), the speed check had no verdict yet
    self.assertEqual([m["step"] for m in marks], ["quality_shadow", "quality_held_out"])
    self.assertEqual([r["site"] for r in marks[0]["restored"]], [GOOD_SITE, BAD_SITE])
    self.assertEqual(marks[1]["restored"][0]["to"], {"fwd": "xla_fp8_rowwise"})
    self.assertIn("reopened with the quality_held_out check", marks[0]["reason"])
    self.assertFalse(validate.finished(out, "quality_held_out"))
    self.assertEqual(validate.held_out_backed_off(out), {})  # serving sees the undone too
    self.assertEqual(out["validation"][:len(timed["validation"])], timed["validation"])

  def test_the_committed_wukong_large_plan_reopened_from_held_out_is_the_selected_plan(self):
    # Its first three held-out rounds backed off 18 MLP sites ranked by the report's forward
    # error; the round that measured each site found `head/dense_0` alone moved the loss
    # (H200). Reopened with the shadow check after it, every site runs its selected kernels
    # again.
    results = RESULTS
    plan = read_plan(os.path.join(results, "plan_validating_wukong_large_h200_2026-12-02.json"))
    selected = read_plan(os.path.join(results, "plan_selected_wukong_large_h200_2026-11-27.json"))
    out = validate.reopen_check(plan, "quality_held_out", "measured in one program",
                                later=True)
    self.assertEqual({s: kernels(out, s) for s in selected["sites"]},
                     {s: kernels(selected, s) for s in selected["sites"]})
    self.assertLen(out["validation"][-1]["restored"], 23)
    self.assertLen(validate.held_out_backed_off(plan), 19)
    self.assertEqual(validate.held_out_backed_off(out), {})

  def test_the_reopened_wukong_large_held_out_check_measures_only_what_it_lacks(self):
    # The committed reopened plan, judged as its next call will judge it: the whole plan's
    # change as its recorded round 0 read it, then within the budget once a site
    # is backed off. Only the 18 sites without a recorded measurement are measured (given a
    # hair each here), and the recorded `head/dense_0` (+0.0526%) is the one backed off.
    from loka_jax.probe.report import load_report
    results = RESULTS
    plan = read_plan(os.path.join(results,
                                  "plan_validating_wukong_large_reopened_h200_2026-12-02.json"))
    report = load_report(os.path.join(results, "probe_report_wukong_large_h200_2026-11-27.json.gz"))
    ctx = mock.Mock(_cache={}, optim=OptimConfig(), report=report)
    ctx.site_names.return_value = sorted(plan["sites"])
    recorded = {s for s, _ in validate.saved_site_measurements(plan, "quality_held_out")}
    measured = []
    changes = iter([(5.41e-4, 3.5e-4), (2e-5, 1.3e-5)])
    evaluation = {"logloss": 0.5656, "ne": 1.0007, "auc": 0.52, "num_examples": 65536}
    with mock.patch.object(validate.held_out_check, "held_out", return_value=evaluation), \
         mock.patch.object(validate.held_out_check, "held_out_change_se",
                           side_effect=lambda *a: next(changes)), \
         mock.patch.object(validate.held_out_check, "held_out_change_switched",
                           side_effect=lambda c, wanted, site, size: measured.append(site) or 1e-6):
      out = validate.check_held_out(plan, ctx, validate.ValidationConfig(
          held_out_one_program=True))
    candidates = validate.fp8_sites(plan, sorted(plan["sites"]))
    self.assertLen(candidates, 33)
    self.assertEqual(sorted(measured), sorted(set(candidates) - recorded))
    self.assertLen(measured, 18)
    self.assertEqual(kernels(out, "head/dense_0"), {p: FALLBACK for p in hm.PASSES})
    for site in candidates:
      if site != "head/dense_0":
        self.assertEqual(kernels(out, site), kernels(plan, site), site)
    rounds = [r for r in validate.validation_records(out, "quality_held_out")
              if "round" in r][-2:]
    self.assertEqual([(r["round"], r["passed"]) for r in rounds], [(0, False), (1, True)])
    # Then the shadow check trains the new plan's three windows and nothing else: the
    # bf16+Mods and jittered runs are on record (here each plan run ends where bf16+Mods did).
    trained = []
    def run(c, kplan, steps, size, start, seed, optim, window, jitter,
            warmup_after_switch=0):
      trained.append((kplan == validate.BASELINE, window, jitter))
      return {"finite": True, "losses": np.full(steps, 0.5537),
              "held_out": {"logloss": 0.5273}}
    config = validate.ValidationConfig(shadow_windows=3, shadow_noise_floor=True,
                                       gradient_one_program=True)
    with mock.patch.object(validate.runs, "shadow_run", side_effect=run):
      shadowed = validate.check_shadow(out, ctx, config)
    self.assertEqual(trained, [(False, w, 0.0) for w in range(3)])
    self.assertTrue(validate.finished(shadowed, "quality_shadow"))

  def test_the_reopened_wukong_large_plan_passes_shadow_round_0_from_its_records(self):
    # The committed plan (docs/results, H200), judged as its next call
    # will judge it: every run it needs is recorded, so nothing trains.
    path = os.path.join(RESULTS, "plan_validating_wukong_large_h200_2026-12-02.json")
    plan = read_plan(path)
    ctx = mock.Mock(_cache={}, optim=OptimConfig())
    ctx.site_names.return_value = sorted(plan["sites"])
    config = validate.ValidationConfig(shadow_windows=3, shadow_noise_floor=True,
                                       gradient_one_program=True)
    with mock.patch.object(validate.runs, "shadow_run", side_effect=AssertionError("trained")):
      out = validate.check_shadow(plan, ctx, config)
    verdict = out["validation"][-1]
    self.assertEqual((verdict["round"], verdict["passed"], verdict["final"]), (0, True, True))
    self.assertAlmostEqual(verdict["rel_logloss_change"], 0.01173, places=5)
    self.assertAlmostEqual(verdict["noise_floor"]["held_out_bound"], 0.021748, places=6)
    self.assertEqual(verdict["noise_floor"]["train_bound"], 0.005)


class PacingTest(chex.TestCase):
  """Measurements are recorded as they are taken and paced by their own kind; none starts
  when the caller's should_stop says stop."""

  def test_each_kind_of_measurement_is_paced_by_its_own(self):
    # A training run recorded at 231 s (Wukong `large`'s shadow run) does not stop a site
    # measurement 60 s before the deadline; it stops the next run, and a slow site the next
    # site.
    run, site = validate.run_step("quality_shadow"), validate.site_step("quality_shadow")
    plan = add_validation(plan_of({GOOD_SITE: "xla_fp8_rowwise"}),
                                   {"step": run, "arm": "plan", "seconds": 231.0})
    candidates = validate.fp8_sites(plan, [GOOD_SITE])
    progress = validate.Progress(should_stop=deadline_hook(time.time() + 60.0))
    next_one = lambda step: [(f"the next {step}", {"arm": "bf16_mods"}, lambda: {})]
    with self.assertRaisesRegex(validate.ValidationPaused,
                                "the next quality_shadow_run: .* 231 s the slowest such"):
      validate.take_in_turn(plan, progress, run, next_one(run))
    plan, current = validate.measure_sites(plan, "quality_shadow", 0, candidates,
                                           lambda s, c: 0.5, progress)
    self.assertEqual(current, {GOOD_SITE: 0.5})
    slow = add_validation(plan, {"step": site, "seconds": 600.0})
    with self.assertRaisesRegex(validate.ValidationPaused, "600 s the slowest such"):
      validate.take_in_turn(
          slow, validate.Progress(should_stop=deadline_hook(time.time() + 60.0)), site,
          next_one(site))

  def test_a_program_that_already_ran_is_paced_by_its_warm_measurements(self):
    progress = validate.Progress()
    progress.measured("k", 111.0, "board")          # the first run compiles the board
    self.assertEqual(progress.pace("k", "board"), 111.0)   # no warm measurement yet
    progress.measured("k", 35.0, "board")
    self.assertEqual(progress.pace("k", "board"), 35.0)
    self.assertEqual(progress.pace("k", "another board"), 111.0)
    self.assertEqual(progress.pace("k"), 111.0)
    progress.measured("k", 40.0, "board")
    self.assertEqual(progress.pace("k", "board"), 40.0)
    self.assertEqual(progress.pace("other kind", "board"), 0.0)
    # Before its first warm rerun, a program is paced by its own first run here, not by a
    # slower one of another program (a shadow run: 162 s cold, another program's 268 s).
    runs = validate.Progress()
    runs.measured("run", 268.0)                      # recorded by an earlier call
    runs.measured("run", 162.0, "bf16_mods_jittered")
    self.assertEqual(runs.pace("run", "bf16_mods_jittered"), 162.0)
    self.assertEqual(runs.pace("run", "plan"), 268.0)
    runs.measured("run", 61.0, "bf16_mods_jittered")
    runs.measured("run", 200.0, "plan")
    self.assertEqual(runs.pace("run", "plan"), 61.0)   # the slowest warm rerun of its kind

    # Recorded by an earlier call: 111 s. Here the first takes 40 s, every other 10 s, and
    # the deadline is 200 s away: paced by the 111 s, the seventh would not start.
    step = validate.site_step("quality_shadow")
    recorded = add_validation(plan_of({GOOD_SITE: "xla_fp8_rowwise"}),
                                       {"step": step, "seconds": 111.0})
    def run(program_of):
      clock = [1000.0]
      def measure(i):
        clock[0] += 40.0 if i == 0 else 10.0
        return {}
      pending = [(f"site {i}", {"site": str(i)}, functools.partial(measure, i))
                 for i in range(10)]
      with mock.patch.object(validate.records, "time", mock.Mock(time=lambda: clock[0])):
        progress = validate.Progress(
            should_stop=deadline_hook(clock[0] + 200.0, clock=lambda: clock[0]))
        try:
          plan = validate.take_in_turn(recorded, progress, step, pending, program_of)
        except validate.ValidationPaused:
          plan = None
      return plan, clock[0] - 1000.0
    plan, spent = run(lambda fields: "board")
    self.assertLen(validate.validation_records(plan, step), 11)
    self.assertEqual(spent, 130.0)
    self.assertEqual(run(None), (None, 90.0))                    # each its own program
    self.assertEqual(run(lambda fields: fields["site"]), (None, 90.0))

  def test_site_measurements_survive_the_plan_file_including_non_finite_ones(self):
    plan = plan_of({BAD_SITE: "test_two_bit", GOOD_SITE: "xla_fp8_rowwise"})
    candidates = validate.fp8_sites(plan, [BAD_SITE, GOOD_SITE])
    values = {BAD_SITE: float("inf"), GOOD_SITE: 0.25}
    plan, current = validate.measure_sites(plan, "quality_shadow", 0, candidates,
                                           lambda site, choice: values[site],
                                           validate.Progress())
    self.assertEqual(current, values)
    path = os.path.join(tempfile.mkdtemp(prefix="loka_site_records_"), "plan.json")
    save_plan(plan, path)   # strict JSON: no Infinity token
    again = read_plan(path)
    self.assertEqual(validate.saved_site_measurements(again, "quality_shadow"),
                     {(s, c): values[s] for s, c in candidates.items()})
    self.assertEqual(validate.saved_site_measurements(again, "quality_held_out"), {})

  def test_a_calls_first_site_waits_when_an_earlier_call_measured_slow_sites(self):
    plan = plan_of({BAD_SITE: "test_two_bit", GOOD_SITE: "xla_fp8_rowwise"})
    candidates = validate.fp8_sites(plan, [BAD_SITE, GOOD_SITE])
    bad_only = {BAD_SITE: candidates[BAD_SITE]}
    plan, _ = validate.measure_sites(plan, "quality_held_out", 0, bad_only,
                                     lambda site, choice: 0.5, validate.Progress())
    (record,) = validate.validation_records(plan, "quality_held_out_site")
    self.assertGreaterEqual(record["seconds"], 0.0)
    # The earlier call's site took an hour; this call has half an hour left: nothing starts.
    slow = add_validation(plan, {**record, "site": "earlier/site", "seconds": 3600.0})
    measured = []
    with self.assertRaises(validate.ValidationPaused):
      validate.measure_sites(slow, "quality_held_out", 0, candidates,
                             lambda site, choice: measured.append(site) or 0.0,
                             validate.Progress(should_stop=deadline_hook(time.time() + 1800.0)))
    self.assertEqual(measured, [])
    # With the hour left it measures the site it lacks, and only that one.
    out, current = validate.measure_sites(
        slow, "quality_held_out", 0, candidates,
        lambda site, choice: measured.append(site) or 0.25,
        validate.Progress(should_stop=deadline_hook(time.time() + 7200.0)))
    self.assertEqual(measured, [GOOD_SITE])
    self.assertEqual(current, {BAD_SITE: 0.5, GOOD_SITE: 0.25})


if __name__ == "__main__":
  absltest.main()
