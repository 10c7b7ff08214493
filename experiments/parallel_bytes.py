r"""Bytes per step of the sharded step's collectives, per tower, preset, mesh and payload
(loka_jax/parallel/traffic.py; docs/PARALLEL.md).

  python3 -m experiments.parallel_bytes --config.run.model=dlrm \
      --config.run.presets=small,large --config.parallel.meshes="data:1,model:2"

Settings come from experiments/configs/parallel_bytes.py. Prints a table per (preset, mesh):
each collective's operand bytes per device (`payload`) and bytes one device sends (`wire`),
one column pair per mode; --config.output=PATH writes the same rows as JSON.
"""
import json
import os
import sys

from absl import app

from experiments import run_config

CONFIG = run_config.define_config_flag("parallel_bytes")


def rows(config):
  """[(preset, mesh, batch, {mode: [Collective]})] of every preset and mesh."""
  from loka_jax import parallel  # pylint: disable=g-import-not-at-top
  from loka_jax.parallel import traffic  # pylint: disable=g-import-not-at-top
  from loka_jax.train.experiment import RunSpec, build_run  # pylint: disable=g-import-not-at-top
  modes = run_config.split(config.parallel.modes)
  wrong = [m for m in modes if m not in run_config.COLLECTIVES]
  if wrong:
    raise ValueError(f"--config.parallel.modes={config.parallel.modes}: {wrong} not among "
                     f"{', '.join(run_config.COLLECTIVES)}")
  if config.run.precision == "loka" and "plan" not in config.run:
    raise ValueError("--config.run.precision=loka: this config has no run.plan to read a "
                     "kernel plan from; use --config.run.precision=fp32, bf16 or fp8_all (a "
                     "delayed-scaling --config.run.kernel adds its fp8_meta all-reduce)")
  meshes = [m.strip() for m in config.parallel.meshes.split(";") if m.strip()]
  out = []
  for preset in run_config.split(config.run.presets):
    spec = RunSpec(model=config.run.model, preset=preset, precision=config.run.precision,
                   kernel=config.run.kernel, mods=run_config.mods(config.run.mods))
    model, source, preset_config = build_run(spec)
    example = source.train_batch(0, 1)
    for mesh in meshes:
      sizes = dict(parallel.parse_mesh_spec(mesh))
      devices = sizes["data"] * sizes["model"]
      batch = config.parallel.batch_size or int(preset_config.batch_size) * devices
      by_mode = {m: traffic.model_collectives(
          model, example, batch, sizes["data"], sizes["model"],
          parallel.ParallelConfig(collectives=m)) for m in modes}
      out.append((preset, mesh, batch, by_mode))
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from loka_jax.parallel import traffic  # pylint: disable=g-import-not-at-top
  config = CONFIG.value
  folder = os.path.dirname(os.path.abspath(config.output)) if config.output else None
  if folder and not os.path.isdir(folder):
    sys.exit(f"error: --config.output={config.output}: no folder {folder}; create it or "
             "write to an existing one")
  try:
    found = rows(config)
  except ValueError as e:
    sys.exit(f"error: {e}")
  records = []
  for preset, mesh, batch, by_mode in found:
    print(traffic.table(by_mode, f"{config.run.model}/{preset} on {mesh}, global batch {batch}, "
                        "bytes per device and step"))
    print()
    for mode, collectives in by_mode.items():
      records += [{"model": config.run.model, "preset": preset, "mesh": mesh,
                   "batch_size": batch, **c.to_dict()} for c in collectives]
  if config.output:
    try:
      with open(config.output, "w") as f:
        json.dump(records, f, indent=1)
    except OSError as e:
      sys.exit(f"error: --config.output={config.output}: {e.strerror or e}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
