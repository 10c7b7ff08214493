"""GPU numerics of the XLA / Flax kernels (run on the GPU host:
python3 -m pytest tests/gpu -m gpu)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loka_jax import kernels
from loka_jax.kernels import check
from loka_jax.kernels.backend import backend_from_hlo
from loka_jax.kernels.base import reference_einsum
from loka_jax.precision import metrics

DENSE = kernels.EinsumSpec.parse("mk,kn->mn")
XLA_FP8 = [n for n in kernels.names() if n.startswith("xla_fp8")]


@pytest.mark.parametrize("name", XLA_FP8)
@pytest.mark.parametrize("pass_name", kernels.PASSES)
@pytest.mark.parametrize("shape", [(1000, 1536, 520), (4096, 512, 768)])
def test_fp8_kernel_on_gpu(name, pass_name, shape):
  kernel = kernels.get(name)
  x, w, g = check.Problem(*shape, seed=11).operands()
  spec = DENSE.for_pass(pass_name)
  a, b = (t.astype(jnp.bfloat16) for t in check.pass_operands(pass_name, x, w, g))
  fn = jax.jit(functools.partial(kernel.einsum, spec, pass_name=pass_name, out_dtype=jnp.float32))
  compiled = fn.lower(a, b).compile()
  out = compiled(a, b)
  # It really runs an FP8 GEMM (cuBLASLt FP8 or XLA's Triton GEMM on FP8 operands).
  backend = backend_from_hlo(compiled.as_text(), "gpu")
  assert backend in ("cublaslt_fp8", "xla_triton_gemm", "xla_triton"), backend
  qa, qb = kernel.quantized_operands(spec, a, b, pass_name=pass_name)
  ref_b = reference_einsum(spec, qa.dequantize(), qb.dequantize())
  # Tensor-core accumulation: fast accumulation keeps fewer bits than fp32.
  assert float(metrics.sqnr_db(out, ref_b)) >= 40.0
  orig = check.pass_operands(pass_name, x, w, g)
  assert float(metrics.sqnr_db(out, reference_einsum(spec, *orig))) >= 18.0
  assert np.isfinite(np.asarray(out)).all()


def test_flax_delayed_on_gpu():
  x, w, g = check.Problem(2048, 1024, 512, seed=12).operands()
  out, dx, dw, _ = kernels.flax_delayed.run_delayed_passes(
      "mk,kn->mn", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), g.astype(jnp.bfloat16))
  for got, want in ((out, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    assert float(metrics.sqnr_db(got, want)) >= 18.0


NARROW_MK = (8192, 2048)   # a tower's logit head: M rows, K -> n
# The probe's 3-18 dB readings at such heads are far below both bars below.


@pytest.mark.parametrize("name", XLA_FP8)
@pytest.mark.parametrize("pass_name", kernels.PASSES)
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("vmapped", [False, True])
def test_fp8_kernel_at_a_narrow_output_in_bf16(name, pass_name, n, vmapped):
  """A tower's logit head (K x n), in the sites' output dtype: the probe, which evaluates
  kernels vmapped over samples, read XLA tensorwise's forward there at 12-18 dB on an H100.
  Plain and vmapped, to tell a kernel fault from
  an evaluation one."""
  kernel = kernels.get(name)
  spec = DENSE.for_pass(pass_name)
  problems = []
  for seed in range(3 if vmapped else 1):
    x, w, g = check.Problem(*NARROW_MK, n, seed=13 + seed).operands()
    problems.append(tuple(t.astype(jnp.bfloat16)
                          for t in check.pass_operands(pass_name, x, w, g)))
  run = functools.partial(kernel.einsum, spec, pass_name=pass_name, out_dtype=jnp.bfloat16)
  if vmapped:
    outs = jax.jit(jax.vmap(run))(*(jnp.stack(t) for t in zip(*problems)))
  else:
    outs = jax.jit(run)(*problems[0])[None]
  for out, (a, b) in zip(outs, problems):
    qa, qb = kernel.quantized_operands(spec, a, b, pass_name=pass_name)
    ref_b = reference_einsum(spec, qa.dequantize(), qb.dequantize())
    precise_at_one = n == 1 and not kernel.accumulates_fast(pass_name)
    bar = check.PRECISE_AT_ONE_COLUMN_DB if precise_at_one else 35.0
    assert float(metrics.sqnr_db(out, ref_b)) >= bar
