"""Settings of the bytes model of the sharded step, `python3 -m experiments.parallel_bytes`:
bytes per step and device of every collective (gradient all-reduces, embedding exchange,
delayed-scaling state), fp32 / bf16 / fp8 side by side, from shapes alone (any preset runs on
a laptop in seconds; no device of the mesh is needed).

  python3 -m experiments.parallel_bytes --config.run.model=wukong \
      --config.run.presets=small,large --config.parallel.meshes="data:1,model:2;data:2,model:1"

Prints one table per (preset, mesh); with --config.output=PATH also writes the rows as JSON.
Expected (the defaults): Wukong `small` at global batch 8192 sends 104 MB per device and
step in bf16 and 54 MB with fp8 collectives on data:1,model:2; 265 MB and 136 MB on
data:2,model:1 (replicated tables: their whole gradients travel).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The tower: model, presets (comma-separated), precision arm and Mods, as for training.
  config.run = run = ml_collections.ConfigDict()
  run.model = "wukong"
  run.presets = "small"
  run.precision = "bf16"        # fp32 | bf16 | fp8_all (fp8_all with a delayed-scaling
  run.kernel = "xla_fp8_tensorwise"  # kernel adds its fp8_meta all-reduce)
  run.mods = ""

  # Meshes (';'-separated specs), payload modes (comma-separated) and the batch.
  config.parallel = parallel = ml_collections.ConfigDict()
  parallel.meshes = "data:1,model:2;data:2,model:1"
  parallel.modes = "fp32,bf16,fp8"
  # Global batch; 0: the preset's batch per device times the mesh's devices (the benchmark's
  # weak scaling).
  parallel.batch_size = 0

  config.output = ""            # JSON file of every row ('' : print only)
  return config
