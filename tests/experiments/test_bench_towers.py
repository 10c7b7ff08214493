"""The bench's MLP towers and timed steps on the CPU: the tower source, one state shared by
the arms or one state each, and the train calls of a timed sample."""
import tempfile
from unittest import mock

import chex
import jax
import numpy as np
from absl.testing import absltest

from experiments.bench import settings, suite, towers
from experiments.configs import bench_models as bench_models_config
from loka_jax.models.site import SiteConfig
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import create_train_state
from model_helpers import entry_arguments


class TowerSourceTest(chex.TestCase):
  """The towers' data: pure in (task_seed, seed, step), heavy-tailed inputs with the
  per-channel scales, labels that follow the hidden teacher."""

  def test_batches_are_a_pure_function_of_seed_and_step(self):
    # `a` and `other` hold 4 held-out batches, `b` the default: the train batches depend on the
    # seed and the step alone, not on the held-out size.
    a = towers.TowerSource(32, seed=1, num_eval=256)
    b = towers.TowerSource(32, seed=1)
    np.testing.assert_array_equal(a.train_batch(3, 64)["dense"], b.train_batch(3, 64)["dense"])
    self.assertFalse(np.array_equal(a.train_batch(3, 64)["dense"],
                                    a.train_batch(4, 64)["dense"]))
    other = towers.TowerSource(32, seed=2, num_eval=256)
    self.assertFalse(np.array_equal(a.train_batch(3, 64)["dense"],
                                    other.train_batch(3, 64)["dense"]))
    # The held-out set is the task's, the same for every seed.
    for x, y in zip(a.eval_batches(64), other.eval_batches(64)):
      np.testing.assert_array_equal(x["dense"], y["dense"])

  def test_inputs_are_heavy_tailed_and_labels_follow_the_teacher(self):
    source = towers.TowerSource(64, num_eval=8192)
    batch = source.train_batch(0, 8192)
    chex.assert_shape(batch["dense"], (8192, 64))
    self.assertEqual(batch["dense"].dtype, np.float32)
    z = (batch["dense"] / source._scale).astype(np.float64)
    self.assertAlmostEqual(z.std(), np.sqrt(5 / 3), delta=0.05)  # t(5): variance 5/3
    self.assertGreater(np.mean(z ** 4) / np.mean(z ** 2) ** 2, 4.0)  # a normal gives 3
    # The teacher's logit, recomputed here in NumPy, predicts the labels.
    logit = np.tanh(z @ source._w1) @ source._w2 * 0.5
    labels = batch["label"]
    self.assertTrue(set(np.unique(labels)) <= {0.0, 1.0})
    self.assertGreater(labels[logit > 1].mean() - labels[logit < -1].mean(), 0.3)


class SharedStateTest(chex.TestCase):

  def test_variants_thread_one_state_and_keep_their_fp8_meta(self):
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0)
    base = bench.set_baseline(towers.build_tower(shape, SiteConfig.for_precision("bf16")))
    mods = bench.add("bf16_mods", towers.build_tower(
        shape, SiteConfig.for_precision("bf16"), ("all",)))
    flax_arm = bench.add("flax", towers.build_tower(
        shape, SiteConfig.for_precision("fp8_all", kernel="flax_fp8_delayed")))
    self.assertTrue(mods.info["shared_state"])
    self.assertTrue(flax_arm.info["shared_state"])
    before = int(bench.holder["shared"].step)
    for arm in (base, mods, flax_arm, flax_arm):
      arm.train()
    self.assertEqual(int(bench.holder["shared"].step), before + 4)
    self.assertEqual(bench.holder["shared"].fp8_meta, bench.holder["empty_meta"])
    chex.assert_shape(np.asarray(flax_arm.infer()), (32,))


