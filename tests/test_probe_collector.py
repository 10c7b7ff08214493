"""The statistics pass on a real model inside the real training loop: output gradients,
compile counts, checkpointed statistics and resume."""
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax.probe import collector
from loka_jax.train import TrainConfig, restore_run, train
from loka_jax.train.metrics import bce_with_logits
from tests import train_toys

CONFIG = collector.ProbeConfig(cadence=2, min_observations=1)
BATCH = 16


def _setup(on_trace=None, state=None, meta=None):
  model, source = train_toys.ToyClickModel(), train_toys.ToySource(seed=3, num_eval=64)
  batch = source.train_batch(0, BATCH)
  abstract = jax.eval_shape(lambda b: model.init({"params": jax.random.PRNGKey(0)}, b), batch)
  sites = collector.probe_sites(model, abstract, batch, CONFIG)
  probe = collector.ProbeCollector(model, source, BATCH, sites, CONFIG, state=state, meta=meta,
                                   example_variables=abstract, on_trace=on_trace)
  return model, source, sites, probe


class StatisticsPassTest(chex.TestCase):

  def test_output_gradients_are_those_of_the_training_loss(self):
    model, source, sites, probe = _setup()
    self.assertEqual(list(sites), ["hidden", "out"])
    params = model.init({"params": jax.random.PRNGKey(1)}, source.train_batch(0, BATCH))
    probe.observe(params, jax.random.PRNGKey(0), step=5)
    batch = source.train_batch(5, BATCH)
    # The toy's logit is the `out` site's output (no bias at init): d loss / d out by hand.
    logits = model.apply(params, batch)
    by_hand = jax.grad(lambda z: jnp.mean(bce_with_logits(z, batch["label"])))(logits)
    out = collector.site_state(probe.state, sites, "out")
    self.assertEqual(float(out["grad"]["count"]), BATCH)
    np.testing.assert_allclose(out["grad"]["mean"][0], np.mean(by_hand), rtol=2e-2, atol=1e-6)
    np.testing.assert_allclose(out["grad"]["m2"][0, 0], np.sum((by_hand - by_hand.mean()) ** 2),
                               rtol=5e-2)
    # And the inputs: the hidden site sees [dense, pooled embeddings] of the same batch.
    hidden = collector.site_state(probe.state, sites, "hidden")
    np.testing.assert_allclose(hidden["lhs"]["mean"][:4], batch["dense"].mean(0), atol=2e-2)
    self.assertEqual(int(hidden["reservoir"]["seen"]), BATCH)

  def test_pass_compiles_once_per_shape(self):
    traces = []
    model, source, sites, probe = _setup(on_trace=traces.append)
    params = model.init({"params": jax.random.PRNGKey(1)}, source.train_batch(0, BATCH))
    for step in (2, 4, 6):
      probe.observe(params, jax.random.PRNGKey(0), step=step)
    self.assertEqual(traces.count("extract"), 1)
    updates = [t for t in traces if t.startswith("update")]
    self.assertEqual(len(updates), len(sites))  # two sites, two shapes, each traced once
    self.assertEqual(int(probe.state["observations"]), 3)
    # Sites are shapes: another batch size needs its own, and traces the pass again, once.
    with self.assertRaisesRegex(collector.ProbeStateError, "set up for output shape"):
      collector.ProbeCollector(model, source, BATCH * 2, sites, CONFIG)
    bigger = collector.probe_sites(model, params, source.train_batch(0, 2 * BATCH), CONFIG)
    other = collector.ProbeCollector(model, source, BATCH * 2, bigger, CONFIG,
                                     example_variables=jax.eval_shape(lambda: params),
                                     on_trace=traces.append)
    other.observe(params, jax.random.PRNGKey(0), step=2)
    other.observe(params, jax.random.PRNGKey(0), step=4)
    self.assertEqual(traces.count("extract"), 2)


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
    saved = extras[collector.STATS_KEY]
    chex.assert_trees_all_close(saved, jax.device_get(probe.state))
    self.assertEqual(extras[collector.META_KEY]["site_names"], ["hidden", "out"])

    # Resume to step 9 from the checkpoint's statistics: observations continue.
    _, _, _, resumed = _setup(state=saved, meta=extras[collector.META_KEY])
    more = TrainConfig(steps=9, batch_size=BATCH, checkpoint_every=4, progress=False,
                       log_every=0)
    train(model, source, workdir, more, extras=resumed.extras, step_callback=resumed.on_step)
    self.assertEqual(resumed.meta["steps"], [2, 4, 6, 8])
    rows = float(collector.site_state(resumed.state, sites, "hidden")["lhs"]["count"])
    self.assertEqual(rows, 4 * BATCH)

  def test_statistics_of_other_sites_are_refused(self):
    _, _, sites, probe = _setup()
    state = jax.device_get(probe.state)
    key = collector.state_keys(sites)["hidden"]
    state["sites"][key]["lhs"]["mean"] = np.zeros(7, np.float32)
    with self.assertRaisesRegex(collector.ProbeStateError, "other shape: sites/s000/lhs/mean"):
      _setup(state=state)


if __name__ == "__main__":
  absltest.main()
