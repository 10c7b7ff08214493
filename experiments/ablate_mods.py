"""The Mods ablation: 8 on/off combinations of No Bias, BlockNorm, Hard Swish x {bf16, FP8}.

  python -m experiments.ablate_mods --model=wukong --preset=tiny --steps=60 --workdir=/tmp/abl

Every arm trains with the same seed, data order and held-out set (loka_jax.train.experiment);
on a GPU each combination's train step and inference are also timed against the bf16
baseline. Writes WORKDIR/ablation.{json,md,png}. Resumable: rerun the same command after
--max_minutes stopped it; finished arms and timing rows are kept (loka_jax/train/ablation.py).
The time limit is this script's: the library asks its `should_stop` hook before each arm and
timing row (`experiments.time_limit`).
"""
import os
import sys

from absl import app, flags

from experiments import time_limit
from experiments import common_flags as common
from loka_jax import xla_env
from loka_jax.train import ablation
from loka_jax.train import OptimConfig, experiment

BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
NUM_EVAL = flags.DEFINE_integer("num_eval", 2048, "Held-out examples (the same for every arm).")
LR = flags.DEFINE_float("lr", OptimConfig.learning_rate, "Adam learning rate (dense towers).")
WARMUP = flags.DEFINE_integer(
    "warmup_steps", 0, "Linear warm-up of both learning rates over this many steps (0: none); "
    "the large presets spike in their first steps without one.")
COMBINATIONS = flags.DEFINE_list(
    "combinations", [], "Mods combinations to run: 'none', 'all' or mods joined by '+' "
    "(e.g. no_bias+hard_swish); empty: all 8.")
PRECISIONS = flags.DEFINE_list("precisions", list(ablation.PRECISIONS),
                               "Precision arms: bf16 and/or fp8_all (--kernel at every site).")
NOISE_SEEDS = flags.DEFINE_list("noise_seeds", [],
                                "Extra seeds of the bf16 baseline for the seed-to-seed noise "
                                "floor (two give >= 3 bf16 seeds in all).")
DETERMINISTIC = common.define_xla_deterministic(
    "Every arm; with --timing=off only, since it slows the steps.")
TIMING = flags.DEFINE_enum("timing", "auto", ablation.TIMING_MODES,
                           "auto: time on a GPU only; off; force: also on a CPU (smoke test).")
REPEATS = flags.DEFINE_integer("repeats", 20, "Timed repeats per variant (interleaved).")
WORKERS = flags.DEFINE_integer("workers", 1, "Arms trained at once (threads); keep 1 on a GPU.")
MAX_MINUTES = flags.DEFINE_float("max_minutes", 6.5,
                                 "Start no arm or timing row expected to end after this many "
                                 "minutes (by the longest finished one of its kind; then "
                                 "rerun to continue); 0: no limit.")
KEEP_CHECKPOINTS = flags.DEFINE_bool("keep_checkpoints", False,
                                     "Keep finished arms' checkpoints (they are large).")
COMPILE_CACHE = flags.DEFINE_string("compile_cache", None,
                                    "Persistent compilation cache (default WORKDIR/jax_cache).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not common.WORKDIR.value:
    raise app.UsageError("--workdir is required (rerun with the same one to resume)")
  for name in ("precision", "mods", "plan"):
    if flags.FLAGS[name].present:
      raise app.UsageError(f"--{name} does not apply: the ablation runs every combination "
                           "(use --combinations and --precisions)")
  try:
    config = ablation.AblationConfig(
        model=common.MODEL.value, preset=common.PRESET.value, steps=common.STEPS.value,
        batch_size=BATCH_SIZE.value or None, num_eval=NUM_EVAL.value, seed=common.SEED.value,
        kernel=common.KERNEL.value, data=common.DATA.value, data_path=common.DATA_PATH.value,
        data_cache=common.DATA_CACHE.value, learning_rate=LR.value,
        warmup_steps=WARMUP.value,
        combinations=ablation.parse_combinations(COMBINATIONS.value),
        precisions=tuple(PRECISIONS.value), noise_seeds=tuple(int(s) for s in NOISE_SEEDS.value),
        timing=TIMING.value, repeats=REPEATS.value, workers=WORKERS.value,
        keep_checkpoints=KEEP_CHECKPOINTS.value, xla_deterministic=DETERMINISTIC.value)
  except ValueError as e:
    raise app.UsageError(str(e))
  if config.xla_deterministic:  # before anything starts JAX's backend
    xla_env.add_xla_flags(xla_env.DETERMINISTIC)
  experiment.quiet_library_logs()
  workdir = common.WORKDIR.value
  ablation.use_compile_cache(COMPILE_CACHE.value or os.path.join(workdir, "jax_cache"))
  try:
    result = ablation.run(config, workdir, log=lambda line: print(line, flush=True),
                          should_stop=time_limit.stop_after(60 * MAX_MINUTES.value))
  except ablation.SettingsError as e:
    sys.exit(f"error: {e}")
  print(ablation.markdown_table(result))
  outputs = (os.path.join(workdir, f) for f in ("ablation.json", "ablation.md", "ablation.png"))
  print(f"\nwrote {', '.join(outputs)}")
  if not result["complete"]:
    print("INCOMPLETE: rerun the same command to continue")


if __name__ == "__main__":
  app.run(main)
