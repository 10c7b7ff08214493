"""How the bench plans its LoKA arms on the CPU: selection from a probe report, validation
from the initial state and the quality suite's plans."""
import os
import tempfile
import time
from unittest import mock

from absl.testing import absltest

from bench_rows import tempdir
from loka_jax import dispatch
from experiments.bench import forget, planning, quality, suite, towers, variants
from experiments.bench.results import ResultsFile


def _probe_and_plan_kwargs(target, settings):
  """The keyword arguments the bench's probe for `target`'s plan gives the pipeline."""
  with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
    suite._probe_for_plan(target, settings, deadline=time.time() + 600, log=lambda line: None)
  return probe_and_plan.call_args.kwargs


class SelectionTest(absltest.TestCase):

  def test_plans_are_validated_on_up_to_16_batches_of_held_out_examples(self):
    (wukong,) = suite.model_targets(["wukong"], ["large"])
    self.assertEqual(wukong.batch(), 4096)
    self.assertEqual(wukong.run_spec().num_eval, 65536)
    (big, small) = suite.tower_targets(["16384x4096x4", "32x16x2"])
    self.assertEqual(big.plan_eval_examples(), 65536)       # 4 batches
    self.assertEqual(small.plan_eval_examples(), 16 * 32)   # 16 batches
    _, source, _ = small.probe_build()(small.run_spec())
    self.assertEqual(source.num_eval_examples(), 512)

  def test_only_filters_targets(self):
    ts = suite.tower_targets(["64x32x2", "128x64x2"]) + suite.model_targets(
        ["dlrm", "wukong"], ["small", "large"])
    self.assertEqual([t.name for t in suite.selected(ts, ["wukong/large", "128x64x2"])],
                     ["tower/128x64x2", "wukong/large"])
    self.assertEqual([t.name for t in suite.selected(ts, ["dlrm"])],
                     ["dlrm/small", "dlrm/large"])
    self.assertLen(suite.selected(ts, []), 6)

  def test_variants_parse_puts_bf16_first_and_rejects_unknown(self):
    self.assertEqual([v.name for v in variants.parse_variants(["loka", "bf16_mods"])],
                     ["bf16", "loka", "bf16_mods"])
    with self.assertRaisesRegex(ValueError, "fp9"):
      variants.parse_variants(["fp9"])

  def test_tower_shape_parse(self):
    s = towers.TowerShape.parse("16384x4096x4")
    self.assertEqual((s.batch, s.width, s.depth), (16384, 4096, 4))
    self.assertEqual(s.flops_per_example(), 2 * 4096 * 4096 * 4 + 2 * 4096)
    with self.assertRaisesRegex(ValueError, "BxWIDTHxDEPTH"):
      towers.TowerShape.parse("4096x256")

  def test_quality_eval_size_and_runs(self):
    self.assertEqual(quality.num_eval_for(200_000, 4096), 200_704)  # 49 x 4096
    settings = quality.QualitySettings(arms=("bf16", "loka"), noise_seeds=(1, 2))
    self.assertEqual([(a.name, s) for a, s in quality.runs(settings)],
                     [("bf16", 0), ("loka", 0), ("bf16", 1), ("bf16", 2)])
    ml = quality.QualitySettings(data="movielens", arms=("bf16",), seeds=tuple(range(5)))
    self.assertLen(quality.runs(ml), 5)


