"""The statistics pass on a real model inside the real training loop: output gradients,
compile counts, checkpointed statistics and resume."""
import dataclasses
import tempfile
from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax.models.site import DenseSite
from loka_jax.probe import collector, executables, training
from loka_jax.train import TrainConfig, restore_run, train
from loka_jax.train.optim import make_optimizer
from loka_jax.train.state import abstract_train_state
from loka_jax.train.metrics import bce_with_logits
import train_toys

CONFIG = collector.ProbeConfig(cadence=2, min_observations=1)
BATCH = 16


class RepeatedLayers(train_toys.ToyClickModel):
  """The toy tower with four hidden layers: the last three are equal sites."""

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train
    pooled = train_toys.ToyEmbeddings(self.features, self.dim, name="embeddings")(
        jnp.asarray(batch["sparse_ids"]), jnp.asarray(batch["sparse_mask"]).astype(jnp.float32))
    h = jnp.concatenate([jnp.asarray(batch["dense"]), pooled], axis=-1)
    for i in range(4):
      h = nn.relu(DenseSite(self.hidden, config=self.config, name=f"hidden_{i}")(h))
    return DenseSite(1, config=self.config, name="out")(h)[:, 0].astype(jnp.float32)


def _setup(on_trace=None, state=None, meta=None, config=CONFIG):
  model, source = train_toys.ToyClickModel(), train_toys.ToySource(seed=3, num_eval=64)
  batch = source.train_batch(0, BATCH)
  abstract = jax.eval_shape(lambda b: model.init({"params": jax.random.PRNGKey(0)}, b), batch)
  sites = training.probe_sites(model, abstract, batch, config)
  probe = training.ProbeCollector(model, source, BATCH, sites, config, state=state, meta=meta,
                                   example_variables=abstract, on_trace=on_trace)
  return model, source, sites, probe


class StatisticsPassTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.traces = []
    cls.model, cls.source, cls.sites, cls.probe = _setup(on_trace=cls.traces.append)
    cls.params = cls.model.init({"params": jax.random.PRNGKey(1)},
                                cls.source.train_batch(0, BATCH))
    cls.probe.observe(cls.params, jax.random.PRNGKey(0), step=5)
    cls.first = jax.device_get(cls.probe.state)
    for step in (6, 8):
      cls.probe.observe(cls.params, jax.random.PRNGKey(0), step=step)

  def test_output_gradients_are_those_of_the_training_loss(self):
    self.assertEqual(list(self.sites), ["hidden", "out"])
    batch = self.source.train_batch(5, BATCH)
    # The toy's logit is the `out` site's output (no bias at init): d loss / d out by hand.
    logits = self.model.apply(self.params, batch)
    by_hand = jax.grad(lambda z: jnp.mean(bce_with_logits(z, batch["label"])))(logits)
    out = collector.site_state(self.first, self.sites, "out")
    self.assertEqual(float(out["grad"]["count"]), BATCH)
    np.testing.assert_allclose(out["grad"]["mean"][0], np.mean(by_hand), rtol=2e-2, atol=1e-6)
    np.testing.assert_allclose(out["grad"]["m2"][0, 0], np.sum((by_hand - by_hand.mean()) ** 2),
                               rtol=5e-2)
    # And the inputs: the hidden site sees [dense, pooled embeddings] of the same batch.
    hidden = collector.site_state(self.first, self.sites, "hidden")
    np.testing.assert_allclose(hidden["lhs"]["mean"][:4], batch["dense"].mean(0), atol=2e-2)
    self.assertEqual(int(hidden["reservoir"]["seen"]), BATCH)

  def test_pass_compiles_once_per_shape(self):
    self.assertEqual(int(self.probe.state["observations"]), 3)
    self.assertEqual(self.traces.count("extract"), 1)
    updates = [t for t in self.traces if t.startswith("update")]
    self.assertEqual(len(updates), len(self.sites))  # two sites, two shapes, each traced once
    # Sites are shapes: another batch size needs its own, and traces the pass again, once.
    with self.assertRaisesRegex(collector.ProbeStateError, "set up for output shape"):
      training.ProbeCollector(self.model, self.source, BATCH * 2, self.sites, CONFIG)
    bigger = training.probe_sites(self.model, self.params,
                                   self.source.train_batch(0, 2 * BATCH), CONFIG)
    traces = []
    other = training.ProbeCollector(self.model, self.source, BATCH * 2, bigger, CONFIG,
                                     example_variables=jax.eval_shape(lambda: self.params),
                                     on_trace=traces.append)
    other.observe(self.params, jax.random.PRNGKey(0), step=2)
    other.observe(self.params, jax.random.PRNGKey(0), step=4)
    self.assertEqual(traces.count("extract"), 1)
    self.assertEqual(len(traces), 1 + len(bigger))


