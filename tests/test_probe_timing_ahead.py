"""Timings measured ahead (`experiments.probe --time_only`): every distinct site shape goes
into the timing cache without training, and a later probe given that cache times nothing
(and compiles none of its evaluation on first call: `probe.executables`)."""
import os
import tempfile
from unittest import mock

import chex
from absl.testing import absltest

from loka_jax.probe import executables, kernel_timing, runner
from loka_jax.probe.collector import ProbeConfig
from loka_jax.train import TrainConfig, experiment

SITES = "layer_0/fmb/(fm_proj|mlp/dense_0|mlp/dense_1)"
KERNELS = ("xla_bf16", "xla_fp8_rowwise")
BATCH = 64


def spec():
  return experiment.RunSpec(model="wukong", preset="tiny", mods=("all",), num_eval=256)


def options(cache_dir, **kw):
  return runner.ProbeOptions(samples=2, kernels=KERNELS, sites=SITES, timing_cache=cache_dir,
                             bootstrap=20, plots=False, **kw)


class DescribeTest(chex.TestCase):

  def test_sizes_match_the_states_a_probe_creates(self):
    import jax
    import jax.numpy as jnp
    from loka_jax.probe import collector as collector_lib
    from loka_jax.train.optim import make_optimizer
    from loka_jax.train.state import create_train_state
    config = TrainConfig(steps=4, batch_size=BATCH, progress=False, log_every=0)
    d = runner.describe_probe(spec(), config)
    model, source, _ = experiment.build_run(spec())
    batch = source.train_batch(0, BATCH)
    state = create_train_state(model, make_optimizer(config.optim), batch, config.seed)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    self.assertEqual(d["state_bytes"], nbytes(state))
    sites = collector_lib.probe_sites(model, None, batch, ProbeConfig())
    self.assertEqual(d["sites"], len(sites))
    stats = collector_lib.init_state(sites, ProbeConfig(), jnp.bfloat16)
    self.assertEqual(d["statistics_bytes"], nbytes(stats))
    # Two Wukong layers of one shape: fewer distinct shapes than sites, and fewer sites
    # that bring new evaluation functions.
    self.assertLess(d["distinct_shapes"], d["sites"])
    self.assertLess(d["sites_compiling"], d["sites"])
    self.assertGreater(d["evaluation_functions"], d["sites_compiling"])


class TimingAheadTest(chex.TestCase):

  def test_refused_without_a_gpu(self):
    with self.assertRaisesRegex(runner.ProbeSetupError, "needs a GPU"):
      runner.time_site_shapes(spec(), BATCH, tempfile.mkdtemp(), options=options(None))

  def test_cache_filled_ahead_then_the_probe_times_nothing(self):
    cache_dir = tempfile.mkdtemp(prefix="loka_timing_ahead_")
    # The platform check is what stands in the way on a CPU; the timings themselves are real
    # (CPU) measurements, which is all the caching flow needs.
    with mock.patch.object(kernel_timing, "on_gpu", return_value=True):
      done = runner.time_site_shapes(spec(), BATCH, cache_dir, options=options(cache_dir))
      self.assertEqual(done["pending"], 0)
      self.assertEqual(done["timed"], done["shapes"])
      self.assertGreaterEqual(done["shapes"], 2)      # the two MLP layers differ in shape
      self.assertTrue(os.path.exists(done["cache"]))
      stamp = os.path.getmtime(done["cache"])
      again = runner.time_site_shapes(spec(), BATCH, cache_dir, options=options(cache_dir))
      self.assertEqual(again["timed"], done["timed"])
      self.assertEqual(os.path.getmtime(done["cache"]), stamp)   # nothing measured again

    measured = []
    real = kernel_timing.measure_site

    def counting(*args, **kwargs):
      got = real(*args, **kwargs)
      measured.extend(got)
      return got
    workdir = tempfile.mkdtemp(prefix="loka_timing_ahead_probe_")
    train_config = TrainConfig(steps=4, batch_size=BATCH, progress=False, log_every=0)
    probe_options = options(cache_dir, time=True, write_table=False, compile_workers=2)
    executables.clear()
    with mock.patch.object(kernel_timing, "measure_site", side_effect=counting):
      result = runner.run_probe(spec(), workdir, train_config, ProbeConfig(cadence=2),
                                probe_options)
    self.assertEqual(measured, [])                              # every shape came from the cache
    # Every evaluation call took a function compiled ahead (probe.executables), and the
    # functions compiled are the ones `describe_probe` counts from shapes alone.
    compiled = executables.counts()
    self.assertEqual(compiled["inline"], 0)
    self.assertGreater(compiled["ahead"], 0)
    described = runner.describe_probe(spec(), train_config, ProbeConfig(cadence=2),
                                      probe_options)
    self.assertEqual(compiled["compiled"], described["evaluation_functions"])
    self.assertTrue(result.complete)
    self.assertEqual(result.report["timing_source"]["cache"], done["cache"])
    for name, site in result.report["sites"].items():
      for p, per_kernel in site["passes"].items():
        for k in KERNELS:
          self.assertIsNotNone(per_kernel[k]["time_us"], (name, p, k))


if __name__ == "__main__":
  absltest.main()
