r"""Headline benchmark, resumable: bf16 vs the FP8 peers vs LoKA, speed and quality.

  python -m experiments.bench --suite={towers,models,quality,all} --workdir=DIR \
      [--only=wukong/large,4096x256x8] [--variants=...] [--max_minutes=6.5]

One process on one GPU. Speed rows (towers, models) go to DIR/bench.jsonl, one per (target,
variant), each with bf16 timed interleaved beside it in the same run; quality rows to
DIR/quality.jsonl, one per trained arm and seed. A rerun skips finished rows, so a suite
longer than one call (--max_minutes: no new row starts after it) finishes over several calls;
with --end_by_minutes (the call's hard end) a quality run starts whenever the longest run
recorded for its arm (else for its model) would still end by it, and a speed row whenever the
longest row of its variant (else of its target) would, also past --max_minutes, and not
otherwise (`experiments.bench.pace`).
The LoKA arm needs each target's plan (DIR/plans/<model>_<preset>/plan.json): a missing one is
probed first (--probe), resumably. Every call ends by writing DIR/report.md (tables and the
target checks), DIR/targets.json and PNG plots under DIR/plots/.

--mods (default: all) sets the Mods of the Mods arms (bf16_mods, bf16_mods_served, loka, and
quality's bf16_mods and loka) and of LoKA's probe, e.g. --mods=no_bias,blocknorm to see
whether a plan holds without Hard Swish. Another set than all is its own subject: its rows
carry `mods_set` and are compared only with one another, and its plans live under
DIR/plans/mods_<set>/. In the quality suite the arms without Mods (bf16 and its noise seeds,
naive and delayed FP8) are the same runs in every set: a set's comparison shares the default
set's rows of them, and only its Mods arms train.
"""
import os
import time

from absl import app, flags

from experiments import common_flags  # the common flags, defined once

SUITES = ("towers", "models", "quality", "all")
SUITE = flags.DEFINE_enum("suite", "models", SUITES, "Which benchmark suite.")
BENCH_DIR = flags.DEFINE_string("bench_dir", None, "Old name of --workdir (results directory).")
TOWERS = flags.DEFINE_list("towers", None, "Tower shapes BxWIDTHxDEPTH (default: the five).")
MODELS_FLAG = flags.DEFINE_list("models", None, "Models (default: all five).")
PRESETS = flags.DEFINE_list("presets", ["small", "large"], "Model presets (models suite).")
VARIANTS = flags.DEFINE_list("variants", ["all"],
                             "Speed variants: fp32, bf16, bf16_mods, bf16_mods_served "
                             "(inference from exported bf16 weights, as LoKA's), "
                             "flax_fp8_delayed, flax_fp8_delayed_fwd, flax_fp8_delayed_grad_lhs, "
                             "fp8_tensorwise, "
                             "fp8_rowwise, pallas, pallas_delayed (the one-pass delayed ops), "
                             "loka "
                             "(or 'all'); bf16 always runs.")
REPEATS = flags.DEFINE_integer("repeats", 20, "Timed repeats per variant (interleaved).")
MIN_CALL_MS = flags.DEFINE_float(
    "min_call_ms", None, "Steps shorter than this run N times in one jitted loop per timed "
    "call (N from the bf16 step, per mode), so host dispatch jitter is spread over N steps "
    "(default: loka_jax.timing.MIN_CALL_S, 5 ms).")
MAX_MINUTES = flags.DEFINE_float("max_minutes", 6.5, "Start no new row after this long.")
END_BY_MINUTES = flags.DEFINE_float(
    "end_by_minutes", None, "The call's hard end, in minutes from the start (e.g. the GPU "
    "call's limit less its upload). A quality run then starts whenever it is expected to end "
    "by it (the longest run recorded for its arm, else its model, at this preset, with a "
    "margin), also past --max_minutes, and a speed row the same way (the longest row of its "
    "variant, else of its target; a head-to-head row only before --max_minutes); before the "
    "first one is recorded --max_minutes rules.")
