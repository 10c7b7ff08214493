"""The models suite: DLRM, DCNv2, Wukong, DHEN and InterFormer at their presets' batch, one
speed row per (model/preset, variant).

  python3 -m experiments.bench --config=experiments/configs/bench_models.py --workdir=DIR \
      --config.targets.presets=small --config.targets.models=wukong

Every other setting is the common one of experiments/configs/bench.py.
"""
import ml_collections

from experiments.configs import bench


def get_config() -> ml_collections.ConfigDict:
  config = bench.get_config()
  config.suite = "models"
  return config
