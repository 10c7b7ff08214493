"""The main job: train the embedded default in bf16 and in FP8 side by side, then report.

  python -m experiments.loka [--model=wukong --preset=tiny --steps=300 --workdir=loka_run]

Every arm uses the same seed, data order and held-out set. The FP8 arm is --precision=fp8_all
with --kernel (default: xla_fp8_tensorwise everywhere, the naive recipe). Writes
WORKDIR/<arm>/{metrics.jsonl, final.json}, WORKDIR/report.md and WORKDIR/report.png; rerunning
resumes unfinished arms.
"""
import os

from absl import app, flags

from loka_jax import flags as common
from loka_jax.train import OptimConfig, TrainConfig, experiment, report

BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
NUM_EVAL = flags.DEFINE_integer("num_eval", 0, "Held-out examples; 0: the source's default.")


def _arms():
  yield "bf16", dict(precision="bf16")
  yield f"fp8_all ({common.KERNEL.value})", dict(precision="fp8_all", kernel=common.KERNEL.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdir = common.WORKDIR.value or "loka_run"
  experiment.quiet_library_logs()
  steps = common.STEPS.value
  arms = {}
  for name, overrides in _arms():
    spec = experiment.RunSpec(
        model=common.MODEL.value, preset=common.PRESET.value, data=common.DATA.value,
        data_spec=common.DATA_SPEC.value, data_path=common.DATA_PATH.value,
        data_cache=common.DATA_CACHE.value, seed=common.SEED.value,
        mods=experiment.parse_mods(common.MODS.value), num_eval=NUM_EVAL.value or None,
        **overrides)
    config = TrainConfig(
        steps=steps, seed=common.SEED.value, log_every=max(1, steps // 30),
        batch_size=BATCH_SIZE.value or experiment.preset_batch_size(spec.model, spec.preset),
        checkpoint_every=steps, optim=OptimConfig())
    arm_dir = os.path.join(workdir, name.split(" ")[0])
    print(f"== {name}: {spec.model}/{spec.preset} on {spec.data}, {steps} steps -> {arm_dir}",
          flush=True)
    experiment.run(spec, arm_dir, config)
    arms[name] = report.load_arm(arm_dir)
  _, source, _ = experiment.build_run(experiment.RunSpec(
      model=common.MODEL.value, preset=common.PRESET.value, data=common.DATA.value,
      data_spec=common.DATA_SPEC.value, data_path=common.DATA_PATH.value,
      data_cache=common.DATA_CACHE.value, seed=common.SEED.value))
  table = report.comparison_table(arms, baseline="bf16")
  plot = report.plot_arms(arms, os.path.join(workdir, "report.png"), source.oracle_ne)
  oracle = f"\nTeacher (oracle) NE on the held-out set: {source.oracle_ne:.4f}\n" \
      if source.oracle_ne is not None else ""
  text = (f"# loka_jax main job: {common.MODEL.value}/{common.PRESET.value} on "
          f"{common.DATA.value}, {steps} steps, seed {common.SEED.value}\n\n{table}\n{oracle}"
          f"\n![loss and NE]({os.path.basename(plot)})\n")
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  print(text)
  print(f"wrote {os.path.join(workdir, 'report.md')} and {plot}")


if __name__ == "__main__":
  flags.FLAGS.set_default("steps", 300)
  app.run(main)
