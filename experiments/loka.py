"""The main job: probe -> dispatch -> validate, then train bf16+Mods, the plan (Mods + plan)
and naive FP8 (one kernel everywhere, same Mods) side by side, and report.

  python3 -m experiments.loka [--workdir=loka_run] [--config.run.preset=small]
      [--config.run.steps=300] [--config.select.min_speedup=0] ...

Settings come from experiments/configs/loka.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). The default is Wukong `tiny` on synthetic data
on a CPU, `small` when a GPU is present (config.run.preset overrides). Every arm uses the same
seed, data order and held-out set. Writes, in --workdir (default ./loka_run):
  probe_report.json, plan_selected.json, plan.json   (loka_jax/dispatch/pipeline.py)
  probe/                   the probe's bf16+Mods training run
  arms/<arm>/              each arm's metrics.jsonl, final.json, checkpoints (the LoKA
                           arm's directory is named by its plan's kernel digest)
  report.md                the per-site plan, its validation, NE/AUC/log loss of the arms,
                           speed where valid
  plan.png, arms.png       the plan (kernel per site and pass, sites per kernel), the
                           training loss and held-out NE of the arms
Rerunning resumes every part (delete a file or directory to redo it). A rerun with other
settings redoes the parts they change, moving the old files to WORKDIR/replaced/STAMP/, and
says so (experiments/job_settings.py).
"""
import os
import sys
import time

from absl import app, flags, logging

from experiments import job_settings, loka_report, run_config
from loka_jax import _compat
from loka_jax.data.sources import DataFileError
from loka_jax.dispatch import pipeline
from loka_jax.dispatch import validate as validate_lib
from loka_jax.kernels import KernelPlan
from loka_jax.probe.collector import ProbeConfig
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.runner import ProbeOptions, ProbeSetupError
from loka_jax.train import OptimConfig, TrainConfig, experiment, report
from loka_jax.train.run_files import RunSettingsError

CONFIG = run_config.define_config_flag("loka")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", "loka_run", "Run directory: the probe, the plan, the "
                              "arms and the report; rerunning resumes every part.")

CPU_KERNELS = ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise")
# On a GPU: the kernels Dispatch selects in validated plans on the H200 (Flax's delayed
# scaling, its forward-only and forward+dgrad twins) and XLA's rowwise FP8 dot. The other
# registered candidates cost a probe minutes of compiles on a GPU (config.probe.kernels
# names them).
GPU_KERNELS = ("xla_bf16", "xla_fp8_rowwise", "flax_fp8_delayed", "flax_fp8_delayed_fwd",
               "flax_fp8_delayed_grad_lhs")


def _preset(run) -> str:
  return run.preset or ("small" if _compat.on_gpu() else "tiny")


def _spec(run, **overrides) -> experiment.RunSpec:
  """The RunSpec of an arm (by default the probe's bf16+Mods run)."""
  return run_config.run_spec(run, preset=_preset(run),
                             mods=run_config.mods(run.mods) or ("all",), **overrides)


def _train_config(run, steps: int, log_every: int, checkpoint_every: int = 0) -> TrainConfig:
  batch_size = run.batch_size or experiment.preset_batch_size(run.model, _preset(run))
  return TrainConfig(steps=steps, seed=run.seed, batch_size=batch_size, log_every=log_every,
                     checkpoint_every=checkpoint_every or steps, progress=False,
                     optim=OptimConfig())


def _arms(config, plan_path: str, plan):
  """(label, directory, RunSpec, KernelPlan) of each arm."""
  run, kernel = config.run, config.arms.kernel
  yield "bf16+Mods", "bf16_mods", _spec(run, precision="bf16"), validate_lib.BASELINE
  # One directory per plan content: a rerun that selects another plan trains it afresh.
  yield ("LoKA (Mods + plan)", f"loka_{plan.kernel_digest()[:8]}",
         _spec(run, precision="loka", plan=plan_path), plan.kernel_plan())
  if config.arms.naive_fp8:
    yield (f"fp8_all {kernel} + Mods", "fp8_all", _spec(run, precision="fp8_all", kernel=kernel),
           KernelPlan.uniform(kernel))


def _criteria(min_speedup):
  """None: the pipeline's default budget; else the default with this speed rule."""
  if min_speedup is None:
    return None
  return Criteria(min_speedup=min_speedup if min_speedup > 0 else None)


def _probe_and_plan(config, workdir, probe_train, kernels):
  """The probe, the selection and the validation (each resumed when its file exists)."""
  run, probe, validate = config.run, config.probe, config.validate
  return pipeline.probe_and_plan(
      _spec(run), workdir, train_config=probe_train,
      probe_config=ProbeConfig(cadence=probe.cadence, seed=run.seed),
      probe_options=ProbeOptions(
          samples=probe.samples, kernels=kernels, sites=probe.sites, bootstrap=200,
          site_plots=False, seed=run.seed,
          compile_workers=None if probe.compile_workers < 0 else probe.compile_workers,
          compile_evaluation_while_training=probe.compile_evaluation_while_training),
      criteria=_criteria(config.select.min_speedup),
      validation=validate_lib.ValidationConfig(
          max_rel_logloss=validate.max_rel_logloss, shadow_steps=validate.shadow_steps,
          from_init_steps=validate.from_init_steps, from_init_seeds=validate.from_init_seeds,
          seed=run.seed) if validate.enabled else None)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  start = time.time()
  config, workdir = CONFIG.value, WORKDIR.value
  run, probe = config.run, config.probe
  if probe.checkpoint_every < 0:
    sys.exit(f"error: --config.probe.checkpoint_every={probe.checkpoint_every}: must be >= 0 "
             "(0: the probe checkpoints only at its end)")
  experiment.quiet_library_logs()
  logging.set_verbosity(logging.WARNING)  # one line per step would bury the report
  try:
    replaced = job_settings.settle(workdir, config.to_dict())
  except ValueError as e:
    sys.exit(f"error: {e}")
  if replaced:
    print(f"== {replaced}", flush=True)
  kernels = tuple(k.strip() for k in probe.kernels.split(",") if k.strip())
  kernels = kernels or (GPU_KERNELS if _compat.on_gpu() else CPU_KERNELS)
  print(f"== probe -> dispatch -> validate: {run.model}/{_preset(run)} on {run.data} -> "
        f"{workdir}", flush=True)
  probe_train = _train_config(run, probe.steps, 0, probe.checkpoint_every)
  try:
    result = _probe_and_plan(config, workdir, probe_train, kernels)
  except (pipeline.RunMismatchError, ProbeSetupError, DataFileError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  arms, arms_plans = {}, {}
  for label, key, spec, kernel_plan in _arms(config, result.paths["plan"], result.plan):
    arm_dir = os.path.join(workdir, "arms", key)
    print(f"== {label}: {run.steps} steps -> {arm_dir}", flush=True)
    try:
      experiment.run(spec, arm_dir, _train_config(run, run.steps, max(1, run.steps // 30)))
    except (RunSettingsError, DataFileError) as e:
      sys.exit(f"error: {e}")
    arms[label] = report.load_arm(arm_dir)
    arms_plans[label] = kernel_plan
  loka_report.write(workdir, result, arms, arms_plans, _spec(run), probe_train, run.steps,
                    start)
  job_settings.record(workdir, config.to_dict())


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
