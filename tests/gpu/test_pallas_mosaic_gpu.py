"""GPU checks of the Mosaic GPU FP8 kernels (compiled: TMA, Hopper FP8 wgmma): real numerics.

Run on an H100/H200: `python3 -m pytest tests/gpu/test_pallas_mosaic_gpu.py -m gpu -q`.
(a) site error: SQNR >= 18 dB against the fp32 HIGHEST product of the original operands;
(b) kernel correctness: close to the fp32 HIGHEST product of the kernel's own dequantized
operands. The tensor cores accumulate FP8 products at a precision of their own, so (b) is
looser than in interpret mode, and loosest where they accumulate the whole K. Garbage
in an unwritten tile (a TMA store that missed it) fails (b) elementwise.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import fused, mosaic_gemm, products
from kernels_pallas import quantize as kq
from kernels_pallas.epilogue import Epilogue
from loka_jax import kernels
from loka_jax.kernels import EinsumSpec, reference_einsum
from loka_jax.kernels.backend import compiled_backend
from loka_jax.precision import metrics

from gpu_helpers import close, heavy, operands

SITE_SQNR_DB = 18.0
DENSE = EinsumSpec.parse("mk,kn->mn")


@pytest.mark.parametrize("name", ["pallas_mosaic_fp8_rowwise",
                                  "pallas_mosaic_fp8_rowwise_precise",
                                  "pallas_mosaic_fp8_blockwise"])
@pytest.mark.parametrize("pass_name", ["fwd", "grad_lhs", "grad_rhs"])
@pytest.mark.parametrize("m,k,n", [(2048, 256, 768), (1000, 1000, 300), (512, 12320, 256)])
def test_dense_passes(name, pass_name, m, k, n):
  a, b = operands(pass_name, m, k, n, seed=m + k + n)
  spec = DENSE.for_pass(pass_name)
  kernel = kernels.get(name)
  run = lambda a, b: kernel.einsum(spec, a, b, pass_name=pass_name, out_dtype=jnp.float32)
  assert compiled_backend(run, a, b) == "pallas_mosaic_gpu"
  out = jax.jit(run)(a, b)
  assert float(metrics.sqnr_db(out, reference_einsum(spec, a, b))) >= SITE_SQNR_DB
  da, db = products.dequantized_operands(spec, a, b, mode=kernel.mode, pass_name=pass_name)
  # The whole K at the tensor cores' accumulation precision drifts further from the fp32 sum
  # than a sum promoted every 128 products does (at K = 12320 most of all).
  promoted = kernel.precise or kernel.mode == "blockwise"
  close(out, reference_einsum(spec, da, db), rtol=5e-3 if promoted else 2e-2)


@pytest.mark.parametrize("spec_text,lhs,rhs", [
    ("bnd,bdk->bnk", (4096, 16, 128), (4096, 128, 24)),
    ("bnd,bdk->bnk", (4096, 96, 128), (4096, 128, 96)),
    ("bfd,bgd->bfg", (1024, 27, 128), (1024, 27, 128)),
])
@pytest.mark.parametrize("pass_name", ["fwd", "grad_lhs", "grad_rhs"])
def test_batched(spec_text, lhs, rhs, pass_name):
  k1, k2, k3 = jax.random.split(jax.random.key(len(spec_text) + lhs[1]), 3)
  x, y = heavy(k1, lhs), heavy(k2, rhs)
  spec = EinsumSpec.parse(spec_text)
  out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec_text, a, b), x, y).shape
  g = heavy(k3, out_shape)
  a, b = {"fwd": (x, y), "grad_lhs": (g, y), "grad_rhs": (x, g)}[pass_name]
  pass_spec = spec.for_pass(pass_name)
  kernel = kernels.get("pallas_mosaic_fp8_batched")
  out = jax.jit(lambda a, b: kernel.einsum(pass_spec, a, b, pass_name=pass_name,
                                           out_dtype=jnp.float32))(a, b)
  assert float(metrics.sqnr_db(out, reference_einsum(pass_spec, a, b))) >= SITE_SQNR_DB
  da, db = products.dequantized_operands(pass_spec, a, b, mode="rowwise", pass_name=pass_name)
  close(out, reference_einsum(pass_spec, da, db), rtol=5e-3)


@pytest.mark.parametrize("m,k,n", [(2048, 256, 768), (8192, 1024, 1024), (333, 200, 300)])
def test_core_epilogue_and_pre_norm(m, k, n):
  """The fused epilogue on the tensor cores' accumulator, and the pre-norm value stored
  beside it, against the reference epilogue on the same dequantized operands."""
  keys = jax.random.split(jax.random.key(m + n), 5)
  a = (jax.random.normal(keys[0], (1, m, k)) * 4).astype(jnp.float8_e4m3fn)
  b = (jax.random.normal(keys[1], (1, n, k)) * 4).astype(jnp.float8_e4m3fn)
  sa = jnp.exp(jax.random.uniform(keys[2], (1, m), minval=-2.0, maxval=2.0))
  sb = jnp.exp(jax.random.uniform(keys[3], (1, n), minval=-2.0, maxval=2.0))
  bias = jax.random.normal(keys[4], (n,))
  ep = Epilogue(bias=True, block_size=256, activation="hard_swish", emit_pre=True)
  out, pre = jax.jit(lambda *x: mosaic_gemm.gemm(*x[:4], epilogue=ep, bias=x[4],
                                                 out_dtype=jnp.float32))(a, b, sa, sb, bias)
  da, db = a.astype(jnp.float32) * sa[..., None], b.astype(jnp.float32) * sb[..., None]
  close(out, mosaic_gemm.reference(da, db, epilogue=ep, bias=bias), rtol=5e-3)
  close(pre, mosaic_gemm.reference(da, db, epilogue=Epilogue(bias=True), bias=bias),
        rtol=5e-3)


@pytest.mark.parametrize("block_size,activation", [(None, "relu"), (256, "hard_swish")])
def test_fused_chain_trains(block_size, activation):
  """fused_dense on the Mosaic GPU core: forward against the reference on the kernel's own
  quantizer, and its custom_vjp (dgrad, wgrad on pallas_mosaic_fp8_rowwise) against
  jax.grad of the reference."""
  x, w = operands("fwd", 2048, 512, 1024, seed=11)
  bias = jax.random.normal(jax.random.key(12), (1024,))
  cot = jax.random.normal(jax.random.key(13), (2048, 1024))
  kw = dict(block_size=block_size, activation=activation, out_dtype=jnp.float32)

  def loss(fn, **extra):
    return lambda x, w, b: jnp.sum(fn(x, w, bias=b, **kw, **extra) * cot)

  out, ref, got, want = jax.jit(lambda x, w, bias: (
      fused.fused_dense(x, w, bias=bias, core=fused.MOSAIC_GPU, **kw),
      fused.fused_dense_reference(x, w, bias=bias, quantizer=kq.quantize, **kw),
      jax.grad(loss(fused.fused_dense, core=fused.MOSAIC_GPU,
                    backward="pallas_mosaic_fp8_rowwise"), argnums=(0, 1, 2))(x, w, bias),
      jax.grad(loss(fused.fused_dense_reference, quantizer=kq.quantize),
               argnums=(0, 1, 2))(x, w, bias)))(x, w.astype(jnp.float32), bias)
  close(out, ref, rtol=5e-3)
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    assert np.all(np.isfinite(np.asarray(g))), name
    assert float(metrics.sqnr_db(g, r)) >= 25.0, name
