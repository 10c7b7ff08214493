"""The training checks' runs: from the checkpoint (data windows, a warm-up after the
switch, jittered parameters) or from a fresh initialization, read through bf16+Mods'
forwards too, and recorded under their recipe."""
import math
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax.dispatch import validate
from loka_jax.plan.file import add_validation
from loka_jax.train import metrics
from loka_jax.train import report as train_report
from validate_helpers import (BAD_SITE, GOOD_SITE, OTHER_SITE, context, plan_of,
                              read_plan_roundtrip, register_test_kernels, unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class ShadowRunTest(chex.TestCase):
  """A training run from the checkpoint: its data window, its jitter, its held-out reading."""

  def test_a_data_window_trains_on_the_batches_after_the_one_before(self):
    from loka_jax.train.loop import loss_fn
    ctx = context()
    model = ctx.build(validate.BASELINE)
    rng = jax.random.PRNGKey(0)
    steps = 3
    first = validate.shadow_run(ctx, validate.BASELINE, steps)
    second = validate.shadow_run(ctx, validate.BASELINE, steps, window=1)
    # Both start from the trained state; window 1 on the batch `steps` after the checkpoint.
    for run, at in ((first, 0), (second, steps)):
      expected = float(loss_fn(model, ctx.state.params, ctx.state.fp8_meta, ctx.batch(at),
                               rng)[0])
      self.assertAlmostEqual(run["losses"][0], expected, delta=1e-3 * expected)
    self.assertNotAlmostEqual(first["losses"][0], second["losses"][0], places=4)
    with self.assertRaisesRegex(ValueError, "window=1: a data window"):
      validate.shadow_run(ctx, validate.BASELINE, steps, start=validate.INIT, window=1)

  def test_a_plan_run_is_also_read_through_bf16_forwards(self):
    ctx = context()
    ctx._cache.clear()   # a resumed call: bf16+Mods' runs are records, its model not built
    steps = 5
    # A broken weight gradient with exact forwards: the trained parameters differ from
    # bf16+Mods', and the plan's forwards read them as bf16+Mods' do.
    backward = validate.shadow_run(
        ctx, plan_of({BAD_SITE: {"grad_rhs": "test_flipped"}}).kernel_plan(), steps)
    base = validate.shadow_run(ctx, validate.BASELINE, steps)
    self.assertNotIn("held_out_bf16_forward", base)
    own, through_bf16 = (backward[k]["logloss"] for k in ("held_out", "held_out_bf16_forward"))
    self.assertAlmostEqual(through_bf16, own, delta=1e-6 * own)
    self.assertNotAlmostEqual(own, base["held_out"]["logloss"], delta=1e-4 * own)
    # FP8 forwards read the same parameters otherwise.
    forward = validate.shadow_run(ctx, plan_of({GOOD_SITE: "xla_fp8_rowwise"}).kernel_plan(),
                                  steps)
    self.assertNotEqual(forward["held_out"]["logloss"],
                        forward["held_out_bf16_forward"]["logloss"])
    summary = validate.run_summary(forward, window=2)
    self.assertEqual(summary["logloss_bf16_forward"],
                     forward["held_out_bf16_forward"]["logloss"])
    # AUC and calibration (mean predicted probability over the positive rate) of its scores.
    held = forward["held_out"]
    self.assertEqual(summary["auc"], held["auc"])
    probs = 1.0 / (1.0 + np.exp(-np.asarray(held["logits"], np.float64)))
    self.assertAlmostEqual(summary["calibration"],
                           probs.mean() / np.mean(held["labels"]), places=9)
    self.assertEqual(metrics.calibration(np.array([0.0, 0.0]), np.array([1.0, 0.0])), 1.0)
    self.assertEqual(metrics.calibration(np.array([-2.0]), np.array([0.0])), math.inf)
    self.assertNotIn("logloss_bf16_forward", validate.run_summary(base, window=2))
    # The check reports the change through bf16+Mods' forwards beside its verdict.
    config = validate.ValidationConfig(shadow_steps=steps, shadow_window=2, shadow_windows=2)
    out = validate.check_shadow(plan_of({GOOD_SITE: "xla_fp8_rowwise"}), ctx, config)
    verdict = [r for r in validate.validation_records(out, "quality_shadow") if "round" in r][0]
    runs = {(r["arm"], r["seed"]): r
            for r in validate.validation_records(out, validate.run_step("quality_shadow"))}
    want = [(runs["plan", s]["logloss_bf16_forward"] - runs["bf16_mods", s]["logloss"])
            / runs["bf16_mods", s]["logloss"] for s in (0, 1)]
    self.assertAlmostEqual(verdict["rel_logloss_change_bf16_forward"], np.mean(want))
    self.assertEqual([p["rel_logloss_change_bf16_forward"] for p in verdict["per_seed"]],
                     want)
    self.assertIn("with bf16+Mods' forwards",
                  train_report.validation_line(verdict, measurements=True))
    run_line = train_report.validation_line(runs["plan", 0], measurements=True)
    self.assertIn("with bf16+Mods' forwards", run_line)
    self.assertIn(f"AUC {runs['plan', 0]['auc']:.4f}, calibration", run_line)

  def test_jittered_parameters_move_by_the_relative_std_asked(self):
    rel = validate.NOISE_FLOOR_JITTER
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    params = {"w": jax.random.normal(keys[0], (300, 200), jnp.float32) + 3.0,
              "b": {"e": jax.random.uniform(keys[1], (40_000,), jnp.float32, 1.0, 2.0)
                         .astype(jnp.bfloat16)}}
    host = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    copy = lambda: jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    out = validate.jittered(copy(), rel, seed=3)
    self.assertEqual(jax.tree.map(lambda x: x.dtype, out),
                     jax.tree.map(lambda x: x.dtype, params))
    factor = np.asarray(out["w"], np.float64) / host["w"] - 1.0
    self.assertAlmostEqual(factor.std(), rel, delta=0.05 * rel)
    self.assertAlmostEqual(factor.mean(), 0.0, delta=0.05 * rel)
    # bf16 leaves move too (a unit roundoff's std is not lost to rounding on average).
    moved = np.asarray(out["b"]["e"], np.float64) != host["b"]["e"]
    self.assertGreater(moved.mean(), 0.3)
    again = validate.jittered(copy(), rel, seed=3)
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(out["w"]))
    other = validate.jittered(copy(), rel, seed=4)
    self.assertFalse(np.array_equal(np.asarray(other["w"]), np.asarray(out["w"])))
    with self.assertRaisesRegex(ValueError, "jitter=0.01: a jitter"):
      validate.shadow_run(context(), validate.BASELINE, 2, start=validate.INIT, jitter=0.01)