class ValidationFromInitTest(absltest.TestCase):

  def test_a_target_probed_for_its_plan_is_validated_from_init_as_asked(self):
    # `--validation_from_init_steps`, its warm-up, clipping and seeds reach the validation of the
    # plan the suite makes.
    (target,) = suite.tower_targets(["64x32x2"])
    plans = tempfile.mkdtemp(prefix="loka_bench_from_init_")
    for steps, warmup, clip, seeds, on in ((0, None, None, 1, False),
                                           (7, 3, 0.5, 2, True)):
      settings = suite.SpeedSettings(plans_dir=plans, validation_from_init_steps=steps,
                                     validation_from_init_warmup_steps=warmup,
                                     validation_from_init_clip_norm=clip,
                                     validation_from_init_seeds=seeds,
                                     validation_from_init_quality_bound=on,
                                     validation_held_out_one_program=on,
                                     validation_gradient_one_program=on,
                                     validation_shadow_windows=seeds + 1,
                                     validation_shadow_noise_floor=on,
                                     validation_promotion_per_sort=seeds + 2,
                                     validation_stalled_fraction=0.05 * seeds,
                                     validation_shadow_warmup_steps=warmup,
                                     validation_shadow_steps=steps)
      validation = _probe_and_plan_kwargs(target, settings)["validation"]
      self.assertEqual((validation.from_init_steps, validation.from_init_warmup_steps,
                        validation.from_init_clip_norm, validation.from_init_seeds,
                        validation.from_init_quality_bound, validation.held_out_one_program,
                        validation.gradient_one_program, validation.shadow_windows,
                        validation.shadow_noise_floor, validation.promotion_per_sort,
                        validation.stalled_fraction, validation.shadow_warmup_steps,
                        validation.shadow_steps),
                       (steps, warmup, clip, seeds, on, on, on, seeds + 1,
                        on, seeds + 2, 0.05 * seeds, warmup, steps))

  def test_the_suites_validation_defaults_are_the_configs(self):
    # A setting not given on the command line leaves the check as `ValidationConfig` has it
    # (the shadow check's 200 steps among them).
    from loka_jax.dispatch.validate import ValidationConfig
    self.assertEqual(suite.SpeedSettings().validation(), ValidationConfig())

  def test_the_probes_timing_floor_compile_threads_and_wgrad_bar_reach_its_options(self):
    (target,) = suite.tower_targets(["64x32x2"])
    plans = tempfile.mkdtemp(prefix="loka_bench_floor_")
    for floor, workers, wgrad in ((0.0, None, None), (2.5, 0, -3.0)):
      settings = suite.SpeedSettings(plans_dir=plans, probe_min_timing_gflops=floor,
                                     probe_compile_workers=workers,
                                     select_min_sqnr_wgrad_db=wgrad)
      kwargs = _probe_and_plan_kwargs(target, settings)
      options = kwargs["probe_options"]
      self.assertEqual((options.min_timing_gflops, options.compile_workers), (floor, workers))
      self.assertEqual(kwargs["criteria_changes"],
                       None if wgrad is None else {"min_sqnr_wgrad_db": wgrad})


