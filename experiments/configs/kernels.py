"""Settings of the kernel check, `python3 -m experiments.kernels`: every registered kernel, every
pass, against the float32 HIGHEST product of the original operands, per shape.

  python3 -m experiments.kernels --config.check.m=2048 --config.check.k=256 \
      --config.check.n=768 --config.check.json=check.json
  python3 -m experiments.kernels --config.list=true
"""
import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # True: only print every registered kernel and its passes (no check).
  config.list = False

  # The check: each kernel's error (and, with time, its forward's speed) per shape; a chain
  # kernel is checked as its whole chain. Exits 1 when a kernel raised or gave a non-finite
  # output.
  config.check = check = ml_collections.ConfigDict()
  check.m = 512      # rows of the activation (batch)
  check.k = 384      # contracting size
  check.n = 256      # output features
  # Several MxKxN shapes, comma-separated (e.g. 2048x256x768,4096x512x512), instead of m, k, n.
  check.shapes = ""
  check.seed = 0     # the random operands
  check.only = ""    # the kernels to check, comma-separated; empty: every registered kernel
  check.time = False  # also time each kernel's forward against xla_bf16 (GPU numbers only)
  check.json = config_dict.placeholder(str)  # write the loka.check/1 JSON here (one shape)
  # Directory of check.jsonl, one line per shape; resumable: shapes already in it are skipped.
  check.out = config_dict.placeholder(str)
  return config