ONLY = flags.DEFINE_list("only", [], "Only these targets: 'model/preset', a model, a preset "
                         "or a tower shape.")
COMPILE_CACHE = flags.DEFINE_string("compile_cache", None,
                                    "Persistent compilation cache (default: WORKDIR/jax_cache).")
BATCH = flags.DEFINE_integer("batch_size", 0, "Batch size; 0: each preset's / tower's.")
PROBE = flags.DEFINE_bool("probe", True, "Probe targets whose LoKA plan is missing.")
HEAD_TO_HEAD = flags.DEFINE_list(
    "head_to_head", ["loka"],
    "Variants also timed against bf16+Mods, served bf16+Mods and the best peer, in one "
    "interleaving per pair, for their targets (they run last; the other arms stay alive "
    "until then). Empty: targets use the ratio of rows only.")
SERVE_PLAN = flags.DEFINE_bool(
    "serve_plan", False, "LoKA's inference serves the export of a serving plan (per site the "
    "fastest eligible forward judged on the forward alone, selected from the same probe "
    "report; plans/<target>/plan_serve.json) instead of its training plan's.")
SERVE_PROMOTION = flags.DEFINE_enum(
    "serve_promotion", "auto", ["auto", "on", "off"], "With --serve_plan, when the serving "
    "plan is first selected: time the export of its serving proposal (more forwards in FP8, "
    "judged on accuracy alone) against it and keep the faster. auto: on a GPU only.")
SERVE_QUALITY_GATE = flags.DEFINE_bool(
    "serve_quality_gate", True, "With --serve_plan, before a target's serving plan is first "
    "written: score the serving proposal, the selected serving plan and the training plan "
    "served from their exports on the probe's trained parameters (held-out log loss against "
    "served bf16+Mods, the 0.02% budget) and serve the first within it "
    "(plans/<target>/serve_quality.json); a proposal outside it is trimmed to its most "
    "accurate added forwards that stay within it.")
SERVE_QUALITY_BUDGET = flags.DEFINE_float(
    "serve_quality_budget", None, "The served-quality gate's budget: relative held-out "
    "log-loss change against served bf16+Mods (default: the 0.02% quality budget, "
    "`train.metrics.NEUTRAL_REL_LOGLOSS`).")
PROBE_STEPS = flags.DEFINE_integer("probe_steps", 100, "Training steps of each probe.")
HELD_OUT_ONE_PROGRAM = flags.DEFINE_bool(
    "validation_held_out_one_program", False, "Validation's held-out check measures a round's "
    "sites in one compiled program of switched sites instead of one program per site "
    "(`ValidationConfig.held_out_one_program`; on the H200 the values match within 0.06 "
    "standard errors; `experiments.held_out_sites --one_program` checks a model).")
GRADIENT_ONE_PROGRAM = flags.DEFINE_bool(
    "validation_gradient_one_program", False, "Validation's shadow check and check from "
    "initialization rank a round's sites by gradient change in one compiled program of "
    "switched sites instead of one gradient program per site "
    "(`ValidationConfig.gradient_one_program`; on the H200 within 0.1% of the per-site "
    "programs' values).")
PROMOTION_PER_SORT = flags.DEFINE_integer(
    "validation_promotion_per_sort", 1, "Kernels validation's speed promotion proposes per "
    "kernel sort (per-pass kernels, fused ops), those that lose least alone first; each is "
    "timed in the whole step (`ValidationConfig.promotion_per_sort`).")
STALLED_FRACTION = flags.DEFINE_float(
    "validation_stalled_fraction", 0.1, "A training check's round whose previous back-off "
    "took back less than this fraction of each diverged loss's excess over its bound steps "
    "down every site with an FP8 gradient pass at once instead of the ranking's next site "
    "(`ValidationConfig.stalled_fraction`; 0: one site a round).")
