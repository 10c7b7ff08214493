"""The towers suite: MLP towers BxWxD (D layers of width W at batch B, each a GEMM site, a
norm and an activation), one speed row per (tower, variant).

  python3 -m experiments.bench --config=experiments/configs/bench_towers.py --workdir=DIR \
      --config.targets.towers=8192x2048x8 --config.speed.variants=bf16,bf16_mods,loka

Every other setting is the common one of experiments/configs/bench.py.
"""
import ml_collections

from experiments.configs import bench


def get_config() -> ml_collections.ConfigDict:
  config = bench.get_config()
  config.suite = "towers"
  return config