class WeightEveryTest(chex.TestCase):

  def test_the_matrix_normal_is_refit_on_every_kth_observation_only(self):
    sparse = collector.ProbeConfig(cadence=2, min_observations=1, weight_every=3)
    model, source = train_toys.ToyClickModel(), train_toys.ToySource(seed=3, num_eval=64)
    batch = source.train_batch(0, BATCH)
    params = model.init({"params": jax.random.PRNGKey(1)}, batch)
    sites = training.probe_sites(model, params, batch, sparse)
    every, skipping = (training.ProbeCollector(model, source, BATCH, sites, config)
                       for config in (CONFIG, sparse))
    moved = jax.tree.map(lambda x: x * 1.5, params)
    # Observations 0-3 with the weights moving at 1 and 3; weight_every=3 refits at 0 and 3.
    for i, variables in enumerate((params, moved, moved, params)):
      skipping.observe(variables, jax.random.PRNGKey(0), step=2 * i)
      if i in (0, 3):
        every.observe(variables, jax.random.PRNGKey(0), step=2 * i)
    for name in sites:
      got = collector.site_state(jax.device_get(skipping.state), sites, name)
      want = collector.site_state(jax.device_get(every.state), sites, name)
      self.assertEqual(float(got["rhs"]["count"]), 2.0)
      for field in ("mean", "row_cov", "col_cov"):
        np.testing.assert_allclose(got["rhs"][field], want["rhs"][field], rtol=1e-6,
                                   err_msg=f"{name} {field}")
      # The other statistics still see every observation, and the latest weight is kept.
      self.assertEqual(float(got["lhs"]["count"]), 4 * BATCH)
      np.testing.assert_array_equal(got["weight"], want["weight"])

  def test_one_program_gives_the_statistics_of_the_staged_pass(self):
    whole = collector.ProbeConfig(cadence=2, min_observations=1, one_program=True)
    model, source = train_toys.ToyClickModel(), train_toys.ToySource(seed=3, num_eval=64)
    batch = source.train_batch(0, BATCH)
    params = model.init({"params": jax.random.PRNGKey(1)}, batch)
    sites = training.probe_sites(model, params, batch, CONFIG)
    traces = []
    staged = training.ProbeCollector(model, source, BATCH, sites, CONFIG)
    one = training.ProbeCollector(model, source, BATCH, sites, whole, on_trace=traces.append)
    self.assertEqual(collector.statistics_functions(sites, whole), 1)
    self.assertLen(one.probe.statistics_pass.compile_jobs(
        one.state, params, batch, jax.random.PRNGKey(0), jax.random.PRNGKey(0)), 1)
    for step in (2, 4, 6):
      staged.observe(params, jax.random.PRNGKey(0), step=step)
      one.observe(params, jax.random.PRNGKey(0), step=step)
    # One trace: the extract stage and each site's update inside it.
    self.assertEqual(traces.count("extract"), 1)
    self.assertLen([t for t in traces if t.startswith("update")], len(sites))
    got, want = jax.device_get(one.state), jax.device_get(staged.state)
    self.assertEqual(int(got["observations"]), 3)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

  def test_equal_sites_updated_as_a_group_give_the_statistics_of_one_update_each(self):
    # Three equal hidden layers after the first: grouped, each group's sites are updated by
    # one vmapped update, staged or in one program, with the statistics of a separate update
    # per site (each site still draws its own key).
    model, source = RepeatedLayers(), train_toys.ToySource(seed=3, num_eval=64)
    batch = source.train_batch(0, BATCH)
    params = model.init({"params": jax.random.PRNGKey(1)}, batch)
    sites = training.probe_sites(model, params, batch, CONFIG)
    groups = collector.site_groups(sites, CONFIG)
    self.assertEqual(len(groups), len(sites) - 2)
    self.assertEqual(sorted(n for g in groups for n in g), sorted(sites))

    def observed(config):
      """The statistics after two observations, the updates traced, and the compiled calls
      the pass made."""
      traces = []
      probe = training.ProbeCollector(model, source, BATCH, sites, config,
                                      on_trace=traces.append)
      with mock.patch.object(collector.executables, "call",
                             wraps=executables.call) as calls:
        for step in (2, 4):
          probe.observe(params, jax.random.PRNGKey(0), step=step)
      return (jax.device_get(probe.state), [t for t in traces if t.startswith("update")],
              calls.call_count)

    want, per_site, per_site_calls = observed(CONFIG)
    self.assertLen(per_site, len(groups))   # equal sites share one compiled update
    self.assertEqual(per_site_calls, 2 * (1 + len(sites)))   # extract, then each site
    for one_program in (False, True):
      config = dataclasses.replace(CONFIG, group_sites=True, one_program=one_program)
      got, updates, calls = observed(config)
      self.assertLen(updates, len(groups), one_program)   # each traced once, for its group
      # Staged: the extract stage, then one call a group; in one program: one call.
      self.assertEqual(calls, 2 * (1 if one_program else 1 + len(groups)), one_program)
      # A batched product may sum in another order than one site's.
      chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
    self.assertNotIn("group_sites", CONFIG.statistics_settings())

  def test_each_pass_compile_gives_the_statistics_of_the_default(self):
    model, source = train_toys.ToyClickModel(), train_toys.ToySource(seed=3, num_eval=64)
    batch = source.train_batch(0, BATCH)
    params = model.init({"params": jax.random.PRNGKey(1)}, batch)
    sites = training.probe_sites(model, params, batch, CONFIG)
    probes = {way: training.ProbeCollector(
        model, source, BATCH, sites,
        collector.ProbeConfig(cadence=2, min_observations=1, pass_compile=way))
              for way in collector.PASS_COMPILES}
    for step in (2, 4):
      for probe in probes.values():
        probe.observe(params, jax.random.PRNGKey(0), step=step)
    want = jax.device_get(probes["autotuned"].state)
    for way in ("cublas", "untuned"):
      chex.assert_trees_all_close(jax.device_get(probes[way].state), want, rtol=1e-5,
                                  atol=1e-6, custom_message=way)

  def test_an_unknown_pass_compile_is_refused(self):
    with self.assertRaisesRegex(ValueError, "pass_compile='fast': use one of autotuned"):
      collector.ProbeConfig(pass_compile="fast")

  def test_weight_every_below_one_is_refused(self):
    with self.assertRaisesRegex(ValueError, "weight_every must be >= 1"):
      collector.ProbeConfig(weight_every=0)


