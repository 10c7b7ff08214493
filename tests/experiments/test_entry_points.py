"""The config-driven mains (`python -m experiments.loka`, `experiments.train`, `probe`,
`dispatch`, `ablate_mods`, `kernels`, `profile_step`, `forget_rows`, `your_model`): --help
lists --config and exits 0, `--config.GROUP.FIELD=VALUE` overrides one field of the config file
and reaches the run, and a wrong field or value ends the program with one line naming it."""
import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest, parameterized

import report_builders as hm
from cli_helpers import load_config as load, run_module
from experiments import run_config
from loka_jax import dispatch
from loka_jax.probe.report import save_report

MAINS = (("loka",), ("train",))

# The grouping mains, their subcommands, and a flag of the first subcommand.
GROUPS = (("report", ("rows", "plan_headroom", "validation", "spikes", "kernel_usage",
                      "paired_spread", "hlo_scope"), "rows"),
          ("timing_cache", ("compare", "merge"), "out"),
          ("measure", ("held_out_sites", "shadow_arms", "serving_quality",
                       "delayed_warmup", "timing_check", "kernel_resources", "round_trip"),
           "kernels"))
# The other config-driven mains, each with whether it has a --workdir flag.
OTHER_MAINS = (("probe", True), ("dispatch", False), ("ablate_mods", True), ("kernels", False),
               ("profile_step", True), ("forget_rows", True), ("your_model", True))
# The benchmark mains driven by a config, each with whether it has a --workdir flag.
BENCH_MAINS = (("bench_kernels", False), ("bench_parallel", True))
# The suite's compilation cache (tests/conftest.py) for the bench mains, whose own defaults
# (~/.cache/loka_jax, /tmp/jc) would outlive the run.
SUITE_CACHE = f"--config.limits.compile_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}"


