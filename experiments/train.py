"""Train a recommendation tower; rerunning with the same --workdir resumes the run.

  python -m experiments.train --model=wukong --preset=tiny --data=synthetic \
      --precision=bf16 --steps=500 --seed=0 --workdir=/tmp/wukong_bf16

Writes WORKDIR/metrics.jsonl (one JSON line per logged step), WORKDIR/final.json (held-out
ne, auc, logloss, steps, precision, seed), WORKDIR/config.json and WORKDIR/checkpoints/.
"""
import json
import sys

from absl import app, flags

from experiments import common_flags as common
from loka_jax import xla_env
from loka_jax.dispatch import valve
from loka_jax.models.presets import ModsError
from loka_jax.parallel.mesh import MeshSpecError
from loka_jax.train import (NAN_POLICIES, CheckpointError, NonFiniteError, OptimConfig,
                            RunSettingsError, TrainConfig)
from loka_jax.train import experiment

BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
EVAL_EVERY = flags.DEFINE_integer("eval_every", 0, "Steps between held-out evals; 0: at the end.")
EVAL_BATCH_SIZE = flags.DEFINE_integer("eval_batch_size", 0, "Eval batch; 0: the training batch.")
NUM_EVAL = flags.DEFINE_integer("num_eval", 0, "Held-out examples; 0: the data source's default.")
LOG_EVERY = flags.DEFINE_integer("log_every", 50, "Steps between metrics lines.")
CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 1000,
                                        "Steps between checkpoints (always one at the end).")
KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept (0: none "
                                        "is written; needs --checkpoint_every=0).")
LR = flags.DEFINE_float("lr", OptimConfig.learning_rate, "Adam(W) learning rate (dense towers).")
EMBEDDING_LR = flags.DEFINE_float("embedding_lr", OptimConfig.embedding_learning_rate,
                                  "Row-wise Adagrad learning rate (embedding tables).")
WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", 0, "Linear learning-rate warmup steps. The `large` presets want about 50 "
    "(without, their first steps spike, in bf16 too); a run without prints a note.")
WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay (dense towers).")
NAN_POLICY = flags.DEFINE_enum("nan_policy", "stop", NAN_POLICIES,
                               "On a non-finite loss/gradient: stop (keeping the last good "
                               "checkpoint) or skip the step.")
ID_POLICY = flags.DEFINE_enum("id_policy", "error", ("error", "hash", "clip"),
                              "Out-of-vocabulary ids in the data: error, hash or clip.")
DRIFT_EVERY = flags.DEFINE_integer(
    "drift_every", 0, "With --precision=loka: refresh the probe's statistics every N steps and "
    "switch sites whose statistics drifted and whose kernel is no longer safe (0: off).")
DRIFT_REPORT = flags.DEFINE_string(
    "drift_report", None, "The probe report the --plan was selected on (default: the one its "
    "provenance names); the drift valve's baseline statistics and timings.")
PROGRESS = flags.DEFINE_bool("progress", True, "Progress bar on stderr (when a terminal).")
MODULE_NORMS = flags.DEFINE_bool(
    "module_norms", False, "Log each module's gradient, parameter and update norms and its "
    "output's RMS with every metrics line (with --log_every=1: every step), to read a loss "
    "spike with experiments.spike_report. Adds a forward to each step.")
XLA_DETERMINISTIC = common.define_xla_deterministic("It slows the step a little.")
MESH = flags.DEFINE_string("mesh", None,
                           "Train sharded over a device mesh, e.g. data:2,model:2 (dense towers "
                           "data-parallel over every device, tables row-sharded over model; "
                           "multi-host from JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/"
                           "JAX_PROCESS_ID); unset: one device.")
COLLECTIVES = flags.DEFINE_enum("collectives", "bf16", ("fp32", "bf16", "fp8"),
                                "Payload of the gradient all-reduce and the embedding exchange "
                                "with --mesh (fp8: e4m3 with block scales, summed in fp32).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not common.WORKDIR.value:
    raise app.UsageError("--workdir is required (the run directory; rerun to resume)")
  if XLA_DETERMINISTIC.value:  # before anything starts JAX's backend
    xla_env.add_xla_flags(xla_env.DETERMINISTIC)
  experiment.quiet_library_logs()
  spec = experiment.RunSpec(
      model=common.MODEL.value, preset=common.PRESET.value, data=common.DATA.value,
      data_spec=common.DATA_SPEC.value, data_path=common.DATA_PATH.value,
      data_cache=common.DATA_CACHE.value, precision=common.PRECISION.value,
      kernel=common.KERNEL.value, plan=common.PLAN.value,
      mods=experiment.parse_mods(common.MODS.value), seed=common.SEED.value,
      num_eval=NUM_EVAL.value or None, id_policy=ID_POLICY.value,
      drift_every=DRIFT_EVERY.value, drift_report=DRIFT_REPORT.value)
  config = TrainConfig(
      steps=common.STEPS.value, seed=common.SEED.value,
      batch_size=BATCH_SIZE.value or experiment.preset_batch_size(spec.model, spec.preset),
      eval_every=EVAL_EVERY.value, eval_batch_size=EVAL_BATCH_SIZE.value or None,
      log_every=LOG_EVERY.value, checkpoint_every=CHECKPOINT_EVERY.value,
      keep_checkpoints=KEEP_CHECKPOINTS.value, nan_policy=NAN_POLICY.value,
      progress=PROGRESS.value, module_norms=MODULE_NORMS.value,
      optim=OptimConfig(learning_rate=LR.value, embedding_learning_rate=EMBEDDING_LR.value,
                        warmup_steps=WARMUP_STEPS.value, weight_decay=WEIGHT_DECAY.value))
  for note in experiment.recipe_notes(spec.preset, config.optim):
    print(f"note: {note}", file=sys.stderr, flush=True)
  try:
    if MESH.value:
      if MODULE_NORMS.value:
        raise app.UsageError("--module_norms is logged by the single-device loop only; drop "
                             "--mesh to read a spike")
      if DRIFT_EVERY.value:
        raise app.UsageError("--drift_every does not run in a sharded run yet; drop --mesh "
                             "or --drift_every")
      from loka_jax import parallel  # pylint: disable=g-import-not-at-top
      from loka_jax.parallel import run as parallel_run  # pylint: disable=g-import-not-at-top
      parallel.initialize_distributed()
      model, source, _ = experiment.build_run(spec)
      final = parallel_run.train_sharded(
          model, source, common.WORKDIR.value, config, parallel.build_mesh(MESH.value),
          parallel.ParallelConfig(collectives=COLLECTIVES.value), run_info=spec.run_info())
    else:
      final = valve.run(spec, common.WORKDIR.value, config)
  except (NonFiniteError, CheckpointError, RunSettingsError, experiment.PlanError,
          MeshSpecError, ModsError) as e:
    sys.exit(f"error: {e}")
  print(json.dumps(final, indent=1, sort_keys=True))


if __name__ == "__main__":
  app.run(main)
