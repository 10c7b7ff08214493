"""The public API on a model loka_jax did not build, at GPU size: a two-tower rating model of
plain `nn.Embed` / `nn.Dense` layers (`experiments/two_tower.py`) trained in the user's own
optax loop with `loka_jax.Probe` observing it, then select -> wrap -> train, against the same
model in bf16 from the same initialization and data order.

  python3 -m experiments.your_model --workdir=/tmp/your_model [--config.run.steps=200 \
      --config.run.batch_size=8192]

Settings come from experiments/configs/your_model.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). Writes `row.json` in --workdir: the card, jax
version, date and command; time to a plan; whole-step training speed of the plan against bf16
(interleaved, median and bootstrap 95% CI); held-out loss of both trained arms with the paired
verdict per held-out batch; the plan's own held-out check (`loka_jax.validate`), whose plan
the FP8 arm trains with. About 5 minutes on an H200 at the defaults.
"""
import json
import os
import sys

from absl import app, flags

from experiments import run_config

CONFIG = run_config.define_config_flag("your_model")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", "your_model_run",
                              "Where row.json, the probe report and the plans go.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  run, probe = CONFIG.value.run, CONFIG.value.probe
  kernels = run_config.split(probe.kernels)
  for name, value in (("run.steps", run.steps), ("run.batch_size", run.batch_size),
                      ("run.width", run.width)):
    if value < 1:
      sys.exit(f"error: --config.{name}={value}: must be >= 1")
  if not kernels:
    sys.exit("error: --config.probe.kernels: name at least one kernel")
  from experiments import two_tower  # pylint: disable=g-import-not-at-top  (after the flags)
  from loka_jax.plan.file import choice_table  # pylint: disable=g-import-not-at-top
  row, checked = two_tower.measure(
      WORKDIR.value, steps=run.steps, batch_size=run.batch_size, width=run.width,
      kernels=kernels, command="python -m experiments.your_model " + " ".join(sys.argv[1:]))
  with open(os.path.join(WORKDIR.value, "row.json"), "w") as f:
    json.dump(row, f, indent=1, default=str)
  times, verdict = row["train_step"], row["trained_verdict"]
  print(choice_table(checked))
  print(f"{row['device']}: LoKA train step {times['loka']['speedup']:.3f}x bf16 "
        f"[{times['loka']['speedup_ci'][0]:.3f}, {times['loka']['speedup_ci'][1]:.3f}]; "
        f"held-out MSE {row['held_out_mse']['loka']:.5f} vs {row['held_out_mse']['bf16']:.5f} "
        f"({verdict['verdict']}); time to a plan {row['time_to_plan_s']:.0f} s")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