class OwnStatesTest(chex.TestCase):
  """`own_states`: every variant on a state of its own model's parameters, as the training
  loop runs it, where by default the Mods arms thread bf16's state and its biases."""

  def test_a_mods_arm_steps_on_its_own_parameters_and_leaves_bf16s_state_alone(self):
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    bf16 = towers.build_tower(shape, SiteConfig.for_precision("bf16"))
    mods_model = towers.build_tower(shape, SiteConfig.for_precision("bf16"), ("all",))
    shared = suite.speed.TargetBench(batch, min_call_s=0.0)
    shared.set_baseline(bf16)
    shared_arm = shared.add("bf16_mods", mods_model)
    own = suite.speed.TargetBench(batch, min_call_s=0.0, own_states=True)
    own.set_baseline(bf16)
    own_arm = own.add("bf16_mods", mods_model)
    self.assertTrue(shared_arm.info["shared_state"])
    self.assertFalse(own_arm.info["shared_state"])
    # The arm's state holds its own model's parameters: fewer arrays than bf16's, which hold
    # the biases the Mods drop.
    own_params = jax.tree.leaves(own.holder["own:bf16_mods"].params)
    bf16_params = jax.tree.leaves(own.holder["shared"].params)
    self.assertLess(len(own_params), len(bf16_params))
    self.assertEqual(len(own_params), len(jax.tree.leaves(
        mods_model.init(jax.random.PRNGKey(0), batch, train=False)["params"])))
    # So its timed program takes fewer arguments than the same arm on the shared state.
    self.assertLess(entry_arguments(own_arm.hlo["train"]),
                    entry_arguments(shared_arm.hlo["train"]))
    # Its steps advance its own state; bf16's shared one is untouched.
    before_own = int(own.holder["own:bf16_mods"].step)
    before_shared = int(own.holder["shared"].step)
    own_arm.train()
    own_arm.train()
    self.assertEqual(int(own.holder["own:bf16_mods"].step), before_own + 2)
    self.assertEqual(int(own.holder["shared"].step), before_shared)
    # The state the arm steps on (what its served export reads): its own, bf16's shared one
    # on the shared bench.
    self.assertIs(own.state_of("bf16_mods"), own.holder["own:bf16_mods"])
    self.assertIs(shared.state_of("bf16_mods"), shared.holder["shared"])
    chex.assert_shape(np.asarray(own_arm.infer()), (32,))
    timed = own.time_pair(own_arm, repeats=2)
    self.assertGreater(timed["train"]["median_us"], 0.0)

  def test_an_own_state_that_cannot_fit_the_device_is_refused_before_it_is_made(self):
    # The device's allocator statistics are given (the CPU keeps none): the bench holds
    # `held` bytes and may take `held + room`. The room a state needs is that of a real
    # one, made as the bench makes it: it holds the parameters and Adam's two moments,
    # so an estimate without the moments asks a third of it and would pass at half.
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    bf16 = towers.build_tower(shape, SiteConfig.for_precision("bf16"))
    mods_model = towers.build_tower(shape, SiteConfig.for_precision("bf16"), ("all",))
    held = 7_000_000
    made = create_train_state(mods_model, make_optimizer(OptimConfig()), batch, 0)
    real = sum(x.nbytes for x in jax.tree.leaves(made))

    def bench_with_room(room):
      stats = {"bytes_limit": held + room, "bytes_in_use": held}
      bench = suite.speed.TargetBench(batch, min_call_s=0.0, own_states=True,
                                      memory_stats=lambda: stats)
      bench.set_baseline(bf16)
      return bench

    fits = bench_with_room(real)
    self.assertFalse(fits.add("bf16_mods", mods_model).info["shared_state"])
    short = bench_with_room(real // 2)
    with self.assertRaisesRegex(suite.speed.StateMemoryError,
                                r"^bf16_mods: a training state of its own takes .*"
                                r"speed\.own_states=false.*XLA_PYTHON_CLIENT_MEM_FRACTION"):
      short.add("bf16_mods", mods_model)
    self.assertNotIn("own:bf16_mods", short.holder)
    # The shared state needs no room of its own: the same arm on it is built.
    shared = suite.speed.TargetBench(batch, min_call_s=0.0,
                                     memory_stats=lambda: {"bytes_limit": 1, "bytes_in_use": 1})
    shared.set_baseline(bf16)
    self.assertTrue(shared.add("bf16_mods", mods_model).info["shared_state"])

  def test_the_bench_config_field_reaches_the_speed_settings(self):
    config = bench_models_config.get_config()
    self.assertFalse(settings.speed_settings(config, tempfile.mkdtemp()).own_states)
    config.speed.own_states = True
    self.assertTrue(settings.speed_settings(config, tempfile.mkdtemp()).own_states)


class InnerStepsTest(chex.TestCase):

  def test_steps_per_timed_call_are_chosen_per_mode(self):
    # A train step above min_call_s runs once a call; an inference step 50x shorter runs
    # often enough to reach it. The single-call times are fixed here (the numerics are not).
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    bench = suite.speed.TargetBench(batch, min_call_s=1e-3)
    one_call = {"train_call": 5e-3, "infer_call": 1e-4}
    with mock.patch.object(suite.speed.timing, "call_seconds",
                           lambda call: one_call[call.__name__]):
      base = bench.set_baseline(towers.build_tower(shape, SiteConfig.for_precision("bf16")))
    self.assertEqual(bench.inner, {"train": 1, "infer": 10})
    self.assertEqual(base.info["inner"], {"train": 1, "infer": 10})
    mods = bench.add("bf16_mods", towers.build_tower(
        shape, SiteConfig.for_precision("bf16"), ("all",)))
    before = int(bench.holder["shared"].step)
    mods.train()
    self.assertEqual(int(bench.holder["shared"].step), before + 1)
    chex.assert_shape(np.asarray(mods.infer()), (32,))
    before = int(bench.holder["shared"].step)
    timed = bench.time_pair(mods, repeats=3)
    # Steps per timed sample: 4 train calls back to back; one inference call of 10 steps.
    self.assertEqual((timed["train"]["inner"], timed["infer"]["inner"]), (4, 10))
    self.assertEqual(mods.info["calls_per_sample"], {"train": 4, "infer": 1})
    # bf16 and bf16+Mods thread one state: 3 warm-up calls each, then 3 samples of 4 calls.
    self.assertEqual(int(bench.holder["shared"].step), before + 2 * (3 + 3 * 4))

  def test_one_train_call_a_sample_when_asked_and_none_refused(self):
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    with self.assertRaisesRegex(ValueError, "train_calls must be >= 1"):
      suite.speed.TargetBench(batch, train_calls=0)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0, train_calls=1)
    base = bench.set_baseline(towers.build_tower(shape, SiteConfig.for_precision("bf16")))
    before = int(bench.holder["shared"].step)
    timed = bench.time_pair(base, repeats=2)
    self.assertEqual(timed["train"]["inner"], 1)
    self.assertEqual(int(bench.holder["shared"].step), before + 3 + 2)


if __name__ == "__main__":
  absltest.main()
