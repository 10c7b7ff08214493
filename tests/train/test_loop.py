"""Optimizers, the training loop, non-finite handling and FP8 delayed-scaling training.

Uses the toy click model of train_toys.py (built from DenseSites, tables under `embeddings`);
equal models and settings share one compilation per process.
"""
import json
import os
import tempfile
import time
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax.models import SiteConfig
from loka_jax.train import (NonFiniteError, OptimConfig, TrainConfig, loop, make_optimizer,
                            read_metrics, restore_run, scale_by_rowwise_adagrad, train)
from loka_jax.train.optim import RowwiseAdagradState, restart_schedules

import train_toys


def fresh_params(seed):
  rng = np.random.default_rng(seed)
  return {"embeddings": {"table": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)},
          "mlp": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}}


class InitialStateTest(chex.TestCase):

  def test_init_from_one_example_equals_init_from_the_whole_batch(self):
    # create_train_state initializes from one example (one init program per model): the
    # parameters and delayed-scaling state must be those an init on the whole batch draws.
    from loka_jax.train import experiment
    from loka_jax.train.state import create_train_state, split_variables
    spec = experiment.RunSpec(model="dlrm", preset="tiny", precision="fp8_all",
                              kernel="flax_fp8_delayed", mods=("all",), num_eval=256)
    model, source, _ = experiment.build_run(spec)
    batch = source.train_batch(0, 64)
    state = create_train_state(model, make_optimizer(OptimConfig()), batch, seed=3)
    init_key = jax.random.split(jax.random.PRNGKey(3))[0]
    params_key, dropout_key = jax.random.split(init_key)
    whole = jax.jit(lambda b: model.init({"params": params_key, "dropout": dropout_key}, b,
                                         train=False))(batch)
    params, meta = split_variables(whole)
    self.assertNotEmpty(jax.tree.leaves(meta))
    chex.assert_trees_all_equal(state.params, params)
    chex.assert_trees_all_equal(state.fp8_meta,
                                jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), meta))


class SharedParameterInitTest(chex.TestCase):
  """Every arm of a Mods set draws its parameters with one program, its xla_bf16 twin's
  (`state.baseline_twin`): the state must be the one the arm's own init makes."""

  def test_each_plan_starts_from_the_state_its_own_init_draws(self):
    from loka_jax.kernels import KernelChoice, KernelPlan
    from loka_jax.models.presets import build_model
    from loka_jax.train import experiment, state as state_lib
    tx = make_optimizer(OptimConfig())
    # Every site on one kernel; Pallas's op (act x weight sites only) on the dense sites.
    plans = {k: KernelPlan.uniform(k) for k in ("xla_fp8_tensorwise", "flax_fp8_delayed_fwd")}
    plans["pallas_fp8_delayed"] = KernelPlan(
        rules=((r".*dense_\d+", KernelChoice.uniform("pallas_fp8_delayed")),))
    # Each model once, the two FP8-meta kernels taking turns (each init compiles a model
    # twice, so a model per kernel would double the test for no other program path). DHEN
    # and InterFormer with one layer of their stack: a second layer is the same module under
    # another name, and doubles their compiles (the test 19 s -> 14 s on 2 cores).
    cases = [(m, ("all",), (k,)) for m, k in zip(
        ("dlrm", "dcnv2", "wukong", "dhen", "interformer"),
        ("flax_fp8_delayed_fwd", "pallas_fp8_delayed") * 3)]
    cases.append(("dlrm", (), ("xla_fp8_tensorwise", "flax_fp8_delayed_fwd")))
    init_key = jax.random.split(jax.random.PRNGKey(5))[0]
    params_key, dropout_key = jax.random.split(init_key)
    for model_name, mods, kernel_names in cases:
      spec = experiment.RunSpec(model=model_name, preset="tiny", mods=mods, num_eval=64)
      _, source, config = experiment.build_run(spec)
      if model_name in ("dhen", "interformer"):
        config.num_layers = 1
      batch = source.train_batch(0, 8)
      for kernel in kernel_names:
        model = build_model(config, source.features, SiteConfig(plan=plans[kernel]))
        self.assertIsNotNone(state_lib.baseline_twin(model))
        shared = state_lib.create_train_state(model, tx, batch, seed=5)
        own = jax.jit(lambda b: model.init({"params": params_key, "dropout": dropout_key}, b,
                                           train=False))(state_lib.one_example(batch))
        params, meta = state_lib.split_variables(own)
        where = f"{model_name} mods={mods} {kernel}"
        chex.assert_trees_all_equal(shared.params, params, custom_message=where)
        chex.assert_trees_all_equal(
            shared.fp8_meta, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), meta),
            custom_message=where)
        self.assertEqual(bool(jax.tree.leaves(meta)), kernel != "xla_fp8_tensorwise", where)
    # A model on the baseline plan is its own twin; a model without tower options has none.
    spec = experiment.RunSpec(model="dlrm", preset="tiny", precision="bf16", num_eval=64)
    self.assertIsNone(state_lib.baseline_twin(experiment.build_run(spec)[0]))
    self.assertIsNone(state_lib.baseline_twin(train_toys.ToyClickModel()))