class FromInitRunTest(chex.TestCase):
  """A training run from a fresh initialization starts where training from scratch starts."""

  def test_a_run_from_init_starts_where_training_from_scratch_starts(self):
    from loka_jax.train.loop import loss_fn
    from loka_jax.train.optim import make_optimizer
    from loka_jax.train.state import create_train_state
    ctx = context()
    before = jax.tree.map(lambda x: np.array(x, copy=True), ctx.state)
    run = validate.shadow_run(ctx, validate.BASELINE, steps=3, start=validate.INIT, seed=5)
    self.assertTrue(run["finite"])
    # The first step's loss is a freshly initialized model's (seed 5) on the data's first
    # batch, computed here without validation's code; the trained state's is far from it.
    model = ctx.build(validate.BASELINE)
    fresh = create_train_state(model, make_optimizer(ctx.optim), ctx.source.train_batch(0, 1),
                               5)
    first = ctx.source.train_batch(0, ctx.batch_size)
    rng = jax.random.PRNGKey(0)
    expected = float(loss_fn(model, fresh.params, fresh.fp8_meta, first, rng)[0])
    trained = float(loss_fn(model, ctx.state.params, ctx.state.fp8_meta, first, rng)[0])
    self.assertAlmostEqual(run["losses"][0], expected, delta=1e-3 * abs(expected))
    self.assertGreater(abs(trained - expected), 0.01)
    other_seed = validate.shadow_run(ctx, validate.BASELINE, steps=3, start=validate.INIT,
                                     seed=6)
    self.assertNotAlmostEqual(other_seed["losses"][0], run["losses"][0], places=4)
    # The shadow run from the checkpoint starts from the trained state instead, and neither
    # changed the context's state.
    shadow = validate.shadow_run(ctx, validate.BASELINE, steps=1)
    trained_first = float(loss_fn(model, ctx.state.params, ctx.state.fp8_meta, ctx.batch(0),
                                  rng)[0])
    self.assertAlmostEqual(shadow["losses"][0], trained_first, delta=1e-3 * trained_first)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, ctx.state), before)
    with self.assertRaisesRegex(ValueError, "start='scratch'"):
      validate.shadow_run(ctx, validate.BASELINE, steps=1, start="scratch")

  def test_delayed_scaling_from_init_starts_from_its_initial_state(self):
    # From scratch, delayed scaling's state starts at scale 1, not calibrated on the trained
    # parameters as the checks from the checkpoint have it: the first loss tells them apart.
    from loka_jax.train.loop import loss_fn
    from loka_jax.train.optim import make_optimizer
    from loka_jax.train.state import create_train_state
    ctx = context()
    kplan = plan_of({GOOD_SITE: "flax_fp8_delayed", OTHER_SITE: "flax_fp8_delayed"}
                    ).kernel_plan()
    model, calibrated = validate.model_and_meta(ctx, kplan)
    fresh = create_train_state(model, make_optimizer(ctx.optim), ctx.source.train_batch(0, 1),
                               0)
    first = ctx.source.train_batch(0, ctx.batch_size)
    rng = jax.random.PRNGKey(0)
    expected = float(loss_fn(model, fresh.params, fresh.fp8_meta, first, rng)[0])
    other = float(loss_fn(model, fresh.params, calibrated, first, rng)[0])
    self.assertGreater(abs(expected - other), 1e-3)
    run = validate.shadow_run(ctx, kplan, steps=2, start=validate.INIT, seed=0)
    self.assertAlmostEqual(run["losses"][0], expected, delta=3e-4)

  def test_a_plan_whose_model_initializes_other_parameters_is_refused(self):
    ctx = context()
    validate.initial_state(ctx, validate.BASELINE, seed=0)   # records bf16+Mods' sums
    key = ("init_param_sums", 0)
    kept = ctx._cache[key]
    try:
      ctx._cache[key] = jax.tree.map(lambda x: x + 1.0, kept)
      with self.assertRaisesRegex(ValueError, "initializes other parameters"):
        validate.initial_state(ctx, plan_of({GOOD_SITE: "xla_fp8_rowwise"}).kernel_plan(), 0)
    finally:
      ctx._cache[key] = kept