class EntryPointTest(parameterized.TestCase):

  @parameterized.parameters(*MAINS)
  def test_help_lists_the_config_flag_and_exits_0(self, name):
    done = run_module(f"experiments.{name}", "--help", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("--config:", done.stdout)
    self.assertIn(os.path.join("experiments", "configs", f"{name}.py"), done.stdout)
    self.assertIn("--workdir:", done.stdout)

  @parameterized.parameters(*OTHER_MAINS, *BENCH_MAINS)
  def test_help_of_the_other_mains_lists_the_config_flag_and_exits_0(self, name, workdir):
    done = run_module(f"experiments.{name}", "--help", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("--config:", done.stdout)
    self.assertIn(os.path.join("experiments", "configs", f"{name}.py"), done.stdout)
    self.assertEqual("--workdir:" in done.stdout, workdir)

  @parameterized.parameters(*MAINS)
  def test_an_override_changes_its_field_only(self, name):
    default = load(name)
    changed = load(name, "--config.run.steps=7", "--config.run.model=dlrm")
    self.assertEqual((changed.run.steps, changed.run.model), (7, "dlrm"))
    self.assertNotEqual(default.run.steps, 7)
    changed.run.steps, changed.run.model = default.run.steps, default.run.model
    self.assertEqual(changed.to_dict(), default.to_dict())

  @parameterized.parameters(*MAINS)
  def test_a_wrong_field_or_value_is_one_line_naming_it(self, name):
    for override, said in (("--config.run.steps=abc", "--config.run.steps=abc: invalid literal"),
                           ("--config.nonexistent=1", "--config.nonexistent: no field"),
                           ("--config.run.step=1", 'did you mean "steps"'),
                           ("--config.run.model=foo", "--config.run.model=foo: not one of")):
      done = run_module(f"experiments.{name}", override, "--workdir=" + tempfile.mkdtemp(),
                        timeout=120)
      self.assertEqual(done.returncode, 1, override)
      self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr[-2000:])
      self.assertIn(said.lower(), done.stderr.lower())
      self.assertTrue(done.stderr.startswith("error: "), done.stderr)


class OverrideReachesTheRunTest(absltest.TestCase):
  """A field set on the command line of each other main changes what that main does."""

  def test_probe(self):
    done = run_module("experiments.probe", "--config.describe=true", "--config.run.model=dlrm",
                      timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertTrue(done.stdout.startswith("dlrm/tiny: 6 sites"), done.stdout)

  def test_dispatch(self):
    workdir = tempfile.mkdtemp()
    report, out = (os.path.join(workdir, n) for n in ("probe_report.json", "plan.json"))
    kernels = {"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=(1.2, 1.3, 1.4))}
    save_report(hm.report({"top_mlp/dense_0": hm.site(hm.same_passes(kernels), lhs=(16, 52),
                                                      rhs=(52, 64))}), report)
    done = run_module("experiments.dispatch", f"--config.report={report}",
                      f"--config.out={out}", "--config.check=false",
                      "--config.select.objective=serve", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(dispatch.read_plan(out)["provenance"]["objective"], "serve")

  def test_ablate_mods(self):
    # The settings reach the library's AblationConfig, which refuses these before any arm.
    done = run_module("experiments.ablate_mods", "--config.ablation.precisions=bf16,fp16",
                      "--workdir=" + tempfile.mkdtemp(), timeout=120)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    self.assertIn("error: unknown precision 'fp16' for the ablation", done.stderr)
    done = run_module("experiments.ablate_mods", "--config.ablation.xla_deterministic=true",
                      "--workdir=" + tempfile.mkdtemp(), timeout=120)
    self.assertIn("use it with timing='off'", done.stderr)

  def test_kernels(self):
    path = os.path.join(tempfile.mkdtemp(), "check.json")
    done = run_module("experiments.kernels", "--config.check.only=xla_bf16",
                      "--config.check.m=8", "--config.check.n=24", f"--config.check.json={path}",
                      timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    with open(path) as f:
      report = json.load(f)
    self.assertEqual((report["shape"], list(report["verdicts"])),
                     ({"m": 8, "k": 384, "n": 24}, ["xla_bf16"]))

  def test_profile_step(self):
    step = {"steps": 1, "device_us_per_step": 10.0, "outside_sites_us": 4.0,
            "sites_us": {"mlp/dense_0": {"forward": 2.0, "backward": 4.0}},
            "classes_us": {"gemm_cublas": 6.0, "fusion": 4.0}, "top_kernels_us": []}
    path = os.path.join(tempfile.mkdtemp(), "saved.json")
    with open(path, "w") as f:
      json.dump({"target": "m/tiny", "device": "cpu", "sites": ["mlp/dense_0"],
                 "profiles": {"bf16 train": step}}, f)
    done = run_module("experiments.profile_step", f"--config.render={path}", timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("# Step profile: m/tiny on cpu", done.stdout)
    self.assertTrue(os.path.exists(path[:-len(".json")] + ".png"))

  def test_bench_kernels(self):
    # The smoke shapes run on the CPU; the fields reach the rows written.
    out = tempfile.mkdtemp()
    done = run_module("experiments.bench_kernels", f"--out={out}", "--config.select.smoke=true",
                      "--config.select.only=xla_fp8_tensorwise", "--config.timing.repeats=3",
                      SUITE_CACHE, timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    with open(os.path.join(out, "results.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual({(r["variant"], r["repeats"]) for r in rows},
                     {("xla_bf16", 3), ("xla_fp8_tensorwise", 3)})
    self.assertIn("| gemm_m64_k200_n96 | xla_fp8_tensorwise |", done.stdout)

  def test_bench_parallel(self):
    # One device on the CPU, DLRM (the cheapest tower to compile): the fields reach the speed
    # and loss rows written.
    workdir = tempfile.mkdtemp()
    done = run_module("experiments.bench_parallel", f"--workdir={workdir}",
                      "--config.run.model=dlrm", "--config.run.presets=tiny",
                      "--config.parallel.devices=1",
                      "--config.speed.repeats=3", "--config.loss.steps=4", SUITE_CACHE,
                      timeout=300)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    with open(os.path.join(workdir, "parallel.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual([(r["kind"], r["model"], r["preset"], r["variant"]) for r in rows],
                     [("speed", "dlrm", "tiny", "all"), ("loss", "dlrm", "tiny", "1dev")])
    self.assertEqual((rows[0]["repeats"], rows[1]["loss_steps"]), (3, 4))
    wrong = run_module("experiments.bench_parallel", f"--workdir={workdir}",
                       "--config.parallel.scaling=wide", timeout=120)
    self.assertEqual(wrong.stderr.strip(),
                     "error: --config.parallel.scaling=wide: not one of weak, strong")

  def test_forget_rows(self):
    # The suite names the results file the rows are looked for in.
    workdir = tempfile.mkdtemp()
    done = run_module("experiments.forget_rows", f"--workdir={workdir}",
                      "--config.forget.target=dhen/large", "--config.forget.variants=bf16",
                      "--config.forget.suite=quality", timeout=120)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    self.assertIn(f"error: nothing to forget: {workdir}/quality.jsonl", done.stderr)
    wrong = run_module("experiments.forget_rows", f"--workdir={workdir}",
                       "--config.forget.suite=tables", timeout=120)
    self.assertEqual(wrong.stderr.strip(), "error: --config.forget.suite=tables: not one of "
                     "models, towers, quality")

  def test_your_model(self):
    # Training the two-tower model is a GPU-size run; the settings are read before it starts.
    config = load("your_model", "--config.run.width=8", "--config.probe.kernels=xla_bf16, "
                  "xla_fp8_rowwise")
    self.assertEqual((config.run.steps, config.run.batch_size, config.run.width,
                      run_config.split(config.probe.kernels)),
                     (200, 8192, 8, ("xla_bf16", "xla_fp8_rowwise")))
    self.assertEqual(run_config.split(load("your_model").probe.kernels),
                     ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise", "flax_fp8_delayed"))
    done = run_module("experiments.your_model", "--workdir=" + tempfile.mkdtemp(),
                      "--config.run.steps=0", timeout=120)
    self.assertEqual(done.stderr.strip(), "error: --config.run.steps=0: must be >= 1")


class LokaConfigTest(absltest.TestCase):

  def test_the_defaults_are_the_main_jobs(self):
    config = load("loka")
    self.assertEqual((config.run.model, config.run.preset, config.run.data, config.run.mods,
                      config.run.steps, config.run.num_eval),
                     ("wukong", None, "synthetic", "all", 300, 2048))
    self.assertEqual((config.probe.steps, config.probe.cadence, config.probe.samples),
                     (100, 25, 8))
    self.assertIsNone(config.select.min_speedup)
    self.assertTrue(config.validate.enabled and config.arms.naive_fp8)
    # An unset preset takes a value; a float field takes an int's spelling.
    config = load("loka", "--config.run.preset=small", "--config.select.min_speedup=0")
    self.assertEqual((config.run.preset, config.select.min_speedup), ("small", 0.0))

  def test_run_spec_of_the_run_group(self):
    run = load("loka", "--config.run.mods=no_bias,keep_bias:cross_*",
               "--config.run.num_eval=0").run
    spec = run_config.run_spec(run, preset="tiny", precision="fp8_all")
    self.assertEqual((spec.model, spec.preset, spec.precision, spec.mods, spec.num_eval),
                     ("wukong", "tiny", "fp8_all", ("no_bias", "keep_bias:cross_*"), None))


class CompilationCacheTest(absltest.TestCase):
  """Every config-driven main turns on JAX's persistent compilation cache."""

  def setUp(self):
    super().setUp()
    import jax
    saved = {k: getattr(jax.config, k) for k in (
        "jax_compilation_cache_dir", "jax_enable_compilation_cache",
        "jax_persistent_cache_min_compile_time_secs")}
    self.addCleanup(lambda: [jax.config.update(k, v) for k, v in saved.items()])

  def test_the_directory_comes_from_the_config_else_the_environment_else_home(self):
    import jax
    with mock.patch.dict(os.environ, {"JAX_COMPILATION_CACHE_DIR": "/env/cache"}):
      self.assertEqual(run_config.use_compilation_cache("/given"), "/given")
      self.assertEqual(jax.config.jax_compilation_cache_dir, "/given")
      self.assertEqual(run_config.use_compilation_cache(None), "/env/cache")
    with mock.patch.dict(os.environ, {}, clear=True):
      self.assertEqual(run_config.use_compilation_cache(None),
                       os.path.join(os.path.expanduser("~"), ".cache", "loka_jax", "jax_cache"))
    self.assertIsNone(run_config.use_compilation_cache(""))
    self.assertFalse(jax.config.jax_enable_compilation_cache)

  def test_the_shortest_compile_cached_is_the_environments_else_half_a_second(self):
    import jax
    with mock.patch.dict(os.environ, {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.07"}):
      run_config.use_compilation_cache("/given")
      self.assertEqual(jax.config.jax_persistent_cache_min_compile_time_secs, 0.07)
    with mock.patch.dict(os.environ):
      os.environ.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
      run_config.use_compilation_cache("/given")
      self.assertEqual(jax.config.jax_persistent_cache_min_compile_time_secs,
                       run_config.CACHE_MIN_COMPILE_SECONDS)
    self.assertEqual(run_config.CACHE_MIN_COMPILE_SECONDS, 0.5)

  def test_a_train_run_fills_the_cache(self):
    with tempfile.TemporaryDirectory() as tmp:
      cache = os.path.join(tmp, "jax_cache")
      with mock.patch.dict(os.environ, {"JAX_COMPILATION_CACHE_DIR": cache}):
        out = run_module("experiments.train", f"--workdir={tmp}/run",
                         "--config.run.model=dlrm", "--config.run.steps=2",
                         "--config.run.batch_size=32",
                         "--config.run.num_eval=64")
      self.assertEqual(out.returncode, 0, out.stderr[-2000:])
      self.assertTrue(os.listdir(cache), "the train step's executable was not cached")


class TrainConfigTest(absltest.TestCase):

  def test_the_defaults_are_the_scripts(self):
    config = load("train")
    self.assertEqual((config.run.model, config.run.preset, config.run.precision,
                      config.run.mods, config.run.steps, config.run.num_eval),
                     ("wukong", "tiny", "bf16", "", 200, 0))
    self.assertEqual((config.train.log_every, config.train.checkpoint_every,
                      config.train.keep_checkpoints, config.train.nan_policy),
                     (50, 1000, 3, "stop"))
    self.assertEqual((config.drift.every, config.parallel.mesh), (0, None))
    spec = run_config.run_spec(load("train", "--config.run.precision=loka",
                                    "--config.run.plan=p.json").run)
    self.assertEqual((spec.precision, spec.plan, spec.mods, spec.num_eval),
                     ("loka", "p.json", (), None))


class GroupingMainTest(parameterized.TestCase):
  """The grouping mains (`python3 -m experiments.GROUP NAME`): --help lists the subcommands
  and exits 0, and NAME --help prints that tool's docstring and flags and exits 0."""

  @parameterized.parameters(*GROUPS)
  def test_help_lists_the_subcommands_and_each_ones_flags(self, group, names, flag):
    done = run_module(f"experiments.{group}", "--help", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    for name in names:
      self.assertIn(f"\n  {name} ", done.stdout)
    done = run_module(f"experiments.{group}", names[0], "--help", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn(f"python3 -m experiments.{group} {names[0]}", done.stdout)
    self.assertIn(f"--{flag}:", done.stdout)
    unknown = run_module(f"experiments.{group}", "nonexistent", timeout=120)
    self.assertEqual(unknown.returncode, 1)
    self.assertIn("no subcommand 'nonexistent'", unknown.stderr)


class BenchConfigTest(absltest.TestCase):
  """`python -m experiments.bench`: the common config (models suite) and one file per suite."""

  def test_help_lists_the_config_flag_and_exits_0(self):
    done = run_module("experiments.bench", "--help", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("--config:", done.stdout)
    self.assertIn(os.path.join("experiments", "configs", "bench.py"), done.stdout)
    self.assertIn("--workdir:", done.stdout)

  def test_an_override_reaches_the_suite_settings(self):
    from experiments.bench import settings
    default = settings.from_config(load("bench_towers"), "/w")
    call = settings.from_config(load(
        "bench_towers", "--config.speed.repeats=7", "--config.targets.towers=32x16x2",
        "--config.validation.shadow_steps=0", "--config.serving.promotion=off",
        "--config.targets.mods=no_bias,blocknorm", "--config.pacing.end_by_minutes=2"), "/w")
    self.assertEqual((default.suite, default.speed.repeats, len(default.speed_targets)),
                     ("towers", 20, 5))
    self.assertEqual((call.speed.repeats, [t.preset for t in call.speed_targets]),
                     (7, ["32x16x2"]))
    self.assertEqual((call.speed.validation_shadow_steps, call.speed.serve_promotion,
                      call.speed.mods, call.end_by_minutes),
                     (0, False, ("no_bias", "blocknorm"), 2.0))
    self.assertEqual((call.speed.plans_dir, call.compile_cache), ("/w/plans", "/w/jax_cache"))
    # The quality suite's file: its runs take the common groups' fields too.
    runs = settings.from_config(load("bench_quality", "--config.quality.data=synthetic",
                                     "--config.targets.models=dlrm,wukong",
                                     "--config.quality.steps=9"), "/w").quality_runs
    self.assertEqual([(m, qs.data, qs.steps) for m, qs in runs],
                     [("dlrm", "synthetic", 9), ("wukong", "synthetic", 9)])
    # A cooldown reaches the runs of its data set only, and one longer than the run's steps
    # is refused naming the field.
    runs = settings.from_config(load(
        "bench_quality", "--config.quality.data=synthetic,movielens",
        "--config.targets.models=dlrm", "--config.quality.movielens.models=dlrm",
        "--config.quality.cooldown_steps=100", "--config.quality.movielens.cooldown_steps=200"),
        "/w").quality_runs
    self.assertEqual([(qs.data, qs.cooldown_steps, qs.optim.cooldown_start) for _, qs in runs],
                     [("synthetic", 100, 400), ("movielens", 200, 400)])
    with self.assertRaisesRegex(ValueError, r"--config.quality: cooldown_steps must be in "
                                r"\[0, steps - warmup_steps = 450\], got 451"):
      settings.from_config(load("bench_quality", "--config.quality.data=synthetic",
                                "--config.quality.warmup_steps=50",
                                "--config.quality.cooldown_steps=451"), "/w")
    with self.assertRaisesRegex(ValueError, "quality.movielens.cooldown_steps"):
      settings.from_config(load("bench_quality", "--config.quality.data=movielens",
                                "--config.quality.movielens.cooldown_steps=-1"), "/w")

  def test_each_quality_model_drops_its_compiled_programs_before_the_next(self):
    # A long CPU call keeps every program it compiled unless told, until the process runs
    # out of memory mappings: after each model, jax's caches and the probe's executables
    # compiled ahead are dropped.
    import jax
    from experiments.bench import call as call_lib, quality, settings
    from loka_jax.probe import executables
    workdir = tempfile.mkdtemp(prefix="loka_bench_clear_")
    bench_call = settings.from_config(load(
        "bench_quality", "--config.quality.data=synthetic", "--config.targets.models=dlrm,wukong",
        "--config.probe.enabled=false"), workdir)
    events = []
    with mock.patch.object(quality, "run_model",
                           side_effect=lambda model, *a, **k: events.append(model) or True), \
         mock.patch.object(jax, "clear_caches", side_effect=lambda: events.append("jax")), \
         mock.patch.object(executables, "clear", side_effect=lambda: events.append("probe")), \
         mock.patch.object(call_lib, "write_report"):
      self.assertTrue(call_lib.run(bench_call, workdir, log=lambda _: None))
    self.assertEqual(events, ["dlrm", "probe", "jax", "wukong", "probe", "jax"])

  def test_a_wrong_value_is_one_line_naming_it(self):
    done = run_module("experiments.bench", "--config.speed.variants=bf16,fp9",
                      "--workdir=" + tempfile.mkdtemp(), timeout=120)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr[-2000:])
    self.assertTrue(done.stderr.startswith("error: --config.speed.variants=bf16,fp9: unknown "
                                           "variant(s) ['fp9']"), done.stderr)


if __name__ == "__main__":
  absltest.main()
