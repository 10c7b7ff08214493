"""Settings of the public API on a two-tower model loka_jax did not build, at GPU size,
`python3 -m experiments.your_model --workdir=DIR`.

  python3 -m experiments.your_model --workdir=/tmp/your_model --config.run.steps=200 \
      --config.run.batch_size=8192

--workdir is a flag of the main, not a setting: where row.json, the probe report and the plans
go.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The model and its training: both arms (bf16, then the plan's) train this long on the same
  # batches from the same initialization.
  config.run = run = ml_collections.ConfigDict()
  run.steps = 200        # steps of each arm (the probe observes the bf16 run's first half)
  run.batch_size = 8192  # examples per step
  run.width = 4096       # hidden width of both towers' MLPs

  # The probe: the candidate kernels it measures at each site, comma-separated.
  config.probe = probe = ml_collections.ConfigDict()
  probe.kernels = "xla_bf16,xla_fp8_tensorwise,xla_fp8_rowwise,flax_fp8_delayed"
  return config
