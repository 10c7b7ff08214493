"""The quality suite: held-out NE, log loss and AUC of each arm and seed after a fixed number
of steps, on synthetic data (every targets.models at quality.preset) and MovieLens.

  python3 -m experiments.bench --config=experiments/configs/bench_quality.py --workdir=DIR \
      --config.quality.data=synthetic --config.quality.preset=large

Every other setting is the common one of experiments/configs/bench.py.
"""
import ml_collections

from experiments.configs import bench


def get_config() -> ml_collections.ConfigDict:
  config = bench.get_config()
  config.suite = "quality"
  return config