class RunRecordTest(chex.TestCase):
  """A check's runs are recorded as they finish and read back under their own recipe."""

  def test_a_run_record_is_reused_only_under_its_own_recipe(self):
    ctx = context()
    plan = plan_of({GOOD_SITE: "xla_fp8_rowwise"})
    recipe = {"steps": 4, "start": validate.INIT, "window": 2, "warmup_steps": 0}
    calls = []
    real = validate.shadow_run

    def counting(*args, **kwargs):
      calls.append(args[1])
      return real(*args, **kwargs)
    with mock.patch.object(validate.runs, "shadow_run", counting):
      once, (summary,) = validate.runs._training_runs(
          plan, ctx, validate.Progress(), "quality_from_init", validate.BASELINE_ARM,
          validate.BASELINE, [0], recipe, None, None)
      _, (again,) = validate.runs._training_runs(
          read_plan_roundtrip(once), ctx, validate.Progress(), "quality_from_init",
          validate.BASELINE_ARM, validate.BASELINE, [0], recipe, None, None)
      self.assertLen(calls, 1)
      self.assertEqual(again, summary)
      for other in ({**recipe, "warmup_steps": 5}, {**recipe, "steps": 5}):
        validate.runs._training_runs(once, ctx, validate.Progress(), "quality_from_init",
                                validate.BASELINE_ARM, validate.BASELINE, [0], other, None,
                                None)
      validate.runs._training_runs(once, ctx, validate.Progress(), "quality_shadow",
                              validate.BASELINE_ARM, validate.BASELINE, [0], recipe, None, None)
    self.assertLen(calls, 4)
    # The summary is the run's own: its window's mean loss and its held-out log loss.
    run = real(ctx, validate.BASELINE, 4, None, validate.INIT, 0, None)
    self.assertAlmostEqual(summary["window_loss"], float(np.mean(run["losses"][-2:])))
    self.assertAlmostEqual(summary["logloss"], run["held_out"]["logloss"])
    # Its curve: the mean of each block of steps, a block with a non-finite step None.
    self.assertEqual(validate.loss_curve([1.0, 2.0, 3.0, 4.0, 5.0], every=2), [1.5, 3.5, 5.0])
    self.assertEqual(validate.loss_curve([0.5, np.inf, 0.25], every=2), [None, 0.25])
    self.assertLen(summary["loss_curve"], 1)   # four steps: one block
    self.assertAlmostEqual(summary["loss_curve"][0], float(np.mean(run["losses"])), delta=2e-6)
    with self.assertRaisesRegex(ValueError, "at least one step"):
      validate.loss_curve([1.0], every=0)
    # A non-finite run is stored without NaN and reads back as not finite.
    bad = validate.run_summary({"losses": np.array([0.7, np.nan]), "finite": False,
                                "held_out": None}, 2)
    stored = read_plan_roundtrip(add_validation(plan, {"step": "x_run", **bad}))
    self.assertEqual(stored["validation"][-1]["finite"], False)
    self.assertIsNone(stored["validation"][-1]["window_loss"])
    self.assertEqual(stored["validation"][-1]["loss_curve"], [None])


if __name__ == "__main__":
  absltest.main()
