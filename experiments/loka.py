"""The main job: probe -> dispatch -> validate, then train bf16+Mods, the plan (Mods + plan)
and naive FP8 (one kernel everywhere, same Mods) side by side, and report.

  python -m experiments.loka [--workdir=loka_run --model=wukong --preset=tiny --steps=300]

The embedded default is Wukong `tiny` on synthetic data on a CPU, `small` when a GPU is
present (--preset overrides). Every arm uses the same seed, data order and held-out set.
Writes, in --workdir (default ./loka_run):
  probe_report.json, plan_selected.json, plan.json   (loka_jax/dispatch/pipeline.py)
  probe/                   the probe's bf16+Mods training run
  arms/<arm>/              each arm's metrics.jsonl, final.json, checkpoints (the LoKA
                           arm's directory is named by its plan's kernel digest)
  report.md                the per-site plan, its validation, NE/AUC/log loss of the arms,
                           speed where valid
  plan.png, arms.png       the plan (kernel per site and pass, sites per kernel), the
                           training loss and held-out NE of the arms
Rerunning resumes every part (delete a file or directory to redo it).
"""
import os
import time

import jax
from absl import app, flags, logging

from loka_jax import _compat
from experiments import common_flags as common
from experiments.bench import headroom
from loka_jax.dispatch import kernel_counts, pipeline
from loka_jax.dispatch import validate as validate_lib
from loka_jax.kernels import KernelPlan
from loka_jax.probe.collector import ProbeConfig
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.runner import ProbeOptions
from loka_jax.train import OptimConfig, TrainConfig, experiment, report
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
NUM_EVAL = flags.DEFINE_integer("num_eval", 2048, "Held-out examples (0: the source's default).")
PROBE_STEPS = flags.DEFINE_integer("probe_steps", 100, "Training steps of the probe run.")
CADENCE = flags.DEFINE_integer("cadence", 25, "Probe statistics pass every N steps.")
SAMPLES = flags.DEFINE_integer("samples", 8, "Probe draws per site and source.")
PROBE_KERNELS = flags.DEFINE_list(
    "probe_kernels", [], "Candidate kernels; empty: on a CPU xla_bf16, xla_fp8_tensorwise and "
    "xla_fp8_rowwise (their fast-accumulation twins compute the same there), on a GPU the "
    "probe's default list.")
PROBE_SITES = flags.DEFINE_string("probe_sites", None,
                                  "Regex: probe only these sites (others stay bf16).")
MAX_REL_LOGLOSS = flags.DEFINE_float("max_rel_logloss", NEUTRAL_REL_LOGLOSS,
                                     "Held-out relative log-loss budget of validation.")
SHADOW_STEPS = flags.DEFINE_integer("shadow_steps", 200, "Shadow training steps (0: skip).")
FROM_INIT_STEPS = flags.DEFINE_integer(
    "from_init_steps", 0, "Validation's training from a fresh initialization, plan vs "
    "bf16+Mods, with the probe's recipe (0: skip). The other checks start from the probe's "
    "trained state and cannot see early training.")
FROM_INIT_SEEDS = flags.DEFINE_integer(
    "from_init_seeds", 1, "Seeds of that training, both runs per seed; the verdict reads the "
    "mean over seeds.")
VALIDATE = flags.DEFINE_bool("validate", True, "Validate the plan end to end.")
NAIVE_FP8 = flags.DEFINE_bool("naive_fp8", True,
                              "Also train the naive arm: --kernel on every site, same Mods.")
MIN_SPEEDUP = flags.DEFINE_float(
    "min_speedup", None, "Speed rule of the selection: unset, the default budget (1.05x when "
    "timings are known); <= 0, accuracy only (what the error budget alone admits).")
compile_workers = common.define_compile_workers()
COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", os.path.join(os.path.expanduser("~"), ".cache", "loka_jax", "jax_cache"),
    "Persistent XLA compilation cache ('' disables); reruns compile much less.")

CPU_KERNELS = ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise")


def _spec(**overrides) -> experiment.RunSpec:
  mods = experiment.parse_mods(common.MODS.value) or ("all",)
  return experiment.RunSpec(
      model=common.MODEL.value, preset=_preset(), data=common.DATA.value,
      data_spec=common.DATA_SPEC.value, data_path=common.DATA_PATH.value,
      data_cache=common.DATA_CACHE.value, seed=common.SEED.value, mods=mods,
      num_eval=NUM_EVAL.value or None, **overrides)


