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
from kernels_pallas.epilogue import Epilogue
from loka_jax import kernels
from loka_jax.kernels import EinsumSpec, reference_einsum
from loka_jax.kernels.backend import compiled_backend
from loka_jax.precision import metrics

from gpu_helpers import BATCHED_SHAPES, SITE_SQNR_DB, check_batched_pass, close, operands
from kernel_helpers import e4m3_steps, fused_dense_against_reference, mosaic_core_operands
from loka_jax.precision import E4M3, ROWWISE, scaling
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
  da, db = products.dequantized_operands(spec, a, b, mode=kernel.mode, pass_name=pass_name,
                                         quantize=kernel.quantizer)
  # The whole K at the tensor cores' accumulation precision drifts further from the fp32 sum
  # than a sum promoted every 128 products does (at K = 12320 most of all).
  promoted = kernel.precise or kernel.mode == "blockwise"
  close(out, reference_einsum(spec, da, db), rtol=5e-3 if promoted else 2e-2)


@pytest.mark.parametrize("spec_text,lhs,rhs", BATCHED_SHAPES)
@pytest.mark.parametrize("pass_name", ["fwd", "grad_lhs", "grad_rhs"])
def test_batched(spec_text, lhs, rhs, pass_name):
  check_batched_pass("pallas_mosaic_fp8_batched", spec_text, lhs, rhs, pass_name, rtol=2e-2)


@pytest.mark.parametrize("m,k,n", [(2048, 256, 768), (8192, 1024, 1024), (333, 200, 300)])
def test_core_epilogue_and_pre_norm(m, k, n):
  """The fused epilogue on the tensor cores' accumulator, and the pre-norm value stored
  beside it, against the reference epilogue on the same dequantized operands."""
  a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(m + n), 1, m, n, k)
  ep = Epilogue(bias=True, block_size=256, activation="hard_swish", emit_pre=True)
  out, pre = jax.jit(lambda *x: mosaic_gemm.gemm(*x[:4], epilogue=ep, bias=x[4],
                                                 out_dtype=jnp.float32))(a, b, sa, sb, bias)
  da, db = a.astype(jnp.float32) * sa[..., None], b.astype(jnp.float32) * sb[..., None]
  close(out, mosaic_gemm.reference(da, db, epilogue=ep, bias=bias), rtol=5e-3)
  close(pre, mosaic_gemm.reference(da, db, epilogue=Epilogue(bias=True), bias=bias),
        rtol=5e-3)


@pytest.mark.parametrize("block_size,activation", [(None, "relu"), (256, "hard_swish")])
def test_fused_chain_trains(block_size, activation):
  """fused_dense on the Mosaic GPU core: forward against the reference on the core's own
  quantizer, and its custom_vjp (dgrad, wgrad on pallas_mosaic_fp8_rowwise) against
  jax.grad of the reference."""
  x, w = operands("fwd", 2048, 512, 1024, seed=11)
  bias = jax.random.normal(jax.random.key(12), (1024,))
  cot = jax.random.normal(jax.random.key(13), (2048, 1024))
  out, ref, got, want = fused_dense_against_reference(
      x, w.astype(jnp.float32), bias, cot, core=fused.MOSAIC_GPU,
      backward="pallas_mosaic_fp8_rowwise", quantizer=mosaic_gemm.QUANTIZE,
      block_size=block_size, activation=activation,
      out_dtype=jnp.float32)
  close(out, ref, rtol=5e-3)
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    assert np.all(np.isfinite(np.asarray(g))), name
    assert float(metrics.sqnr_db(g, r)) >= 25.0, name


@pytest.mark.parametrize("m,k,n,block_size,activation", [
    (2048, 512, 256, 256, "hard_swish"), (333, 200, 200, None, "relu"),
    (8192, 1024, 64, None, "hard_swish")])
def test_core_output_quantization(m, k, n, block_size, activation):
  """The rowwise e4m3 output (codes and one scale a row) against the library's quantize of
  the same kernel's fp32 output: both come from the same accumulator, so only a division on
  a rounding boundary may move a code, by one step."""
  a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(m + k + n), 1, m, n, k)
  ep = Epilogue(bias=True, block_size=block_size, activation=activation)
  quantized = Epilogue(bias=True, block_size=block_size, activation=activation,
                       quantize_output=True)
  run = lambda e, **kw: jax.jit(lambda *x: mosaic_gemm.gemm(*x[:4], epilogue=e, bias=x[4],
                                                            **kw))(a, b, sa, sb, bias)
  codes, scales = run(quantized)
  y = run(ep, out_dtype=jnp.float32)
  want = scaling.quantize(y, E4M3, ROWWISE, (2,))
  close(scales, want.scale[..., 0], rtol=1e-6)
  mismatched, furthest = e4m3_steps(codes, want.data)
  assert furthest <= 1 and mismatched < 1e-2, (mismatched, furthest)
  da, db = a.astype(jnp.float32) * sa[..., None], b.astype(jnp.float32) * sb[..., None]
  close(y, mosaic_gemm.reference(da, db, epilogue=ep, bias=bias), rtol=5e-3)


WS_PLAIN = Epilogue()
WS_FUSED = Epilogue(bias=True, block_size=128, activation="hard_swish", emit_pre=True)


@pytest.mark.parametrize("m,k,n", [(2048, 256, 768), (8192, 1024, 1024), (333, 200, 300)])
@pytest.mark.parametrize("tile,ep", [((64, 128, 4, 2), WS_PLAIN), ((128, 128, 2, 2), WS_PLAIN),
                                     ((128, 64, 4, 2), WS_PLAIN), ((64, 128, 2, 2), WS_FUSED)])
def test_warp_specialized_core(m, k, n, tile, ep):
  """The warp-specialized core (a memory warpgroup, two compute warpgroups) against the
  reference on its dequantized operands, and against the 1-warpgroup core, whose wgmma
  sequence and epilogue per output tile are the same (fp32 outputs: the widest tiles that
  fit them)."""
  a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(m + k + n), 1, m, n, k)
  run = lambda cfg: jax.jit(lambda *x: mosaic_gemm.gemm(
      *x[:4], epilogue=ep, bias=x[4] if ep.bias else None, out_dtype=jnp.float32,
      config=cfg))(a, b, sa, sb, bias)
  ws = run(mosaic_gemm.MosaicConfig(*tile))
  one = run(mosaic_gemm.MosaicConfig(tile[0], tile[1], 2))
  ws, one = (x if isinstance(x, tuple) else (x,) for x in (ws, one))
  da, db = a.astype(jnp.float32) * sa[..., None], b.astype(jnp.float32) * sb[..., None]
  close(ws[0], mosaic_gemm.reference(da, db, epilogue=ep, bias=bias), rtol=2e-2)
  for got, want in zip(ws, one):
    close(got, want, rtol=1e-5)