class TrainingLoopTest(chex.TestCase):

  def test_statistics_ride_in_checkpoints_and_resume(self):
    workdir = tempfile.mkdtemp(prefix="loka_probe_loop_")
    model, source, sites, probe = _setup()
    config = TrainConfig(steps=5, batch_size=BATCH, checkpoint_every=4, progress=False,
                         log_every=0)
    train(model, source, workdir, config, extras=probe.extras, step_callback=probe.on_step)
    self.assertEqual(probe.meta["steps"], [2, 4])
    overhead = probe.overhead()
    self.assertEqual(overhead["observations"], 2)
    self.assertGreater(overhead["step_ms"], 0.0)

    state, extras = restore_run(workdir, model, source, config)
    self.assertEqual(int(state.step), 5)
    saved = extras[training.STATS_KEY]
    chex.assert_trees_all_close(saved, jax.device_get(probe.state))
    self.assertEqual(extras[training.META_KEY]["site_names"], ["hidden", "out"])

    # Resume to step 9 from the checkpoint's statistics: observations continue.
    _, _, _, resumed = _setup(state=saved, meta=extras[training.META_KEY])
    more = TrainConfig(steps=9, batch_size=BATCH, checkpoint_every=4, progress=False,
                       log_every=0)
    train(model, source, workdir, more, extras=resumed.extras, step_callback=resumed.on_step)
    self.assertEqual(resumed.meta["steps"], [2, 4, 6, 8])
    rows = float(collector.site_state(resumed.state, sites, "hidden")["lhs"]["count"])
    self.assertEqual(rows, 4 * BATCH)

  def test_an_overhead_budget_spaces_observations_and_a_resumed_run_keeps_its_schedule(self):
    budget = dataclasses.replace(CONFIG, max_overhead=0.001)
    workdir = tempfile.mkdtemp(prefix="loka_probe_budget_")
    model, source, _, probe = _setup(config=budget)
    config = TrainConfig(steps=8, batch_size=BATCH, checkpoint_every=4, progress=False,
                         log_every=0)
    train(model, source, workdir, config, extras=probe.extras, step_callback=probe.on_step)
    # Step 2's observation compiles the pass, step 4's is timed: a pass costs far more than
    # 0.1% of two toy steps, so the next one waits past the run's end.
    self.assertEqual(probe.meta["steps"], [2, 4])
    self.assertGreater(probe.meta["next_step"], 8)
    overhead = probe.overhead()
    self.assertGreater(overhead["gap"], 4)
    self.assertLessEqual(overhead["fraction"], 0.001)
    self.assertEqual(collector.budgeted_gap(2, None, 1.0, 0.001), 2)   # unmeasured: cadence
    self.assertEqual(collector.budgeted_gap(2, 0.5, 0.01, 0.02), 2500)
    self.assertEqual(collector.budgeted_gap(25, 0.001, 0.01, 0.02), 25)
    # Resumed from step 8's checkpoint, the run observes when the saved schedule says.
    state, extras = restore_run(workdir, model, source, config)
    _, _, _, resumed = _setup(state=extras[training.STATS_KEY],
                              meta=extras[training.META_KEY], config=budget)
    self.assertEqual(resumed.meta["next_step"], probe.meta["next_step"])
    more = dataclasses.replace(config, steps=12)
    train(model, source, workdir, more, extras=resumed.extras, step_callback=resumed.on_step)
    self.assertEqual(resumed.meta["steps"], [2, 4])

  def test_a_run_stopped_after_a_checkpoint_at_an_observation_resumes_with_equal_statistics(
      self):
    # Step 4 is both an observation and a checkpoint: the checkpoint holds that observation,
    # so the run stopped at step 5 resumes from step 4 and observes at 6, as the uninterrupted
    # run does (not at 5, one step late, on other parameters and another batch).
    config = TrainConfig(steps=6, batch_size=BATCH, checkpoint_every=4, progress=False,
                         log_every=0)
    model, source, _, whole = _setup()
    train(model, source, tempfile.mkdtemp(prefix="loka_probe_whole_"),
          config, extras=whole.extras, step_callback=whole.on_step)

    class Stop(Exception):
      pass

    def stop_at_5(step, state, metrics):
      first.on_step(step, state, metrics)
      if step == 5:
        raise Stop()

    workdir = tempfile.mkdtemp(prefix="loka_probe_stopped_")
    *_, first = _setup()
    with self.assertRaises(Stop):
      train(model, source, workdir, config, extras=first.extras,
            step_callback=stop_at_5)
    _, extras = restore_run(workdir, model, source, config)
    self.assertEqual(extras[training.META_KEY]["steps"], [2, 4])
    *_, resumed = _setup(state=extras[training.STATS_KEY], meta=extras[training.META_KEY])
    train(model, source, workdir, config, extras=resumed.extras,
          step_callback=resumed.on_step)
    self.assertEqual(resumed.meta["steps"], whole.meta["steps"])
    self.assertEqual(whole.meta["steps"], [2, 4, 6])
    chex.assert_trees_all_equal(jax.device_get(resumed.state), jax.device_get(whole.state))

  def test_the_pass_compiled_ahead_serves_every_observation_with_equal_statistics(self):
    # Compiled on threads, from the state's shapes before training or from the loop's first
    # step (as the probe runner does): every call of the pass takes an executable compiled
    # ahead, none goes through jit, and the statistics equal those of the pass compiled on
    # first call.
    config = TrainConfig(steps=5, batch_size=BATCH, checkpoint_every=0, keep_checkpoints=0,
                         progress=False, log_every=0)
    def run(ahead: str):
      model, source, _, probe = _setup()
      if ahead == "shapes":
        example = abstract_train_state(model, make_optimizer(config.optim),
                                       source.train_batch(0, BATCH), config.seed)
        # The extract stage and one update per distinct site (the toy's two sites differ).
        self.assertEqual(probe.compile_ahead(example, workers=2), 3)
      elif ahead == "first step":
        probe.compile_ahead_after_first_step(workers=2)
      before = executables.counts()
      train(model, source, tempfile.mkdtemp(prefix="loka_probe_ahead_"), config,
            extras=probe.extras, step_callback=probe.on_step)
      after = executables.counts()
      self.assertIsNone(probe._precompiler)   # closed by the first observation
      self.assertTrue(probe.pass_compiled)
      return probe, {k: after[k] - before[k] for k in ("ahead", "inline")}
    plain, plain_calls = run("none")
    self.assertEqual(plain_calls, {"ahead": 0, "inline": 6})   # 2 observations x 3 calls
    for mode in ("shapes", "first step"):
      ahead, ahead_calls = run(mode)
      self.assertEqual(ahead.meta["steps"], [2, 4])
      self.assertEqual(ahead_calls, {"ahead": 6, "inline": 0}, mode)
      chex.assert_trees_all_close(jax.device_get(ahead.state), jax.device_get(plain.state),
                                  rtol=1e-6, atol=1e-6)

  def test_a_failed_compile_ahead_only_warns_and_the_pass_compiles_on_first_call(self):
    model, source, _, probe = _setup()
    config = TrainConfig(steps=3, batch_size=BATCH, checkpoint_every=0, keep_checkpoints=0,
                         progress=False, log_every=0)
    probe.compile_ahead_after_first_step(workers=2)
    def broken(*args, **kwargs):
      raise RuntimeError("no shapes today")
    before = executables.counts()
    with mock.patch.object(probe.probe.statistics_pass, "compile_jobs", broken), \
         self.assertWarnsRegex(UserWarning, "not compiled ahead .*no shapes today"):
      train(model, source, tempfile.mkdtemp(prefix="loka_probe_ahead_"), config,
            extras=probe.extras, step_callback=probe.on_step)
    after = executables.counts()
    self.assertEqual(probe.meta["steps"], [2])
    self.assertEqual((after["ahead"] - before["ahead"], after["inline"] - before["inline"]),
                     (0, 3))
    self.assertIsNone(probe._precompiler)

  def test_statistics_of_other_sites_are_refused(self):
    _, _, sites, probe = _setup()
    state = jax.device_get(probe.state)
    key = collector.state_keys(sites)["hidden"]
    state["sites"][key]["lhs"]["mean"] = np.zeros(7, np.float32)
    with self.assertRaisesRegex(collector.ProbeStateError, "other shape: sites/s000/lhs/mean"):
      _setup(state=state)


if __name__ == "__main__":
  absltest.main()