PROBE_SEED = flags.DEFINE_integer(
    "probe_seed", 0, "Seed of the probe run that makes a missing LoKA plan (both suites). "
    "Apart from --seed: quality runs at each seed share one plan and resume one probe.")
PROBE_SAMPLES = flags.DEFINE_integer("probe_samples", 32, "Draws per site of each probe's "
                                     "error evaluation (fewer: faster, wider CIs).")
PROBE_KERNELS = flags.DEFINE_list("probe_kernels", [], "Each probe's candidate kernels "
                                  "(default: every registered candidate).")
PROBE_TIMING_CACHE = flags.DEFINE_string(
    "probe_timing_cache", None, "Timings measured ahead by `experiments.probe --time_only` "
    "(a directory, e.g. carried to the GPU host): the probes skip their timing phase where "
    "it holds the shapes.")
compile_workers = common_flags.define_compile_workers()
TIMING_COMPILE_WORKERS = common_flags.define_timing_compile_workers()
MIN_TIMING_GFLOPS = common_flags.define_min_timing_gflops()
SHADOW_STEPS = flags.DEFINE_integer(
    "validation_shadow_steps", 200, "Steps of validation's shadow check from the probe's "
    "state (`ValidationConfig.shadow_steps`); 0 skips it, leaving the training verdict to "
    "--validation_from_init_steps. For a probe's state on a loss plateau that runs leave at "
    "their own times (Wukong `large` on an H200).",
    lower_bound=0)
SHADOW_WINDOWS = flags.DEFINE_integer(
    "validation_shadow_windows", 1, "Data windows of validation's shadow check from the "
    "probe's state, both runs per window; it judges the mean over windows "
    "(`ValidationConfig.shadow_windows`).")
SHADOW_NOISE_FLOOR = flags.DEFINE_bool(
    "validation_shadow_noise_floor", False, "Validation's shadow check also trains bf16+Mods "
    "from a jittered checkpoint in each data window and widens its bounds to two standard "
    "errors of that run's change (`ValidationConfig.shadow_noise_floor`).")
SELECT_WGRAD = flags.DEFINE_float(
    "select_min_sqnr_wgrad_db", None, "The selection's pessimistic-SQNR bar for FP8 weight "
    "gradients, apart from the input gradients' 20 dB (`Criteria.min_sqnr_wgrad_db`, as "
    "`experiments.dispatch --min_sqnr_wgrad_db`); a plan selected under another bar is "
    "selected again.")
SHADOW_WARMUP = flags.DEFINE_integer(
    "validation_shadow_warmup_steps", None, "Validation's shadow check warms both learning "
    "rates up again from 0 over N steps after switching the probe's state to the plan, in "
    "bf16+Mods' runs and the plan's alike (`ValidationConfig.shadow_warmup_steps`; default: "
    "none, the probe's rate on). For a probe state from early, fast-moving training.",
    lower_bound=1)
FROM_INIT_STEPS = flags.DEFINE_integer(
    "validation_from_init_steps", 0, "When a target's plan is made: validation's training "
    "from a fresh initialization, plan vs bf16+Mods, with the probe's recipe (0: skip).")
FROM_INIT_WARMUP = flags.DEFINE_integer(
    "validation_from_init_warmup_steps", None, "A linear learning-rate warm-up over N steps "
    "for that training (default: the probe's recipe, none); e.g. the quality runs' "
    "--quality_warmup_steps, so the check trains as the model is trained.")
FROM_INIT_CLIP = flags.DEFINE_float(
    "validation_from_init_clip_norm", None, "Global-norm clipping of the dense gradients in "
    "that training (default: the probe's recipe, none); e.g. the quality runs' "
    "--quality_clip_norm.")
FROM_INIT_SEEDS = flags.DEFINE_integer(
    "validation_from_init_seeds", 1, "Seeds of that training, both runs per seed; the "
    "verdict reads the mean over seeds (an early loss spike varies from seed to seed).")
