r"""Whether a quantize-dequantize round trip keeps its quantization inside one compiled program
on this device, and what the fused GEMM's reference and the probe's underflow count read there.

  python3 -m experiments.measure round_trip [--shape=2048x512x1024] [--cores=triton,mosaic_gpu]

On heavy-tailed operands x (M, K) and w (K, N), e4m3 rowwise, with a bias and ReLU, it prints
each result's largest error relative to the largest output, against the float64 product of
the quantized operands (the codes of the library's quantize run op by op) and against the
float64 product of the unquantized ones: the fused kernels on --cores, `fused_dense_reference`
jitted and run op by op, and a bare cast round trip jitted without `QTensor.dequantize`'s
barrier. XLA:GPU, under its default excess precision, simplifies that bare round trip away.
Then the underflow `flush_fractions` reads in one program, beside the share of the cast's zero
codes, on x with 8 columns scaled by 1e-6. --cores= (empty) leaves the kernels out (on a CPU
they run in interpret mode, slowly at large shapes).
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

from absl import app, flags

SHAPE = flags.DEFINE_string("shape", "2048x512x1024", "M x K x N of the fused GEMM.")
CORES = flags.DEFINE_list("cores", ["triton", "mosaic_gpu"],
                          "fused_dense cores to run beside the references (empty: none).")


def _cast_values(v, axis: int):
  """float64 values of the e4m3 codes the library's rowwise quantize gives `v` (one scale per
  slice along `axis`), run op by op: each op its own program, so the cast is materialized."""
  import numpy as np
  from loka_jax.precision import E4M3, ROWWISE, scaling
  q = scaling.quantize(v, E4M3, ROWWISE, (axis,))
  return np.asarray(q.data).astype(np.float64) * np.asarray(q.scale, np.float64)


def compare(m: int, k: int, n: int, seed: int = 11,
            cores: Sequence[str] = ()) -> Tuple[Dict[str, Tuple[float, float]],
                                                Tuple[float, float]]:
  """({result: (error vs the quantized product, error vs the unquantized one)}, (underflow
  read in one program, underflow of the cast)). Errors are max |a - b| / max |b|."""
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from kernels_pallas import fused
  from loka_jax.precision import E4M3, ROWWISE, flush_fractions, scaling

  # The operands of the GPU check of the fused kernels (tests/gpu: `operands("fwd", ...)` and
  # its bias): bf16 activations, one log-normal scale a row, a bf16 weight kept in fp32.
  keys = jax.random.split(jax.random.key(seed), 3)
  k_values, k_rows = jax.random.split(keys[0])
  rows = jnp.exp(0.5 * jax.random.normal(k_rows, (m, 1)))
  x = (jax.random.normal(k_values, (m, k)) * rows).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16).astype(jnp.float32)
  bias = jax.random.normal(jax.random.key(seed + 1), (n,))
  x64, w64, b64 = (np.asarray(a, np.float64) for a in (x, w, bias))
  want = {"quantized": np.maximum(_cast_values(x, 1) @ _cast_values(w, 0) + b64, 0),
          "unquantized": np.maximum(x64 @ w64 + b64, 0)}
  kw = dict(bias=bias, activation="relu", out_dtype=jnp.float32)
  results = {f"fused_dense {core}": jax.jit(functools.partial(
      fused.fused_dense, core=core, **kw))(x, w) for core in cores}
  results["reference, one program"] = jax.jit(functools.partial(
      fused.fused_dense_reference, **kw))(x, w)
  results["reference, op by op"] = fused.fused_dense_reference(x, w, **kw)

  def bare(v, axis):   # the cast round trip without dequantize's barrier
    scale = jnp.max(jnp.abs(v), axis=axis, keepdims=True) / E4M3.max
    return (v / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale

  results["bare cast, one program"] = jax.jit(lambda x, w: jax.nn.relu(jnp.dot(
      bare(x.astype(jnp.float32), 1), bare(w, 0), precision=lax.Precision.HIGHEST) + bias))(x, w)

  def error(out, ref):
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))

  errors = {name: (error(out, want["quantized"]), error(out, want["unquantized"]))
            for name, out in results.items()}
  # Underflow: x with its first 8 columns scaled by 1e-6, which flush under their rows' scales.
  small = x.astype(jnp.float32).at[:, :8].multiply(1e-6)
  cast_zero = np.mean(_cast_values(small, 1) == 0)
  read = jax.jit(lambda v: flush_fractions(v, scaling.quantize(v, E4M3, ROWWISE, (1,)))[0])(small)
  return errors, (float(read), float(cast_zero))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    m, k, n = (int(v) for v in SHAPE.value.lower().split("x"))
  except ValueError:
    raise app.UsageError(f"--shape={SHAPE.value}: give M x K x N, e.g. 2048x512x1024") from None
  import jax
  errors, (read, cast) = compare(m, k, n, cores=[c for c in CORES.value if c])
  print(f"[round_trip] {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{m}x{k}x{n}, e4m3 rowwise, bias + ReLU")
  print("| result | vs quantized fp64 | vs unquantized fp64 |\n|---|---|---|")
  for name, (quantized, unquantized) in errors.items():
    print(f"| {name} | {quantized:.2e} | {unquantized:.2e} |")
  print(f"underflow of x: read in one program {read:.3e}, the cast's zero codes {cast:.3e}")


if __name__ == "__main__":
  app.run(main)