class QualityPlanMakerTest(absltest.TestCase):

  def test_every_quality_seed_probes_one_run_with_the_suites_probe_options(self):
    # The quality suite makes a missing plan with the speed suite's probe options (the
    # carried timing cache above all: without it every site is timed again) and at the
    # probe seed, whatever the quality seed: each seed's invocation resumes the same probe.
    out = tempdir(self)
    settings = suite.SpeedSettings(plans_dir=os.path.join(out, "plans"), probe_steps=7,
                                   probe_samples=5, probe_kernels=("xla_bf16", "xla_fp8_rowwise"),
                                   probe_timing_cache=os.path.join(out, "tc"),
                                   probe_compile_workers=3, probe_timing_compile_workers=2,
                                   probe_min_timing_gflops=1.5, validation_from_init_steps=9,
                                   probe_seed=4)
    calls = []
    for seed in (0, 2):
      qs = quality.QualitySettings(preset="tiny", seed=seed, batch_size=64,
                                   plans_dir=os.path.join(out, "plans"),
                                   mods=("no_bias", "blocknorm"))
      with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
        suite.quality_plan_maker(qs, settings, deadline=time.time() + 600)("dlrm")
      calls.append(probe_and_plan.call_args)
    for call in calls:
      spec, workdir = call.args
      options, config = call.kwargs["probe_options"], call.kwargs["train_config"]
      self.assertEqual((spec.model, spec.preset, spec.mods, spec.seed, config.seed),
                       ("dlrm", "tiny", ("no_bias", "blocknorm"), 4, 4))
      self.assertEqual((config.steps, config.batch_size), (7, 64))
      self.assertEqual((options.samples, options.kernels, options.timing_cache,
                        options.compile_workers, options.timing_compile_workers,
                        options.min_timing_gflops),
                       (5, ("xla_bf16", "xla_fp8_rowwise"), os.path.join(out, "tc"), 3, 2, 1.5))
      self.assertEqual(call.kwargs["validation"].from_init_steps, 9)
      self.assertEqual(workdir, planning.plan_dir(qs.plans_root, "dlrm", "tiny"))
    self.assertNotIn("default", calls[0].args[1])  # the set's own folder
    self.assertIn("mods_", calls[0].args[1])

  def test_the_error_budget_alone_probes_in_its_own_folder_without_the_speed_rule(self):
    # LoKA under the error budget alone: its own probe, plan and validation (a folder under
    # the quality plans), the speed rule off beside the budget's other changes, and no speed
    # promotion or speed check to hand slow FP8 sites back to bf16. LoKA's own is unchanged.
    out = tempdir(self)
    settings = suite.SpeedSettings(plans_dir=os.path.join(out, "plans"),
                                   select_min_sqnr_wgrad_db=12.0)
    qs = quality.QualitySettings(preset="tiny", batch_size=64,
                                 plans_dir=os.path.join(out, "plans"))
    calls = {}
    for accuracy_only in (False, True):
      with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
        suite.quality_plan_maker(qs, settings, deadline=time.time() + 600)(
            "dlrm", accuracy_only=accuracy_only)
      calls[accuracy_only] = probe_and_plan.call_args
    loka, accuracy = calls[False], calls[True]
    self.assertEqual(loka.args[1], planning.plan_dir(qs.plans_root, "dlrm", "tiny"))
    self.assertEqual(accuracy.args[1], planning.plan_dir(
        os.path.join(qs.plans_root, "accuracy_only"), "dlrm", "tiny"))
    self.assertEqual(loka.kwargs["criteria_changes"], {"min_sqnr_wgrad_db": 12.0})
    self.assertEqual(accuracy.kwargs["criteria_changes"],
                     {"min_sqnr_wgrad_db": 12.0, "min_speedup": None})
    self.assertEqual((loka.kwargs["validation"].speed, loka.kwargs["validation"].promote),
                     (None, None))
    self.assertEqual((accuracy.kwargs["validation"].speed,
                      accuracy.kwargs["validation"].promote), (False, False))

  def test_the_error_budget_alone_starts_from_lokas_trained_statistics(self):
    # Both probes train and evaluate the same run: the second takes the first's summary and
    # evaluations (appended to what it evaluated itself) before it starts, and only once.
    from loka_jax.probe.runner import EVAL_CACHE, TRAINED_JSON
    out = tempdir(self)
    settings = suite.SpeedSettings(plans_dir=os.path.join(out, "plans"))
    qs = quality.QualitySettings(preset="tiny", batch_size=64,
                                 plans_dir=os.path.join(out, "plans"))
    loka_probe = os.path.join(planning.plan_dir(qs.plans_root, "dlrm", "tiny"), "probe")
    accuracy_probe = os.path.join(planning.plan_dir(
        os.path.join(qs.plans_root, "accuracy_only"), "dlrm", "tiny"), "probe")

    def probe(accuracy_only):
      seen = {}

      def probe_and_plan(spec, workdir, **kwargs):
        for name in (EVAL_CACHE, TRAINED_JSON):
          path = os.path.join(workdir, "probe", name)
          seen[name] = open(path).read() if os.path.exists(path) else None
      with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan",
                      side_effect=probe_and_plan):
        suite.quality_plan_maker(qs, settings, deadline=time.time() + 600)(
            "dlrm", accuracy_only=accuracy_only)
      return seen

    self.assertEqual(probe(True), {EVAL_CACHE: None, TRAINED_JSON: None})  # LoKA's not yet
    os.makedirs(loka_probe)
    for name, text in ((EVAL_CACHE, '{"site": "a"}\n{"site": "b"}\n'),
                       (TRAINED_JSON, '{"fingerprint": "loka"}')):
      with open(os.path.join(loka_probe, name), "w") as f:
        f.write(text)
    os.makedirs(accuracy_probe)
    with open(os.path.join(accuracy_probe, EVAL_CACHE), "w") as f:
      f.write('{"site": "own"}\n{"site": "to')  # its own line, then one torn by a kill
    self.assertEqual(probe(False), {EVAL_CACHE: '{"site": "a"}\n{"site": "b"}\n',
                                    TRAINED_JSON: '{"fingerprint": "loka"}'})
    self.assertEqual(probe(True), {
        EVAL_CACHE: '{"site": "own"}\n{"site": "to\n{"site": "a"}\n{"site": "b"}\n',
        TRAINED_JSON: '{"fingerprint": "loka"}'})
    # Its own summary from then on: nothing is copied over it, nor appended again.
    with open(os.path.join(accuracy_probe, TRAINED_JSON), "w") as f:
      f.write('{"fingerprint": "own"}')
    self.assertEqual(probe(True)[TRAINED_JSON], '{"fingerprint": "own"}')
    self.assertEqual(open(os.path.join(accuracy_probe, EVAL_CACHE)).read().count('"a"'), 1)

  def test_a_loka_arm_waiting_for_its_plan_leaves_the_model_unfinished(self):
    # A probe that ran out of budget returns no plan: the model's rows are not done (the
    # bench must not print "all selected rows are done", nor a queue move on); the next run
    # with the plan made records the LoKA row.
    out = tempdir(self)
    settings = quality.QualitySettings(preset="tiny", steps=2, batch_size=64, min_eval=64,
                                       noise_seeds=(), arms=("bf16_mods", "loka"),
                                       plans_dir=os.path.join(out, "plans"))
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    logs = []
    self.assertFalse(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                       device="cpu", log=logs.append,
                                       plan_maker=lambda model, accuracy_only: None))
    self.assertEqual([r["arm"] for r in results.rows()], ["bf16_mods"])
    self.assertTrue(any("loka seed 0: left for a later run, no plan at" in line
                        for line in logs), logs)

    def plan_made(model, accuracy_only):
      path = planning.plan_path(settings.plans_root, model, settings.preset)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      dispatch.save_plan({"schema": "loka.plan/1", "sites": {},
                          "default": {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}},
                         path)
      return path
    self.assertTrue(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                      device="cpu", log=logs.append, plan_maker=plan_made))
    self.assertEqual([r["arm"] for r in results.rows()], ["bf16_mods", "loka"])

  def test_a_run_folder_with_other_settings_is_not_recorded_and_forget_rows_clears_it(self):
    # A row forgotten without its run folder leaves a run the next settings cannot resume:
    # the arm is refused, left unrecorded and the model unfinished (recorded as an error row
    # it would read as done). `forget` moves the folder with the row, and the arm runs.
    out = tempdir(self)
    path = os.path.join(out, "quality.jsonl")
    root = os.path.join(out, quality.RUNS_FOLDER)

    def settings(batch):
      return quality.QualitySettings(preset="tiny", steps=2, batch_size=batch, min_eval=64,
                                     noise_seeds=(), arms=("bf16",),
                                     plans_dir=os.path.join(out, "plans"))

    def run(batch, logs):
      results = ResultsFile(path, quality.KEY_FIELDS)
      done = quality.run_model("dlrm", settings(batch), results, root, deadline=float("inf"),
                               device="cpu", log=logs.append)
      return done, [(r["arm"], r.get("batch_size"), "error" in r)
                    for r in ResultsFile(path, quality.KEY_FIELDS).rows()]

    self.assertEqual(run(64, []), (True, [("bf16", 64, False)]))
    with open(path, "w"):  # the row forgotten by hand, its folder left
      pass
    logs = []
    self.assertEqual(run(32, logs), (False, []))
    self.assertTrue(any("not run: run directory" in line and "forget_rows" in line
                        for line in logs), logs)
    self.assertEqual(run(64, []), (True, [("bf16", 64, False)]))   # its own settings resume
    forget.forget(out, suite="quality", model="dlrm", preset="tiny", names=["bf16"])
    self.assertEqual(run(32, []), (True, [("bf16", 32, False)]))

  def test_the_speed_suites_probe_runs_at_the_probe_seed_too(self):
    (target,) = suite.tower_targets(["64x32x2"])
    spec, config = suite.probe_run(target, suite.SpeedSettings(seed=3, probe_seed=5))
    self.assertEqual((spec.seed, config.seed), (5, 5))

  def test_no_probe_starts_too_close_to_the_deadline(self):
    qs = quality.QualitySettings(preset="tiny")
    with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
      got = suite.quality_plan_maker(qs, suite.SpeedSettings(),
                                     deadline=time.time() + suite.MIN_PROBE_BUDGET_S - 5)("dlrm")
    self.assertIsNone(got)
    probe_and_plan.assert_not_called()

  def test_a_probe_that_cannot_fit_the_card_leaves_the_target_without_a_plan(self):
    from loka_jax.probe import memory
    from loka_jax.train import TrainConfig, experiment
    spec = experiment.RunSpec(model="wukong", preset="tiny", mods=("all",), num_eval=256)
    config = TrainConfig(steps=4, batch_size=64, progress=False, log_every=0)
    with mock.patch("builtins.print") as printed, \
         mock.patch.object(memory, "device_limit", return_value=("a 1 MB card", 1_000_000)):
      got = planning.make_plan(spec, tempdir(self), config, budget_s=600, samples=2,
                               kernels=("xla_bf16",))
    self.assertIsNone(got)
    said = " ".join(str(c.args[0]) for c in printed.call_args_list if c.args)
    self.assertIn("[bench] no plan for wukong/tiny: the probe cannot fit", said)


if __name__ == "__main__":
  absltest.main()
