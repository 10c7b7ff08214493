"""Timings measured ahead (`experiments.probe` with `config.timing.only`): every distinct site
shape goes into the timing cache without training, and a later probe given that cache times
nothing (and compiles none of its evaluation on first call: `probe.executables`). A probe
whose sites are all evaluated finishes on a machine without its checkpoint, without training."""
import dataclasses
import json
import os
import shutil
import tempfile
from unittest import mock

import chex
from absl.testing import absltest

from loka_jax.probe import assemble, executables, kernel_timing, runner, training
from loka_jax.probe.collector import ProbeConfig
from loka_jax.train import OptimConfig, TrainConfig, experiment

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
    sites = training.probe_sites(model, None, batch, ProbeConfig())
    self.assertEqual(d["sites"], len(sites))
    # The state the probe creates, made in one program (not an eager op per array).
    stats = jax.jit(lambda: collector_lib.init_state(sites, ProbeConfig(), jnp.bfloat16))()
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
    # Every call of the statistics pass and of the evaluation took a function compiled ahead
    # (probe.executables), and the functions compiled are the ones `describe_probe` counts
    # from shapes alone.
    compiled = executables.counts()
    self.assertEqual(compiled["inline"], 0)
    self.assertGreater(compiled["ahead"], 0)
    described = runner.describe_probe(spec(), train_config, ProbeConfig(cadence=2),
                                      probe_options)
    self.assertEqual(described["statistics_functions"], 1 + described["sites"])  # 3 shapes
    self.assertEqual(compiled["compiled"],
                     described["evaluation_functions"] + described["statistics_functions"])
    self.assertTrue(result.complete)
    self.assertEqual(result.report["timing_source"]["cache"], done["cache"])
    for name, site in result.report["sites"].items():
      for p, per_kernel in site["passes"].items():
        for k in KERNELS:
          self.assertIsNotNone(per_kernel[k]["time_us"], (name, p, k))


class PaceTest(chex.TestCase):
  """A shape starts only if the caller's limit allows the slowest shape's length so far: a
  process that a hard limit kills mid-shape saves nothing of that shape."""

  def test_a_shape_that_would_overrun_the_budget_is_not_started(self):
    clock = mock.Mock()
    clock.time.side_effect = lambda: clock.now
    clock.now = 0.0
    started = []

    def measure(layout, kernels, dtype, cache, **kw):
      started.append(clock.now)
      clock.now += 100.0                 # every shape takes 100 s of the clock
      return [{"kernel": "fake"}]

    with mock.patch.object(kernel_timing, "on_gpu", return_value=True), \
        mock.patch.object(runner, "time", clock), \
        mock.patch.object(kernel_timing, "measure_site", side_effect=measure):
      should_stop = lambda expected_s: clock.now + expected_s > 250.0
      done = runner.time_site_shapes(spec(), BATCH, tempfile.mkdtemp(),
                                     options=options(None, should_stop=should_stop))
    self.assertGreaterEqual(done["shapes"], 3)
    # Shapes start at 0 and 100; at 200 one more would end at 300, past the 250 s budget,
    # though 200 itself is within it.
    self.assertEqual(started, [0.0, 100.0])
    self.assertEqual(done["pending"], done["shapes"])     # the fake timed nothing into the cache

  def test_the_slowest_unit_so_far_is_what_the_limit_is_asked_about(self):
    asked = []
    pace = assemble.Pace(lambda expected_s: asked.append(expected_s) or expected_s > 100.0)
    self.assertTrue(pace.may_start())
    pace.record(30.0)
    pace.record(150.0)
    pace.record(40.0)
    self.assertFalse(pace.may_start())
    self.assertEqual(asked, [0.0, 150.0])
    self.assertTrue(assemble.Pace(None).may_start())