FROM_INIT_QUALITY = flags.DEFINE_bool(
    "validation_from_init_quality_bound", False, "That training also fails a plan whose mean "
    "held-out log loss over the seeds is above the quality target's bound, max(0.02%, 2 x "
    "the bf16+Mods seeds' relative std), not only one that diverges (0.5%); with the "
    "quality runs' steps and warm-up it judges what the quality target does.")
PLANS = flags.DEFINE_string("plans_dir", None, "Plan directory (default: WORKDIR/plans).")
Q_PRESET = flags.DEFINE_string("quality_preset", "small", "Preset of the synthetic quality runs.")
Q_STEPS = flags.DEFINE_integer("quality_steps", 500, "Training steps of every quality arm.")
Q_MIN_EVAL = flags.DEFINE_integer("quality_eval", 200_000, "Held-out examples (>=, synthetic).")
Q_WARMUP = flags.DEFINE_integer(
    "quality_warmup_steps", 0, "Linear warm-up of both learning rates in the synthetic quality "
    "runs (0: none). Rows of each recipe are compared only with rows of the same one.",
    lower_bound=0)
Q_CLIP = flags.DEFINE_float(
    "quality_clip_norm", None, "Global-norm clipping of the dense gradients in the synthetic "
    "quality runs (default: none). Like the warm-up, a recipe of its own: its rows are "
    "compared only with rows of the same one.")
Q_NOISE = flags.DEFINE_list("noise_seeds", ["1", "2"], "Extra bf16 seeds (noise floor).")
Q_SEEDS = flags.DEFINE_list(
    "quality_seeds", [], "Synthetic quality: every --arms at each of these seeds, in place of "
    "--seed and the bf16 --noise_seeds (e.g. more paired seeds of two arms in one call: "
    "--arms=bf16_mods,loka --quality_seeds=1,2). Empty: --seed and --noise_seeds.")
Q_DATA = flags.DEFINE_list("quality_data", ["synthetic", "movielens"],
                           "Quality data: synthetic (every --models) and/or movielens.")
for _name in ("noise_seeds", "quality_seeds"):
  flags.register_validator(
      _name, lambda seeds: all(s.isdigit() for s in seeds) and len(set(seeds)) == len(seeds),
      message=f"--{_name} must list distinct non-negative integers, e.g. 1,2")
ML_MODELS = flags.DEFINE_list("ml_models", ["wukong", "interformer"], "MovieLens models.")
ML_PRESET = flags.DEFINE_string("ml_preset", "tiny", "MovieLens model preset.")
ML_STEPS = flags.DEFINE_integer("ml_steps", 600, "MovieLens training steps.")
ML_BATCH = flags.DEFINE_integer("ml_batch", 256, "MovieLens batch size.")
ML_SEEDS = flags.DEFINE_integer("ml_seeds", 5, "MovieLens seeds per arm.")
DETERMINISTIC = common_flags.define_xla_deterministic(
    "For --suite=quality only, since it slows the steps; rows record it.")
ARMS = flags.DEFINE_list("arms", ["bf16", "bf16_mods", "fp8_naive", "fp8_delayed", "loka"],
                        "Quality arms.")


def _setup(workdir: str) -> None:
  """Caches, XLA autotune persistence and deterministic ops; must run before JAX touches the
  GPU."""
  from loka_jax import xla_env
  os.makedirs(workdir, exist_ok=True)
  if DETERMINISTIC.value and SUITE.value != "quality":
    raise app.UsageError("--xla_deterministic is for --suite=quality only: it slows the "
                         "embeddings' backward, and the other suites time their steps")
  xla_env.add_xla_flags(xla_env.autotune_flag(os.path.join(workdir, "xla_autotune.textproto")),
                        *([xla_env.DETERMINISTIC] if DETERMINISTIC.value else []))
  import jax
  jax.config.update("jax_compilation_cache_dir",
                    COMPILE_CACHE.value or os.path.join(workdir, "jax_cache"))


