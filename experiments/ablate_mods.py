r"""The Mods ablation: 8 on/off combinations of No Bias, BlockNorm, Hard Swish x {bf16, FP8}.

  python3 -m experiments.ablate_mods --workdir=/tmp/abl --config.run.steps=60 \
      --config.ablation.seeds=0,1,2

Settings come from experiments/configs/ablate_mods.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). Every arm trains at each of
config.ablation.seeds; the arms of one seed share initialization, data order and held-out set
(loka_jax.train.experiment), and the loss verdicts pair them by seed. On a GPU each
combination's train step and inference are also timed against the bf16 baseline. Writes
WORKDIR/ablation.{json,md,png}.
Resumable: rerun the same command after config.max_minutes stopped it; finished arms and
timing rows are kept (loka_jax/train/ablation.py). The time limit is this script's: the
library asks its `should_stop` hook before each arm and timing row (`experiments.time_limit`).
"""
import os
import sys

from absl import app, flags

from experiments import run_config, time_limit
from loka_jax import xla_env
from loka_jax.train import ablation, experiment

CONFIG = run_config.define_config_flag("ablate_mods")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", None, "The ablation's directory: every arm's run, "
                              "the timing rows and the report; rerun to resume.")


def ablation_config(config) -> ablation.AblationConfig:
  """The library's AblationConfig of the config (ValueError on bad values)."""
  run, arms, timing = config.run, config.ablation, config.timing
  seeds = run_config.split(arms.seeds)
  if not seeds or not all(s.isdigit() for s in seeds) or len(set(seeds)) != len(seeds):
    raise ValueError(f"--config.ablation.seeds={arms.seeds!r}: list distinct non-negative "
                     "integers, e.g. 0,1,2")
  return ablation.AblationConfig(
      model=run.model, preset=run.preset, steps=run.steps, batch_size=run.batch_size or None,
      num_eval=run.num_eval, kernel=run.kernel, data=run.data,
      data_path=run.data_path, data_cache=run.data_cache, learning_rate=config.optim.lr,
      warmup_steps=config.optim.warmup_steps,
      combinations=ablation.parse_combinations(run_config.split(arms.combinations)),
      precisions=run_config.split(arms.precisions), seeds=tuple(int(s) for s in seeds),
      timing=timing.mode, repeats=timing.repeats, workers=arms.workers,
      keep_checkpoints=arms.keep_checkpoints, xla_deterministic=arms.xla_deterministic)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not WORKDIR.value:
    raise app.UsageError("--workdir is required (rerun with the same one to resume)")
  config = CONFIG.value
  try:
    settings = ablation_config(config)
  except ValueError as e:
    sys.exit(f"error: {e}")
  if settings.xla_deterministic:  # before anything starts JAX's backend
    xla_env.add_xla_flags(xla_env.DETERMINISTIC)
  experiment.quiet_library_logs()
  workdir = WORKDIR.value
  try:
    result = ablation.run(settings, workdir, log=lambda line: print(line, flush=True),
                          should_stop=time_limit.stop_after(60 * config.max_minutes))
  except ablation.SettingsError as e:
    sys.exit(f"error: {e}")
  print(ablation.markdown_table(result))
  outputs = (os.path.join(workdir, f) for f in ("ablation.json", "ablation.md", "ablation.png"))
  print(f"\nwrote {', '.join(outputs)}")
  if not result["complete"]:
    print("INCOMPLETE: rerun the same command to continue")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