class EvalCacheTest(absltest.TestCase):

  def test_a_torn_or_foreign_line_is_skipped_and_measured_again(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_eval_cache_"), runner.EVAL_CACHE)
    row = {"key": {"site": "a", "kernels": ["xla_bf16"]}, "passes": {}}
    with open(path, "w") as f:
      f.write(json.dumps(row) + "\n" + "[1, 2]\n" + '{"key": {"site": "b"')
    self.assertEqual(list(runner._read_eval_cache(path).values()), [[row]])
    # A row appended after the torn line starts a line of its own and is read.
    later = {"key": {"site": "c", "kernels": ["xla_bf16"]}, "passes": {}}
    runner.append_eval_rows(path, [later])
    self.assertEqual(list(runner._read_eval_cache(path).values()), [[row], [later]])


class WithoutTheCheckpointTest(chex.TestCase):
  """What travels between GPU hosts is the workdir's small files, never the checkpoint."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_config = TrainConfig(steps=4, batch_size=BATCH, progress=False, log_every=0)
    cls.options = options(None, time=False, compile_workers=0)
    cls.workdir = tempfile.mkdtemp(prefix="loka_probe_trained_")
    cls.first = runner.run_probe(spec(), cls.workdir, cls.train_config, ProbeConfig(cadence=2),
                                 cls.options)

  def fresh_host(self):
    """A workdir holding what travels: the evaluation cache and the trained summary."""
    fresh = tempfile.mkdtemp(prefix="loka_probe_fresh_")
    for name in (runner.EVAL_CACHE, runner.TRAINED_JSON):
      shutil.copy(os.path.join(self.workdir, name), fresh)
    return fresh

  def probe_without_training(self, workdir, probe_config=ProbeConfig(cadence=2)):
    with mock.patch.object(runner, "train", side_effect=AssertionError("trained again")):
      return runner.run_probe(spec(), workdir, self.train_config, probe_config, self.options)

  def test_every_site_evaluated_before_makes_the_same_report_without_training(self):
    self.assertTrue(self.first.complete)
    again = self.probe_without_training(self.fresh_host())
    self.assertTrue(again.complete)
    for key in ("sites", "overhead", "run", "evaluation", "timing_source"):
      self.assertEqual(again.report[key], self.first.report[key], key)

  def test_a_summary_written_before_the_cooldown_existed_still_fits(self):
    # The optimizer settings of the key, as probes wrote them before the cooldown existed:
    # a run without a cooldown keeps that key, so their trained statistics are reused.
    saved = json.load(open(os.path.join(self.workdir, runner.TRAINED_JSON)))
    self.assertEqual(sorted(saved["key"]["optim"]), [
        "adagrad_eps", "adagrad_initial_accumulator", "b1", "b2", "clip_norm",
        "embedding_learning_rate", "embedding_optimizer", "eps", "learning_rate",
        "warmup_steps", "weight_decay"])
    cooled = dataclasses.replace(self.train_config, optim=OptimConfig(cooldown_start=2,
                                                                      cooldown_steps=2))
    with mock.patch.object(runner, "train", side_effect=AssertionError("trained again")):
      with self.assertRaisesRegex(AssertionError, "trained again"):  # a cooldown is another run
        runner.run_probe(spec(), self.fresh_host(), cooled, ProbeConfig(cadence=2),
                         self.options)

  def test_it_trains_when_the_summary_or_cache_does_not_fit_the_run(self):
    other_settings = self.fresh_host()
    with self.assertRaisesRegex(AssertionError, "trained again"):  # another statistics cadence
      self.probe_without_training(other_settings, ProbeConfig(cadence=1))
    corrupt = self.fresh_host()
    with open(os.path.join(corrupt, runner.TRAINED_JSON), "w") as f:
      f.write('{"key": ')
    with self.assertRaisesRegex(AssertionError, "trained again"):
      self.probe_without_training(corrupt)
    one_site_missing = self.fresh_host()
    path = os.path.join(one_site_missing, runner.EVAL_CACHE)
    with open(path) as f:
      rows = f.readlines()
    self.assertEqual(len(rows), 3)
    with open(path, "w") as f:
      f.writelines(r for r in rows if json.loads(r)["key"]["site"] != "layer_0/fmb/fm_proj")
    with self.assertRaisesRegex(AssertionError, "trained again"):
      self.probe_without_training(one_site_missing)


if __name__ == "__main__":
  absltest.main()


class TimingFloorTest(chex.TestCase):
  """`min_timing_gflops`: shapes below it are not timed (no compile, no measurement), their
  passes say so, the report is complete, and selection keeps them in bf16."""

  def test_small_shapes_are_skipped_and_selected_bf16(self):
    from loka_jax import dispatch
    from loka_jax.probe.eligibility import Criteria
    model, source, _ = experiment.build_run(spec())
    setup_sites = runner._setup(spec(), BATCH, ProbeConfig(), options(None), None).sites
    gflops = sorted({assemble.shape_gflops(l) for _, l in assemble.distinct_shapes(
        setup_sites).values()})
    self.assertGreaterEqual(len(gflops), 2)
    floor = (gflops[0] + gflops[-1]) / 2            # the smallest shape below, the largest above
    small = {n for n, s in setup_sites.items() if assemble.shape_gflops(s.layout) < floor}
    self.assertTrue(small and small != set(setup_sites))

    timed_layouts = []
    real = kernel_timing.measure_site

    def recording(layout, *args, **kwargs):
      timed_layouts.append(assemble.shape_gflops(layout))
      return real(layout, *args, **kwargs)
    cache_dir = tempfile.mkdtemp(prefix="loka_timing_floor_")
    with mock.patch.object(kernel_timing, "on_gpu", return_value=True), \
        mock.patch.object(kernel_timing, "measure_site", side_effect=recording):
      ahead = runner.time_site_shapes(spec(), BATCH, cache_dir,
                                      options=options(cache_dir, min_timing_gflops=floor))
    self.assertTrue(timed_layouts and min(timed_layouts) >= floor)
    self.assertEqual(ahead["skipped"] + ahead["timed"], ahead["shapes"])
    self.assertGreater(ahead["skipped"], 0)
    described = runner.describe_probe(
        spec(), TrainConfig(steps=4, batch_size=BATCH, progress=False, log_every=0),
        options=options(None, min_timing_gflops=floor))
    self.assertEqual(described["shapes_to_time"], ahead["timed"])

    timed_layouts.clear()
    workdir = tempfile.mkdtemp(prefix="loka_timing_floor_probe_")
    # As on a GPU, so the report's timings are the ones selection reads.
    with mock.patch.object(kernel_timing, "on_gpu", return_value=True), \
        mock.patch.object(kernel_timing, "measure_site", side_effect=recording):
      result = runner.run_probe(
          spec(), workdir, TrainConfig(steps=4, batch_size=BATCH, progress=False, log_every=0),
          ProbeConfig(cadence=2), options(cache_dir, time=True, write_table=False,
                                          min_timing_gflops=floor))
    self.assertTrue(timed_layouts and min(timed_layouts) >= floor)
    self.assertTrue(result.complete, result.report.get("pending"))
    self.assertTrue(result.report["timing_valid"])
    self.assertEqual(result.report["timing_source"]["min_timing_gflops"], floor)
    for name, site in result.report["sites"].items():
      for p, per_kernel in site["passes"].items():
        for k in KERNELS:
          e = per_kernel[k]
          if name in small:
            self.assertEqual((e["timing"], e["time_us"], e["speedup"]),
                             (assemble.SKIPPED, None, None), (name, p, k))
          else:
            self.assertIsNotNone(e["time_us"], (name, p, k))
    plan = dispatch.select(result.report, Criteria())
    for name in small:
      for p in ("fwd", "grad_lhs", "grad_rhs"):
        choice = plan["sites"][name][p]
        self.assertEqual(choice["kernel"], "xla_bf16", (name, p))
        self.assertIn("min_timing_gflops", choice["reason"], (name, p))
