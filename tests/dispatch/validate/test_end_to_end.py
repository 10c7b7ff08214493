"""Validation end to end and through the pipeline: a call paused by its caller saves its
plan and the next resumes it; checks the config rules out are recorded at once; a report
carried to another machine still validates; a plan that does not fit the model fails
before training."""
import dataclasses
import functools
import json
import os
import shutil
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest

import report_builders as hm
from loka_jax.dispatch import pipeline, validate
from loka_jax.plan.file import FALLBACK, SCHEMA, read_plan
from loka_jax.train import experiment
from validate_helpers import (BAD_SITE, BATCH, GOOD_SITE, context, kernels, plan_of,
                              register_test_kernels, small_pipeline, unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class EndToEndTest(chex.TestCase):
  """A validation paused by its caller saves its plan and resumes where it stopped."""

  def test_paused_after_a_back_off_then_resumed(self):
    ctx = context()
    selected = plan_of({BAD_SITE: "test_two_bit", GOOD_SITE: "xla_fp8_rowwise"})
    config = validate.ValidationConfig(max_rel_logloss=0.002, shadow_steps=0)
    saved = []
    progress = validate.Progress()

    def save(plan):
      saved.append(plan)
      if validate.validation_records(plan, "quality_held_out"):  # a round has run: stop now
        progress.should_stop = lambda ahead_s: True
    progress.save = save
    with self.assertRaises(validate.ValidationPaused):
      validate.validate_end_to_end(selected, ctx, config, progress=progress)
    partial = saved[-1]
    self.assertEqual(kernels(partial, BAD_SITE), {p: FALLBACK for p in hm.PASSES})
    self.assertFalse(validate.finished(partial, "quality_held_out"))

    out = validate.validate_end_to_end(selected, ctx, config, resume_from=partial)
    held = [r for r in validate.validation_records(out, "quality_held_out") if "round" in r]
    self.assertEqual([r["round"] for r in held], [0, 1])   # round 0 not repeated
    self.assertTrue(held[-1]["passed"])
    for step in ("quality_held_out", "quality_shadow", "speed"):
      self.assertTrue(validate.finished(out, step), step)
    (done,) = validate.validation_records(out, "validated")
    self.assertEqual(done["backed_off"], [BAD_SITE])
    self.assertEqual(done["fp8_sites_before"], 2)
    # A finished validation resumed again only adds its summary.
    again = validate.validate_end_to_end(selected, ctx, config, resume_from=out)
    self.assertLen(validate.validation_records(again, "quality_held_out"),
                   len(validate.validation_records(out, "quality_held_out")))

  def test_checks_the_config_rules_out_are_recorded_past_the_deadline_not_paused_before(self):
    # A call that ends in the shadow check must not leave a next call (minutes of start-up at
    # a large preset) only to record that the check from initialization and the speed check
    # are off: what the config rules out costs no time, so it is recorded at once.
    ctx = context()
    selected = plan_of({GOOD_SITE: "xla_fp8_rowwise"})
    config = validate.ValidationConfig(max_rel_logloss=0.01, shadow_max_rel_loss=0.05,
                                       shadow_steps=4, from_init_steps=0, speed=False,
                                       promote=False)
    progress = validate.Progress()

    def save(plan):
      if validate.finished(plan, "quality_shadow"):
        progress.should_stop = lambda ahead_s: True   # time is up as the shadow check ends
    progress.save = save
    out = validate.validate_end_to_end(selected, ctx, config, progress=progress)
    for step, reason in (("quality_from_init", "from_init_steps=0"),
                         ("speed", "switched off (speed=False)")):
      (record,) = validate.validation_records(out, step)
      self.assertTrue(record["skipped"] and record["final"], step)
      self.assertEqual(record["reason"], reason)
    self.assertEqual(kernels(out, GOOD_SITE)["fwd"], "xla_fp8_rowwise")  # the checks ran on it
    self.assertTrue(validate.validation_records(out, "validated"))
    # A check with something to run still pauses there.
    progress.should_stop = None
    with self.assertRaisesRegex(validate.ValidationPaused, "before the quality_from_init check"):
      validate.validate_end_to_end(selected, ctx, dataclasses.replace(config, from_init_steps=2),
                                   progress=progress)

  def test_a_plan_without_fp8_sites_skips_every_check(self):
    out = validate.validate_end_to_end(plan_of({}), context(),
                                       validate.ValidationConfig(speed=True))
    for step in ("quality_held_out", "quality_shadow", "quality_from_init", "speed"):
      (record,) = validate.validation_records(out, step)
      self.assertTrue(record["skipped"] and record["final"], step)
      self.assertIn("no FP8 site", record["reason"])
    (done,) = validate.validation_records(out, "validated")
    self.assertEqual(done["passed"], {"quality_held_out": None, "quality_shadow": None,
                                      "quality_from_init": None, "speed": None})


class PipelineTest(chex.TestCase):
  """Probe -> select -> validate in one resumable call."""

  def test_the_pipeline_pauses_at_its_deadline_and_the_next_call_finishes(self):
    workdir = tempfile.mkdtemp(prefix="loka_pipeline_pause_")
    spec, kwargs = small_pipeline()
    with self.assertRaises(validate.ValidationPaused):
      pipeline.probe_and_plan(spec, workdir, should_stop=lambda ahead_s: True, **kwargs)
    self.assertTrue(os.path.exists(os.path.join(workdir, pipeline.VALIDATING_JSON)))
    self.assertFalse(os.path.exists(os.path.join(workdir, pipeline.PLAN_JSON)))
    result = pipeline.probe_and_plan(spec, workdir, **kwargs)
    self.assertTrue(result.skipped["probe"] and result.skipped["select"])
    self.assertFalse(os.path.exists(os.path.join(workdir, pipeline.VALIDATING_JSON)))
    self.assertTrue(validate.validation_records(result.plan, "validated"))
    self.assertTrue(validate.finished(result.plan, "quality_held_out"))

  def test_a_budget_change_is_selected_under_and_a_plan_of_another_budget_is_not_reused(self):
    # `criteria_changes` edits the budget the pipeline selects under and records it in the
    # selected plan; a later call under the plain budget selects again instead of reusing it.
    workdir = tempfile.mkdtemp(prefix="loka_pipeline_budget_")
    spec, kwargs = small_pipeline()
    selected = os.path.join(workdir, pipeline.SELECTED_JSON)
    budgets = []
    for changes in ({"min_sqnr_wgrad_db": -7.5}, None):
      with self.assertRaises(validate.ValidationPaused):  # probe + selection only
        pipeline.probe_and_plan(spec, workdir, should_stop=lambda ahead_s: True,
                                criteria_changes=changes, **kwargs)
      budgets.append(read_plan(selected)["provenance"]["budget"]["default"])
    self.assertEqual([b["min_sqnr_wgrad_db"] for b in budgets], [-7.5, None])
    self.assertEqual(budgets[0]["min_sqnr_grad_db"], budgets[1]["min_sqnr_grad_db"])
    with self.assertRaisesRegex(ValueError, r"unknown budget field\(s\) \['min_sqnr_wgrad'\]"):
      pipeline.probe_and_plan(spec, workdir, should_stop=lambda ahead_s: True,
                              criteria_changes={"min_sqnr_wgrad": 0.0}, **kwargs)


class CarriedReportTest(chex.TestCase):
  """A report and plan carried to a machine without the probe's checkpoint still validate:
  the probe's training run is made again, to the same state."""

  def test_validation_retrains_the_probe_state_where_its_checkpoint_is_absent(self):
    from loka_jax.train.loop import restore_run
    workdir = tempfile.mkdtemp(prefix="loka_pipeline_carried_")
    spec, kwargs = small_pipeline()
    with self.assertRaises(validate.ValidationPaused):  # probe + selection only
      pipeline.probe_and_plan(spec, workdir, should_stop=lambda ahead_s: True, **kwargs)
    probe_dir = os.path.join(workdir, pipeline.PROBE_DIR)
    model, source, _ = experiment.build_run(spec)
    probed, _ = restore_run(probe_dir, model, source, kwargs["train_config"],
                            array_extras=False)
    probed_params = jax.tree.map(np.asarray, probed.params)
    shutil.rmtree(probe_dir)  # what a machine that was handed only the small files has

    result = pipeline.probe_and_plan(spec, workdir, **kwargs)
    self.assertTrue(result.skipped["probe"] and result.skipped["select"])
    self.assertTrue(validate.validation_records(result.plan, "validated"))
    rebuilt, _ = restore_run(os.path.join(workdir, pipeline.STATE_DIR), model, source,
                             kwargs["train_config"], array_extras=False)
    self.assertEqual(int(rebuilt.step), kwargs["train_config"].steps)
    # The statistics pass does not touch training: on the CPU the same values come back.
    chex.assert_trees_all_close(jax.tree.map(np.asarray, rebuilt.params), probed_params,
                                atol=1e-6, rtol=1e-6)

  def test_a_report_of_another_run_is_refused_by_name(self):
    spec, kwargs = small_pipeline()
    model, source, _ = experiment.build_run(spec)
    report = {"run": {**spec.run_info(), "steps": 9, "batch_size": BATCH, "seed": 3}}
    with self.assertRaises(ValueError) as caught:
      pipeline.retrain_probe_state(spec, model, source, kwargs["train_config"], report,
                                   tempfile.mkdtemp(prefix="loka_pipeline_refused_"))
    self.assertIn("steps: the probe ran 9, this run asks for 6", str(caught.exception))
    self.assertIn("seed: the probe ran 3, this run asks for 0", str(caught.exception))


class ChecksToRunTest(absltest.TestCase):

  def test_the_pipeline_names_the_checks_its_config_runs(self):
    from loka_jax.dispatch import pipeline
    # The timed checks switched off (as on a CPU), then forced on; no steps skip a training
    # check.
    config = functools.partial(validate.ValidationConfig, speed=False, promote=False)
    self.assertEqual(pipeline.checks_to_run(config()), ["held-out", "shadow training"])
    self.assertEqual(pipeline.checks_to_run(config(shadow_steps=0, from_init_steps=5)),
                     ["held-out", "training from initialization"])
    self.assertEqual(pipeline.checks_to_run(config(from_init_steps=5, speed=True,
                                                   promote=True)),
                     ["speed promotion", "held-out", "shadow training",
                      "training from initialization", "speed"])


class BuildRunChecksPlanTest(chex.TestCase):

  def test_a_plan_that_does_not_fit_fails_before_training_naming_every_offender(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_"), "plan.json")
    bad = {"schema": SCHEMA, "model": "wukong",
           "sites": {"no/such_site": {p: "xla_fp8_rowwise" for p in hm.PASSES},
                     "head/dense_0": {p: "xla_fp8_rowwise" for p in hm.PASSES}},
           "rules": [{"pattern": "nothing/.*", "passes": {p: FALLBACK for p in hm.PASSES}}]}
    with open(path, "w") as f:
      json.dump(bad, f)
    spec = experiment.RunSpec(model="wukong", preset="tiny", precision="loka", plan=path)
    with self.assertRaises(experiment.PlanError) as raised:
      experiment.build_run(spec)
    message = str(raised.exception)
    for name in ("no/such_site", "nothing/.*", "uncovered", "layer_0/lcb"):
      self.assertIn(name, message)

  def test_a_fitting_plan_builds(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_"), "plan.json")
    with open(path, "w") as f:
      json.dump(plan_of({GOOD_SITE: "xla_fp8_rowwise"}).to_dict(), f)
    spec = experiment.RunSpec(model="wukong", preset="tiny", precision="loka", plan=path,
                              mods=("all",))
    model, source, _ = experiment.build_run(spec)
    batch = source.train_batch(0, 8)
    variables = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
                           batch)
    logits = model.apply(variables, batch)
    chex.assert_shape(logits, (8,))
    self.assertTrue(np.all(np.isfinite(np.asarray(logits))))


if __name__ == "__main__":
  absltest.main()