def _log(message: str) -> None:
  print(f"[bench] {message}", flush=True)


def main(argv):
  del argv
  workdir = (common_flags.WORKDIR.value or BENCH_DIR.value or os.environ.get("OUT")
             or "bench_results")
  _setup(workdir)
  import jax
  from loka_jax import _compat
  from experiments.bench import mods_set, plots, quality, suite, tables, targets
  from experiments.bench.results import ResultsFile
  from experiments.bench.towers import TOWER_SHAPES
  from experiments.bench.variants import parse_variants
  from loka_jax.models.presets import MODEL_NAMES
  from loka_jax.train import experiment

  experiment.quiet_library_logs()

  if not _compat.on_gpu():
    _log("warning: not on a GPU; these timings are smoke tests, not results")
  start = time.time()
  deadline = start + MAX_MINUTES.value * 60
  end_by = None if END_BY_MINUTES.value is None else start + END_BY_MINUTES.value * 60
  if end_by is not None and end_by < deadline:
    # No row may start past the hard end: say so, and lose no call to a refusal.
    _log(f"warning: --max_minutes={MAX_MINUTES.value} is past --end_by_minutes="
         f"{END_BY_MINUTES.value}; no row starts after the latter")
    deadline = end_by
  device = jax.devices()[0].device_kind
  plans_dir = PLANS.value or os.path.join(workdir, "plans")
  speed_rows = ResultsFile(os.path.join(workdir, "bench.jsonl"), suite.KEY_FIELDS)
  quality_rows = ResultsFile(os.path.join(workdir, "quality.jsonl"), quality.KEY_FIELDS)
  variants = parse_variants(VARIANTS.value)
  try:
    mods = mods_set.of_flag(common_flags.MODS.value)
  except ValueError as e:
    raise app.UsageError(f"--mods: {e}") from e
  models = MODELS_FLAG.value or list(MODEL_NAMES)
  settings = suite.SpeedSettings(repeats=REPEATS.value, plans_dir=plans_dir, probe=PROBE.value,
                                 probe_steps=PROBE_STEPS.value,
                                 probe_samples=PROBE_SAMPLES.value,
                                 probe_kernels=tuple(PROBE_KERNELS.value),
                                 probe_timing_cache=PROBE_TIMING_CACHE.value,
                                 probe_compile_workers=compile_workers(),
                                 probe_timing_compile_workers=TIMING_COMPILE_WORKERS.value,
                                 probe_min_timing_gflops=MIN_TIMING_GFLOPS.value,
                                 validation_from_init_steps=FROM_INIT_STEPS.value,
                                 validation_from_init_warmup_steps=FROM_INIT_WARMUP.value,
                                 validation_from_init_clip_norm=FROM_INIT_CLIP.value,
                                 validation_from_init_seeds=FROM_INIT_SEEDS.value,
                                 validation_shadow_steps=SHADOW_STEPS.value,
                                 validation_shadow_windows=SHADOW_WINDOWS.value,
                                 validation_shadow_noise_floor=SHADOW_NOISE_FLOOR.value,
                                 validation_shadow_warmup_steps=SHADOW_WARMUP.value,
                                 select_min_sqnr_wgrad_db=SELECT_WGRAD.value,
                                 validation_from_init_quality_bound=FROM_INIT_QUALITY.value,
                                 validation_held_out_one_program=HELD_OUT_ONE_PROGRAM.value,
                                 validation_gradient_one_program=GRADIENT_ONE_PROGRAM.value,
                                 validation_promotion_per_sort=PROMOTION_PER_SORT.value,
                                 validation_stalled_fraction=STALLED_FRACTION.value,
                                 head_to_head=tuple(HEAD_TO_HEAD.value),
                                 serve_plan=SERVE_PLAN.value,
                                 serve_quality_gate=SERVE_QUALITY_GATE.value,
                                 **({} if SERVE_QUALITY_BUDGET.value is None else
                                    {"serve_quality_budget": SERVE_QUALITY_BUDGET.value}),
                                 serve_promotion={"auto": None, "on": True,
                                                  "off": False}[SERVE_PROMOTION.value],
                                 min_call_s=(suite.speed.MIN_CALL_S if MIN_CALL_MS.value is None
                                             else MIN_CALL_MS.value * 1e-3),
                                 seed=common_flags.SEED.value, probe_seed=PROBE_SEED.value,
                                 mods=mods)
  batch = BATCH.value or None
  _log(f"device {device}; suite {SUITE.value}; results under {workdir}")

  finished = True
  speed_targets = []
  if SUITE.value in ("towers", "all"):
    speed_targets += suite.tower_targets(TOWERS.value or TOWER_SHAPES, batch)
  if SUITE.value in ("models", "all"):
    speed_targets += suite.model_targets(models, PRESETS.value, batch)
  for target in suite.selected(speed_targets, ONLY.value):
    # Past --max_minutes a target's rows may still start by their recorded lengths
    # (`run_target` decides); past the hard end nothing does.
    if time.time() > (deadline if end_by is None else end_by):
      finished = False
      break
    finished &= suite.run_target(target, variants, speed_rows, settings=settings,
                                 deadline=deadline, device=device, log=_log, end_by=end_by)

  quality_runs = [os.path.join(workdir, quality.RUNS_FOLDER)]
  if SUITE.value in ("quality", "all"):
    runs = []
    noise = tuple(int(s) for s in Q_NOISE.value)
    if "synthetic" in Q_DATA.value:
      runs += [(m, quality.QualitySettings(
          data="synthetic", preset=Q_PRESET.value, steps=Q_STEPS.value, batch_size=batch,
          seed=common_flags.SEED.value, noise_seeds=noise,
          seeds=tuple(int(s) for s in Q_SEEDS.value), arms=tuple(ARMS.value),
          min_eval=Q_MIN_EVAL.value, plans_dir=plans_dir, warmup_steps=Q_WARMUP.value,
          clip_norm=Q_CLIP.value, mods=mods)) for m in models]
    if "movielens" in Q_DATA.value:
      runs += [(m, quality.QualitySettings(
          data="movielens", preset=ML_PRESET.value, steps=ML_STEPS.value,
          batch_size=ML_BATCH.value, seeds=tuple(range(ML_SEEDS.value)), arms=tuple(ARMS.value),
          data_cache=common_flags.DATA_CACHE.value,
          plans_dir=os.path.join(plans_dir, "movielens"), mods=mods)) for m in ML_MODELS.value]
    for model, qs in runs:
      names = (f"{model}/{qs.preset}", model, qs.preset, qs.data)
      if ONLY.value and not any(n in ONLY.value for n in names):
        continue
      if time.time() > (deadline if end_by is None else end_by):
        finished = False
        break
      finished &= quality.run_model(model, qs, quality_rows, quality_runs[0],
                                    deadline=deadline, device=device, log=_log,
                                    plan_maker=(suite.quality_plan_maker(qs, settings, deadline)
                                                if settings.probe else None),
                                    end_by=end_by)

  rows = list(speed_rows.rows()) + list(quality_rows.rows())
  verdicts = targets.check_all(rows)
  from loka_jax import jsonio
  jsonio.write_json_atomic(os.path.join(workdir, "targets.json"), verdicts)
  report = tables.report(rows, verdicts, quality_runs)
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(report + "\n")
  written = plots.write_plots(rows, os.path.join(workdir, "plots"), quality_runs=quality_runs)
  print(report)
  _log(f"plots: {', '.join(written) or 'none yet'}")
  _log(("all selected rows are done" if finished else "rows left for the next run (the "
        "deadline, a LoKA plan whose probe or validation has not finished, or a run folder "
        "that holds other settings); rerun the "
        "same command to continue") + f" ({time.time() - start:.0f}s)")


if __name__ == "__main__":
  app.run(main)