def _preset() -> str:
  if common.PRESET.present:
    return common.PRESET.value
  return "small" if _compat.on_gpu() else "tiny"


def _train_config(steps: int, batch_size: int, log_every: int) -> TrainConfig:
  return TrainConfig(steps=steps, seed=common.SEED.value, batch_size=batch_size,
                     log_every=log_every, checkpoint_every=steps, progress=False,
                     optim=OptimConfig())


def _arms(plan_path: str, plan):
  """(label, directory, RunSpec, KernelPlan) of each arm."""
  yield "bf16+Mods", "bf16_mods", _spec(precision="bf16"), validate_lib.BASELINE
  # One directory per plan content: a rerun that selects another plan trains it afresh.
  yield ("LoKA (Mods + plan)", f"loka_{plan.kernel_digest()[:8]}",
         _spec(precision="loka", plan=plan_path), plan.kernel_plan())
  if NAIVE_FP8.value:
    yield (f"fp8_all {common.KERNEL.value} + Mods", "fp8_all",
           _spec(precision="fp8_all", kernel=common.KERNEL.value),
           KernelPlan.uniform(common.KERNEL.value))


def _speed_section(result, arms_plans) -> str:
  """Whole-step speed of the arms on a GPU; on a CPU, why not and the plan's estimate."""
  estimate = pipeline.plan_speedup_estimate(result.plan, result.report)
  # What any plan from these kernels could reach: whether the budget or the kernels limit it.
  bound = pipeline.plan_speedup_estimate(headroom.speed_only(result.report, "train"),
                                         result.report)
  est = (f"GEMM-only estimate of the plan vs bf16 over the probed sites: "
         f"{estimate['speedup']:.2f}x "
         f"({estimate['source']}{'; ' + estimate['note'] if estimate.get('note') else ''}); "
         f"of the speed-only plan (every site's fastest kernel, accuracy ignored; "
         f"`experiments.plan_headroom`): {bound['speedup']:.2f}x.")
  if not _compat.on_gpu():
    return ("Speed: not measured (not on a GPU: CPU timings say nothing about GPU kernels). "
            + est)
  context = pipeline.context_for_run(_spec(), result.paths["probe_dir"],
                                     _train_config(PROBE_STEPS.value, _batch_size(), 0),
                                     result.report)
  got = validate_lib.measure_steps(context, arms_plans, "bf16+Mods")
  lines = [f"Speed on {jax.devices()[0].device_kind} (whole steps, interleaved, 20 repeats, "
           "speedup vs bf16+Mods with bootstrap 95% CI):", "",
           "| arm | train step (us) | train speedup | inference step (us) | inference speedup |",
           "|---|---|---|---|---|"]
  for name in arms_plans:
    t, i = got["train"][name], got["infer"][name]
    lines.append(f"| {name} | {t['median_us']:.0f} | {t['speedup']:.3f} [{t['speedup_ci'][0]:.3f}, "
                 f"{t['speedup_ci'][1]:.3f}] | {i['median_us']:.0f} | {i['speedup']:.3f} "
                 f"[{i['speedup_ci'][0]:.3f}, {i['speedup_ci'][1]:.3f}] |")
  return "\n".join(lines + ["", est])


def _batch_size() -> int:
  return BATCH_SIZE.value or experiment.preset_batch_size(common.MODEL.value, _preset())


def _criteria():
  """None: the pipeline's default budget; else the default with --min_speedup."""
  if MIN_SPEEDUP.value is None:
    return None
  return Criteria(min_speedup=MIN_SPEEDUP.value if MIN_SPEEDUP.value > 0 else None)


