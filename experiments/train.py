"""Train a recommendation tower; rerunning with the same --workdir resumes the run.

  python3 -m experiments.train --workdir=/tmp/wukong_bf16 --config.run.model=wukong \
      --config.run.preset=tiny --config.run.precision=bf16 --config.run.steps=500

Settings come from experiments/configs/train.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). Writes WORKDIR/metrics.jsonl (one JSON line
per logged step), WORKDIR/final.json (held-out ne, auc, logloss, steps, precision, seed),
WORKDIR/config.json and WORKDIR/checkpoints/.
"""
import json
import sys

from absl import app, flags

from experiments import run_config
from loka_jax import xla_env
from loka_jax.data.sources import DataFileError
from loka_jax.dispatch import valve
from loka_jax.models.presets import ModsError
from loka_jax.parallel.mesh import MeshSpecError
from loka_jax.train import (CheckpointError, NonFiniteError, OptimConfig, RunSettingsError,
                            TrainConfig)
from loka_jax.train import experiment
from loka_jax.train.optim import cooldown_at_end

CONFIG = run_config.define_config_flag("train")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: metrics, checkpoints, config; "
                              "rerun to resume.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not WORKDIR.value:
    raise app.UsageError("--workdir is required (the run directory; rerun to resume)")
  config = CONFIG.value
  run, loop, optim = config.run, config.train, config.optim
  if loop.xla_deterministic:  # before anything starts JAX's backend
    xla_env.add_xla_flags(xla_env.DETERMINISTIC)
  if not loop.triton_gemm:
    xla_env.add_xla_flags(xla_env.NO_TRITON_GEMM)
  experiment.quiet_library_logs()
  try:
    cooldown = cooldown_at_end(run.steps, optim.cooldown_steps, optim.warmup_steps)
  except ValueError:
    sys.exit(f"error: --config.optim.cooldown_steps={optim.cooldown_steps}: must be in [0, "
             f"run.steps - optim.warmup_steps = {run.steps - optim.warmup_steps}]")
  spec = run_config.run_spec(run, drift_every=config.drift.every,
                             drift_report=config.drift.report,
                             drift_max_overhead=config.drift.max_overhead,
                             drift_compile_ahead=config.drift.compile_ahead)
  train_config = TrainConfig(
      steps=run.steps, seed=run.seed,
      batch_size=run.batch_size or experiment.preset_batch_size(spec.model, spec.preset),
      eval_every=loop.eval_every, eval_batch_size=loop.eval_batch_size or None,
      log_every=loop.log_every, checkpoint_every=loop.checkpoint_every,
      keep_checkpoints=loop.keep_checkpoints, nan_policy=loop.nan_policy,
      progress=loop.progress, module_norms=loop.module_norms, prefetch=loop.prefetch,
      batch_workers=loop.batch_workers, run_ahead=loop.run_ahead,
      optim=OptimConfig(learning_rate=optim.lr, embedding_learning_rate=optim.embedding_lr,
                        warmup_steps=optim.warmup_steps, weight_decay=optim.weight_decay,
                        **cooldown))
  for note in experiment.recipe_notes(spec.preset, train_config.optim):
    print(f"note: {note}", file=sys.stderr, flush=True)
  try:
    if config.parallel.mesh:
      if loop.module_norms:
        sys.exit("error: --config.train.module_norms is logged by the single-device loop "
                 "only; drop --config.parallel.mesh to read a spike")
      if config.drift.every:
        sys.exit("error: --config.drift.every does not run in a sharded run yet; drop "
                 "--config.parallel.mesh or --config.drift.every")
      from loka_jax import parallel  # pylint: disable=g-import-not-at-top
      from loka_jax.parallel import run as parallel_run  # pylint: disable=g-import-not-at-top
      parallel.initialize_distributed()
      model, source, _ = experiment.build_run(spec)
      final = parallel_run.train_sharded(
          model, source, WORKDIR.value, train_config,
          parallel.build_mesh(config.parallel.mesh),
          parallel.ParallelConfig(collectives=config.parallel.collectives),
          run_info=spec.run_info())
    else:
      # With drift.every, the drift valve guards the plan (a model hook of the loop).
      final = valve.run(spec, WORKDIR.value, train_config,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
  except (NonFiniteError, CheckpointError, RunSettingsError, experiment.PlanError,
          MeshSpecError, ModsError, DataFileError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  print(json.dumps(final, indent=1, sort_keys=True))


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