class OptimizerTest(chex.TestCase):

  def test_rowwise_adagrad_two_steps_by_hand(self):
    rng = np.random.default_rng(0)
    g1, g2 = rng.normal(size=(2, 5, 3))
    tx = scale_by_rowwise_adagrad(initial_accumulator_value=0.0, eps=1e-8)
    state = tx.init({"t": jnp.zeros((5, 3))})
    chex.assert_shape(state.sum_of_squares["t"], (5,))
    u1, state = tx.update({"t": jnp.asarray(g1, jnp.float32)}, state)
    u2, state = tx.update({"t": jnp.asarray(g2, jnp.float32)}, state)
    acc1 = (g1 ** 2).mean(axis=1)
    acc2 = acc1 + (g2 ** 2).mean(axis=1)
    np.testing.assert_allclose(u1["t"], g1 / (np.sqrt(acc1)[:, None] + 1e-8), rtol=1e-5)
    np.testing.assert_allclose(u2["t"], g2 / (np.sqrt(acc2)[:, None] + 1e-8), rtol=1e-5)

  def test_rowwise_adagrad_leaves_untouched_rows(self):
    tx = scale_by_rowwise_adagrad()
    g = np.zeros((4, 3), np.float32)
    g[1] = np.random.default_rng(1).normal(size=3)
    updates, state = tx.update({"t": jnp.asarray(g)}, tx.init({"t": jnp.zeros((4, 3))}))
    np.testing.assert_array_equal(np.asarray(updates["t"])[[0, 2, 3]], 0.0)
    np.testing.assert_array_equal(np.asarray(state.sum_of_squares["t"])[[0, 2, 3]], 0.0)

  def test_embeddings_get_rowwise_adagrad_and_the_rest_adam(self):
    params = fresh_params(2)
    grads = jax.tree.map(lambda p: p * 0.3 + 0.1, fresh_params(3))
    tx = make_optimizer(OptimConfig(learning_rate=0.01, embedding_learning_rate=0.5))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    g_mlp = np.asarray(grads["mlp"]["kernel"])
    g_emb = np.asarray(grads["embeddings"]["table"])
    # Adam's first bias-corrected step is lr * g / (|g| + eps).
    np.testing.assert_allclose(updates["mlp"]["kernel"], -0.01 * g_mlp / (np.abs(g_mlp) + 1e-8),
                               rtol=1e-5)
    np.testing.assert_allclose(updates["embeddings"]["table"],
                               -0.5 * g_emb / np.sqrt((g_emb ** 2).mean(axis=1, keepdims=True)),
                               rtol=1e-5)
    rowwise = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, RowwiseAdagradState)) if isinstance(s, RowwiseAdagradState)]
    self.assertLen(rowwise, 1)
    chex.assert_shape(rowwise[0].sum_of_squares["embeddings"]["table"], (6,))

  def test_warmup_starts_at_zero(self):
    params = fresh_params(4)
    tx = make_optimizer(OptimConfig(warmup_steps=10))
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    for u in jax.tree.leaves(updates):
      np.testing.assert_array_equal(u, 0.0)

  def test_restarted_schedules_warm_up_again_and_keep_what_the_moments_learned(self):
    # Five updates past a 4-step warm-up, then the same state with its schedules restarted:
    # its next update is zero (the warm-up's rate 0), and the one after it exactly a quarter
    # of the unrestarted state's, whose moments and Adam count it shares (the rate 1/4 of
    # the warm-up against the full one).
    params = fresh_params(4)
    tx = make_optimizer(OptimConfig(learning_rate=0.01, embedding_learning_rate=0.5,
                                    warmup_steps=4))
    grads = [jax.tree.map(lambda p, k=k: p * 0.3 + 0.1 * (k + 1), fresh_params(k + 5))
             for k in range(7)]
    state = tx.init(params)
    for g in grads[:5]:
      _, state = tx.update(g, state, params)
    restarted = restart_schedules(state)
    on, on_state = tx.update(grads[5], state, params)
    zero, restarted = tx.update(grads[5], restarted, params)
    for u in jax.tree.leaves(zero):
      np.testing.assert_array_equal(u, 0.0)
    self.assertTrue(all(np.abs(np.asarray(u)).max() > 0 for u in jax.tree.leaves(on)))
    full, _ = tx.update(grads[6], on_state, params)
    quarter, _ = tx.update(grads[6], restarted, params)
    for q, f in zip(jax.tree.leaves(quarter), jax.tree.leaves(full)):
      np.testing.assert_allclose(q, np.asarray(f) / 4, rtol=1e-5, atol=1e-12)
    with self.assertRaisesRegex(ValueError, "no learning-rate schedule"):
      restart_schedules({"count": jnp.zeros(())})

  def test_unknown_setting_is_named(self):
    with self.assertRaisesRegex(ValueError, "learning_rat"):
      OptimConfig.from_dict({"learning_rat": 0.1})


class TrainLoopTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = tempfile.mkdtemp(prefix="loka_train_")

  def test_toy_model_learns(self):
    source = train_toys.ToySource(seed=0)
    config = TrainConfig(steps=300, batch_size=128, eval_every=150, log_every=50, progress=False,
                         optim=OptimConfig(learning_rate=3e-3, embedding_learning_rate=0.1))
    final = train(train_toys.ToyClickModel(), source, self.workdir, config,
                  run_info={"precision": "fp32", "seed": 0})
    self.assertLess(final["ne"], 0.75)       # predicting the base rate gives 1.0
    self.assertGreater(final["auc"], 0.85)
    self.assertGreater(final["ne"], source.oracle_ne - 0.05)  # no better than the teacher
    self.assertEqual((final["steps"], final["precision"], final["seed"]), (300, "fp32", 0))
    self.assertAlmostEqual(final["oracle_ne"], source.oracle_ne)
    lines = read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    self.assertEqual([r["step"] for r in lines], [50, 100, 150, 200, 250, 300])
    self.assertEqual([r["step"] for r in lines if "ne" in r], [150, 300])
    self.assertLess(lines[-1]["loss"], lines[0]["loss"])

  def test_evaluation_scores_every_example_once_in_order(self):
    # A step whose scores are known (the sum of the dense features) over three eval batches,
    # the last one short and padded: each batch's scores must meet its own labels, in order,
    # although a batch's scores are read only after the next batch is dispatched.
    class ShortLastBatch(train_toys.ToySource):
      def eval_batches(self, batch_size):
        for start in range(0, self.num_eval_examples(), batch_size):
          yield {k: v[start:start + batch_size] for k, v in self._eval.items()}

    source = ShortLastBatch(seed=3, num_eval=300)
    step = jax.jit(lambda state, batch: jnp.sum(batch["dense"], axis=1))
    result = loop.evaluate(step, None, source, 128, keep_scores=True)
    every = {k: np.concatenate([b[k] for b in source.eval_batches(300)]) for k in
             ("dense", "label")}
    want = every["dense"].astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(result["logits"], want, rtol=1e-5)
    np.testing.assert_array_equal(result["labels"], every["label"])
    p = 1 / (1 + np.exp(-want))
    y = every["label"]
    self.assertAlmostEqual(result["logloss"],
                           float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))), places=5)
    self.assertEqual(result["num_examples"], 300)

  def test_time_split_counts_each_evaluation_and_checkpoint(self):
    # Evaluation and saving made slow by known amounts: the split must find them where they
    # are, three evaluations (steps 4, 8 and the end, 10) and at least two saves (5 and 10),
    # and the first step apart from the rest.
    from loka_jax.train import checkpoint
    config = TrainConfig(steps=10, batch_size=64, eval_every=4, checkpoint_every=5,
                         log_every=5, progress=False)
    real_evaluate, real_save = loop.evaluate, checkpoint.Checkpointer.save

    def slow_evaluate(*args, **kwargs):
      time.sleep(0.3)
      return real_evaluate(*args, **kwargs)

    def slow_save(self, *args, **kwargs):
      time.sleep(0.2)
      return real_save(self, *args, **kwargs)

    with mock.patch.object(loop, "evaluate", slow_evaluate), \
         mock.patch.object(checkpoint.Checkpointer, "save", slow_save):
      final = train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config)
    split = final["time_split"]
    self.assertEqual(sorted(split), sorted(loop.TIME_SPLIT_FIELDS))
    self.assertBetween(split["eval_s"], 0.9, 0.9 + 0.5 * final["time"])
    self.assertBetween(split["checkpoint_s"], 0.4, 0.4 + 0.5 * final["time"])
    self.assertGreater(split["first_step_s"], 0.0)
    self.assertGreater(split["setup_s"], 0.0)
    # The evaluations, saves and first step all happen inside the loop's own time.
    self.assertLess(split["eval_s"] + split["checkpoint_s"] + split["first_step_s"],
                    final["time"])

  def test_worst_step_is_reported_across_a_resume(self):
    # A learning rate high enough that the loss jumps after the first steps, so the worst step
    # is neither the first nor the last; the run stops after step 7 (checkpointed at 6) and is
    # resumed, so a worst step that lives only in memory would be lost.
    config = TrainConfig(steps=12, batch_size=64, log_every=3, checkpoint_every=3,
                         progress=False, optim=OptimConfig(learning_rate=0.3))
    losses = {}

    class Stop(Exception):
      pass

    def record(step, state, metrics, stop_at=None):
      losses[step] = float(metrics["loss"])
      if step == stop_at:
        raise Stop()

    with self.assertRaises(Stop):
      train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config,
            step_callback=lambda *a: record(*a, stop_at=7))
    final = train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config,
                  step_callback=record)
    self.assertEqual(sorted(losses), list(range(1, 13)))
    worst = max(losses, key=losses.get)
    self.assertNotIn(worst, (1, 12))
    self.assertEqual((final["peak_step"], final["peak_loss"]), (worst, losses[worst]))
    lines = read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    self.assertEqual([r["step"] for r in lines], [3, 6, 9, 12])
    for r in lines:
      self.assertEqual(r["max_loss"], max(losses[s] for s in range(r["step"] - 2, r["step"] + 1)))

  def test_a_run_resumed_from_a_checkpoint_without_its_worst_step_reports_none(self):
    # A checkpoint written before the loop kept its worst step: the steps before it are not
    # in the resumed run, whose own worst would pass for the whole run's.
    config = TrainConfig(steps=8, batch_size=64, log_every=4, checkpoint_every=4,
                         progress=False)

    class Stop(Exception):
      pass

    def stop(step, state, metrics):
      if step == 5:
        raise Stop()

    with self.assertRaises(Stop):
      train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config,
            step_callback=stop)
    layout_path = os.path.join(self.workdir, "checkpoints", "4", "layout.json")
    with open(layout_path) as f:
      layout = json.load(f)
    self.assertIn("peak_loss", layout["extras_json"]["loop"])
    for key in ("peak_loss", "peak_step"):
      del layout["extras_json"]["loop"][key]
    layout.pop("sha256")   # such a checkpoint's layout carried no digest either
    with open(layout_path, "w") as f:
      json.dump(layout, f)
    final = train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config)
    self.assertEqual(final["steps"], 8)
    self.assertNotIn("peak_loss", final)

  def test_bad_learning_rate_stops_naming_step_and_site(self):
    config = TrainConfig(steps=20, batch_size=64, log_every=5, progress=False,
                         optim=OptimConfig(learning_rate=1e30))
    with self.assertRaises(NonFiniteError) as caught:
      train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config)
    err = caught.exception
    # Step 1 moves every weight by ~1e30; step 2's output layer overflows.
    self.assertEqual(err.step, 2)
    self.assertIn("training step 2", str(err))
    self.assertIn("'out'", err.site)
    self.assertIn(err.checkpoint, str(err))
    self.assertFalse(os.path.exists(os.path.join(self.workdir, "final.json")))
    last = read_metrics(os.path.join(self.workdir, "metrics.jsonl"))[-1]
    self.assertEqual(last["step"], 2)
    self.assertIn("non-finite", last["error"])

  def test_nan_in_data_stops_and_keeps_the_last_good_checkpoint(self):
    source = train_toys.ToySource(nan_at_step=7)
    config = TrainConfig(steps=20, batch_size=64, log_every=5, checkpoint_every=5,
                         progress=False)
    with self.assertRaises(NonFiniteError) as caught:
      train(train_toys.ToyClickModel(), source, self.workdir, config)
    self.assertEqual(caught.exception.step, 8)
    self.assertIn("batch index 7", str(caught.exception))
    self.assertIn("'dense'", caught.exception.site)
    self.assertEqual(sorted(os.listdir(os.path.join(self.workdir, "checkpoints"))), ["5", "7"])
    state, _ = restore_run(self.workdir, train_toys.ToyClickModel(), source, config)
    self.assertEqual(int(state.step), 7)
    for leaf in jax.tree.leaves(state.params):
      self.assertTrue(np.isfinite(leaf).all())

  def test_skip_policy_skips_the_bad_step_and_finishes(self):
    source = train_toys.ToySource(nan_at_step=7)
    config = TrainConfig(steps=12, batch_size=64, log_every=4, progress=False, nan_policy="skip")
    final = train(train_toys.ToyClickModel(), source, self.workdir, config)
    self.assertEqual(final["skipped_steps"], 1)
    self.assertEqual(final["steps"], 12)
    self.assertTrue(np.isfinite(final["ne"]))
    lines = read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    skipped = [r for r in lines if r.get("skipped")]
    self.assertEqual([r["step"] for r in skipped], [8])
    self.assertIn("'dense'", skipped[0]["error"])

  def test_a_run_that_keeps_no_checkpoint_writes_none_and_is_finished_by_its_final_json(self):
    # keep_checkpoints=0 (a large quality run, thrown away once scored): no save at all, the
    # same training as a run that saves, and a rerun returns the recorded result untrained.
    config = TrainConfig(steps=6, batch_size=64, log_every=3, keep_checkpoints=0,
                         progress=False)
    saving = os.path.join(self.workdir, "saving")
    final = train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config)
    twin = train(train_toys.ToyClickModel(), train_toys.ToySource(), saving,
                 TrainConfig(steps=6, batch_size=64, log_every=3, progress=False))
    self.assertFalse(os.path.exists(os.path.join(self.workdir, "checkpoints", "6")))
    self.assertTrue(os.path.exists(os.path.join(saving, "checkpoints", "6")))
    self.assertEqual(final["time_split"]["checkpoint_s"], 0.0)
    for key in ("logloss", "ne", "auc", "peak_loss", "steps"):
      self.assertEqual(final[key], twin[key], key)
    steps_run = []
    again = train(train_toys.ToyClickModel(), train_toys.ToySource(), self.workdir, config,
                  step_callback=lambda step, *a: steps_run.append(step))
    self.assertEqual((steps_run, again), ([], final))
    with self.assertRaisesRegex(ValueError, "keep_checkpoints=0"):
      TrainConfig(checkpoint_every=2, keep_checkpoints=0)
    with self.assertRaisesRegex(ValueError, "keep_checkpoints must be >= 0"):
      TrainConfig(keep_checkpoints=-1)

  def test_nan_policy_is_checked(self):
    with self.assertRaisesRegex(ValueError, "nan_policy"):
      TrainConfig(nan_policy="ignore")

  def test_flax_fp8_delayed_trains(self):
    self._delayed_scaling_trains("flax_fp8_delayed")

  def test_flax_fp8_delayed_forward_trains(self):
    self._delayed_scaling_trains("flax_fp8_delayed_fwd")

  def test_flax_fp8_delayed_grad_lhs_trains(self):
    self._delayed_scaling_trains("flax_fp8_delayed_grad_lhs")

  def _delayed_scaling_trains(self, kernel):
    model = train_toys.ToyClickModel(
        config=SiteConfig.for_precision("fp8_all", kernel=kernel))
    source = train_toys.ToySource(seed=1)
    config = TrainConfig(steps=60, batch_size=128, log_every=20, progress=False)
    final = train(model, source, self.workdir, config)
    state, _ = restore_run(self.workdir, model, source, config)
    scales = {"/".join(str(k.key) for k in path): float(np.asarray(v).item())
              for path, v in jax.tree_util.tree_leaves_with_path(state.fp8_meta)
              if "scale" in str(path[-1])}
    self.assertNotEmpty(scales)
    moved = {k: v for k, v in scales.items() if abs(v - 1.0) > 1e-3}
    # Delayed scaling starts every scale at 1; training must have updated them.
    self.assertGreaterEqual(len(moved), len(scales) // 2, scales)
    # The fp8 state is overwritten, never optimized: no optimizer state mirrors it.
    opt_shapes = {np.shape(x) for x in jax.tree.leaves(state.opt_state)}
    history_shapes = {np.shape(x) for path, x in jax.tree_util.tree_leaves_with_path(
        state.fp8_meta) if "history" in str(path[-1])}
    self.assertFalse(opt_shapes & history_shapes)
    lines = read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    self.assertLess(lines[-1]["loss"], lines[0]["loss"] - 0.05)
    self.assertLess(final["ne"], 0.9)


if __name__ == "__main__":
  absltest.main()