def _no_fp8_hint(plan, criteria) -> str:
  """Why an all-bf16 plan is all bf16, and how to see what accuracy alone would admit."""
  if any(k != "xla_bf16" for counts in kernel_counts(plan).values() for k in counts):
    return ""
  if criteria.min_speedup is None:
    return "No FP8 kernel met the error budget at any site.\n\n"
  return ("No FP8 kernel is both within the error budget and faster than bf16 at these "
          "sites' shapes on the timing source's device, so the plan keeps bf16 everywhere and "
          "the LoKA arm equals bf16+Mods. Rerun with --min_speedup=0 to see what the error "
          "budget alone admits (its speed then judged on a GPU).\n\n")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  start = time.time()
  workdir = common.WORKDIR.value or "loka_run"
  if COMPILATION_CACHE.value:
    jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  experiment.quiet_library_logs()
  logging.set_verbosity(logging.WARNING)  # one line per step would bury the report
  batch_size = _batch_size()
  kernels = tuple(PROBE_KERNELS.value) or (() if _compat.on_gpu() else CPU_KERNELS)
  print(f"== probe -> dispatch -> validate: {common.MODEL.value}/{_preset()} on "
        f"{common.DATA.value} -> {workdir}", flush=True)
  result = pipeline.probe_and_plan(
      _spec(), workdir,
      train_config=_train_config(PROBE_STEPS.value, batch_size, 0),
      probe_config=ProbeConfig(cadence=CADENCE.value, seed=common.SEED.value),
      probe_options=ProbeOptions(samples=SAMPLES.value, kernels=kernels,
                                 sites=PROBE_SITES.value, bootstrap=200, site_plots=False,
                                 compile_workers=compile_workers(),
                                 seed=common.SEED.value),
      criteria=_criteria(),
      validation=validate_lib.ValidationConfig(
          max_rel_logloss=MAX_REL_LOGLOSS.value, shadow_steps=SHADOW_STEPS.value,
          from_init_steps=FROM_INIT_STEPS.value, from_init_seeds=FROM_INIT_SEEDS.value,
          seed=common.SEED.value) if VALIDATE.value else None)
  plan = result.plan
  steps = common.STEPS.value
  arms, arms_plans = {}, {}
  for label, key, spec, kernel_plan in _arms(result.paths["plan"], plan):
    arm_dir = os.path.join(workdir, "arms", key)
    print(f"== {label}: {steps} steps -> {arm_dir}", flush=True)
    experiment.run(spec, arm_dir, _train_config(steps, batch_size, max(1, steps // 30)))
    arms[label] = report.load_arm(arm_dir)
    arms_plans[label] = kernel_plan
  _, source, _ = experiment.build_run(_spec(precision="bf16"))
  plan_png = report.plot_plan(plan, os.path.join(workdir, "plan.png"))
  arms_png = report.plot_arms(arms, os.path.join(workdir, "arms.png"), source.oracle_ne)
  criteria = result.criteria
  timing = plan["provenance"].get("timing_source", {})
  oracle = (f"Teacher (oracle) NE on the held-out set: {source.oracle_ne:.4f}\n\n"
            if source.oracle_ne is not None else "")
  text = "\n".join([
      f"# loka_jax main job: {common.MODEL.value}/{_preset()} on {common.DATA.value}, seed "
      f"{common.SEED.value}",
      "",
      f"Probe: {PROBE_STEPS.value} bf16+Mods training steps, {len(result.report['sites'])} sites "
      f"probed, candidates {', '.join(result.report['evaluation']['kernels'])}. Selection "
      f"budget: SQNR >= {criteria.min_sqnr_fwd_db:g} dB fwd / {criteria.min_sqnr_grad_db:g} dB "
      f"gradients, underflow <= {100 * criteria.max_underflow:g}%, "
      + (f"speedup > {criteria.min_speedup:g}x" if criteria.min_speedup is not None else
         "accuracy only (no timings here: FP8 chosen where safe, its speed judged on a GPU)")
      + f". Timing source: {timing.get('kind')} ({timing.get('reason', '')}).",
      "",
      "## Plan (`plan.json`; * = backed off by validation)", "",
      _no_fp8_hint(plan, criteria) + report.plan_table(plan), "",
      f"![plan]({os.path.basename(plan_png)})", "",
      "## Validation", "",
      report.validation_lines(plan) or "- none recorded", "",
      f"## Arms ({steps} steps each, same seed, data order and held-out set)", "",
      report.comparison_table(arms, baseline="bf16+Mods"), "",
      oracle + f"![loss and NE]({os.path.basename(arms_png)})", "",
      "## Speed", "",
      _speed_section(result, arms_plans), "",
      f"Wall time of this invocation: {time.time() - start:.0f} s.", ""])
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  print(text)
  print(f"wrote {os.path.join(workdir, 'report.md')}, {plan_png}, {arms_png}")


if __name__ == "__main__":
  flags.FLAGS.set_default("steps", 300)
  app.run(main)
