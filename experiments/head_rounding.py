"""How far rounding alone moves a logit head's FP8 forward between two e4m3 quantizers.

  python3 -m experiments.head_rounding --samples=32 --m=8192 --k=2048     (CPU, a few minutes)

Ours rounds once from float32; Flax's divides in bf16 and then casts, rounding twice. On a
head's rows (one shared vector, `check.logit_head_samples`) the elements they round apart move
single readings by several dB while the means agree; the logit-head tests compare means for
this reason (docs/BENCHMARKS.md, twenty-fourth session). Prints each sample's readings and
the spread of ours minus Flax's.
"""
import numpy as np
from absl import app, flags

from loka_jax.kernels import check

SAMPLES = flags.DEFINE_integer("samples", 32, "Head problems drawn.", lower_bound=2)
M = flags.DEFINE_integer("m", 8192, "Rows (batch).", lower_bound=1)
K = flags.DEFINE_integer("k", 2048, "Head input width.", lower_bound=1)


def main(argv):
  del argv
  r = check.head_rounding_readings(SAMPLES.value, M.value, K.value)
  print("ours", np.round(r["ours"], 1))
  print("flax", np.round(r["flax"], 1))
  d = r["ours"] - r["flax"]
  print(f"ours - flax: mean {d.mean():+.2f} dB, sd {d.std():.2f}, range {d.min():+.1f} to "
        f"{d.max():+.1f}; sd of a mean of 16: {d.std() / 4:.2f}")
  print(f"elements rounded apart: input {r['differ_x'].mean():.1%}, "
        f"weight {r['differ_w'].mean():.1%}")


if __name__ == "__main__":
  app.run(main)
