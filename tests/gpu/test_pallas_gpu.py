"""GPU checks of the Pallas Triton FP8 kernels (compiled, not interpreted): real numerics.

Run on an H100/H200: `python3 -m pytest tests/gpu/test_pallas_gpu.py -m gpu -q --timeout=900`.
(a) site error: SQNR >= 18 dB against the fp32 HIGHEST product of the original operands;
(b) kernel correctness: close to the fp32 HIGHEST product of the kernel's own dequantized
operands (tensor-core accumulation order differs from the CPU, so tolerances are looser than
the interpret-mode tests). Garbage left in unwritten tiles fails (b) elementwise.
"""
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import fused, products, tuning
from kernels_pallas import gemm as gemm_lib
from kernels_pallas.epilogue import Epilogue
from kernels_pallas import quantize as kq
from loka_jax import kernels
from loka_jax.kernels import EinsumSpec, reference_einsum
from loka_jax.mods import functional
from loka_jax.precision import E4M3, metrics, scaling

from gpu_helpers import BATCHED_SHAPES, SITE_SQNR_DB, check_batched_pass
from gpu_helpers import close as _close, heavy as _heavy, operands as _operands
DENSE = EinsumSpec.parse("mk,kn->mn")


@pytest.mark.parametrize("name", ["pallas_fp8_rowwise", "pallas_fp8_blockwise"])
@pytest.mark.parametrize("pass_name", ["fwd", "grad_lhs", "grad_rhs"])
@pytest.mark.parametrize("m,k,n", [(2048, 256, 768), (1000, 1000, 300), (512, 12320, 256)])
def test_dense_passes(name, pass_name, m, k, n):
  a, b = _operands(pass_name, m, k, n, seed=m + k + n)
  spec = DENSE.for_pass(pass_name)
  kernel = kernels.get(name)
  out = jax.jit(lambda a, b: kernel.einsum(spec, a, b, pass_name=pass_name,
                                           out_dtype=jnp.float32))(a, b)
  site_ref = reference_einsum(spec, a, b)
  assert float(metrics.sqnr_db(out, site_ref)) >= SITE_SQNR_DB
  da, db = products.dequantized_operands(spec, a, b, mode=kernel.mode, pass_name=pass_name)
  _close(out, reference_einsum(spec, da, db), rtol=2e-3)


NARROW_MK = (8192, 2048)   # a tower's logit head: M rows, K -> n


@pytest.mark.parametrize("name", ["pallas_fp8_rowwise", "pallas_fp8_blockwise"])
@pytest.mark.parametrize("pass_name", ["fwd", "grad_lhs", "grad_rhs"])
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("vmapped", [False, True])
def test_dense_passes_at_a_narrow_output_in_bf16(name, pass_name, n, vmapped):
  """A tower's logit head (K x n), in the sites' output dtype: the probe, which evaluates
  kernels vmapped over samples, read these kernels' forward there at -1.2 and 13.3 dB and
  their weight gradient at 3 dB on the GPU (an H100).
  Plain and vmapped, to tell a kernel fault from an evaluation one."""
  spec = DENSE.for_pass(pass_name)
  kernel = kernels.get(name)
  problems = [_operands(pass_name, *NARROW_MK, n, seed=n + seed)
              for seed in range(3 if vmapped else 1)]
  run = lambda a, b: kernel.einsum(spec, a, b, pass_name=pass_name, out_dtype=jnp.bfloat16)
  if vmapped:
    outs = jax.jit(jax.vmap(run))(*(jnp.stack(t) for t in zip(*problems)))
  else:
    outs = jax.jit(run)(*problems[0])[None]
  for out, (a, b) in zip(outs, problems):
    da, db = products.dequantized_operands(spec, a, b, mode=kernel.mode, pass_name=pass_name)
    assert float(metrics.sqnr_db(out, reference_einsum(spec, da, db))) >= 35.0


def test_largest_k_tail():
  """K = 123200 (962.5 x 128): the masked K tail on the benchmark's largest contraction."""
  a, b = _operands("fwd", 256, 123200, 256, seed=3)
  for name in ("pallas_fp8_rowwise", "pallas_fp8_blockwise"):
    kernel = kernels.get(name)
    out = jax.jit(lambda a, b: kernel.einsum(DENSE, a, b, pass_name="fwd",
                                             out_dtype=jnp.float32))(a, b)
    assert float(metrics.sqnr_db(out, reference_einsum(DENSE, a, b))) >= SITE_SQNR_DB, name


def test_weight_gradient_split_k():
  """grad_rhs over a long flattened batch splits K (`gemm.split_k_for`): InterFormer `small`'s
  sequence projections, (128 x 128) summed over K = 540,672 rows."""
  x, g = _operands("grad_rhs", 540672, 128, 128, seed=7)
  spec = DENSE.for_pass("grad_rhs")
  kernel = kernels.get("pallas_fp8_rowwise")
  assert gemm_lib.split_k_for((1, 128, 128, 540672), a_t=True, b_t=False,
                              epilogue=Epilogue()) > 1
  out = jax.jit(lambda a, b: kernel.einsum(spec, a, b, pass_name="grad_rhs",
                                           out_dtype=jnp.float32))(x, g)
  assert float(metrics.sqnr_db(out, reference_einsum(spec, x, g))) >= SITE_SQNR_DB
  da, db = products.dequantized_operands(spec, x, g, mode="rowwise", pass_name="grad_rhs")
  _close(out, reference_einsum(spec, da, db), rtol=2e-3)


@pytest.mark.parametrize("acc", [128, 1 << 30])
def test_fp8_fast_accumulation(acc):
  """With maxNumImpreciseAcc set (Triton may then use FP8 wgmma), the rowwise GEMM still
  meets the site's SQNR bound against the float32 reference, including the K = 123200 tail."""
  from kernels_pallas import compat as pallas_compat
  for m, k, n in ((2048, 1024, 1024), (256, 123200, 256)):
    a, b = _operands("fwd", m, k, n, seed=k + acc % 7)
    kernel = kernels.get("pallas_fp8_rowwise")
    with pallas_compat.fp8_accumulation(acc):
      out = jax.jit(lambda a, b: kernel.einsum(DENSE, a, b, pass_name="fwd",
                                               out_dtype=jnp.float32))(a, b)
    assert float(metrics.sqnr_db(out, reference_einsum(DENSE, a, b))) >= SITE_SQNR_DB, (m, k, n)


@pytest.mark.parametrize("spec_text,lhs,rhs", BATCHED_SHAPES)
@pytest.mark.parametrize("pass_name", ["fwd", "grad_lhs", "grad_rhs"])
def test_batched(spec_text, lhs, rhs, pass_name):
  check_batched_pass("pallas_fp8_batched", spec_text, lhs, rhs, pass_name, rtol=2e-3)


@pytest.mark.parametrize("gran,axes", [("rowwise", (1,)), ("rowwise", (0,)), ("tensorwise", ()),
                                       ("block_1x128", (1,)), ("block_1x128", (0,)),
                                       ("block_128x128", (0,))])
def test_quantize_matches_reference(gran, axes):
  x = _heavy(jax.random.key(1), (4096, 1000), jnp.float32)
  x = x.at[5, 7].set(jnp.nan).at[9, 3].set(jnp.inf).at[11].set(0.0)
  got = jax.jit(lambda x: kq.quantize(x, "e4m3", gran, axes))(x)
  want = scaling.quantize(x, E4M3, gran, axes)
  np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), rtol=2.5e-7)
  expected = scaling.quantize_with_scale(x, got.expanded_scale(), E4M3)
  same = np.asarray(got.data.astype(jnp.float32)) == np.asarray(expected.astype(jnp.float32))
  nan_both = np.isnan(np.asarray(got.data.astype(jnp.float32))) & np.isnan(
      np.asarray(expected.astype(jnp.float32)))
  assert np.all(same | nan_both), f"{np.sum(~(same | nan_both))} codes differ"


@pytest.mark.parametrize("m,k,n", [(4096, 512, 512), (8192, 1024, 1024), (2048, 256, 768)])
def test_fused_dense(m, k, n):
  keys = jax.random.split(jax.random.key(m + n), 3)
  x = _heavy(keys[0], (m, k))
  w = jax.random.normal(keys[1], (k, n)) / np.sqrt(k)
  bias = jax.random.normal(keys[2], (n,))
  kw = dict(bias=bias, block_size=256, activation="hard_swish")
  out = jax.jit(lambda x, w: fused.fused_dense(x, w, out_dtype=jnp.float32, **kw))(x, w)
  ref = fused.fused_dense_reference(x, w, out_dtype=jnp.float32, quantizer=kq.quantize, **kw)
  _close(out, ref, rtol=2e-3)
  exact = functional.hard_swish(functional.block_norm(
      jnp.dot(x.astype(jnp.float32), w, precision="highest") + bias, 256))
  assert float(metrics.sqnr_db(out, exact)) >= SITE_SQNR_DB
  q = jax.jit(lambda x, w: fused.fused_dense(x, w, quantize_output=True, **kw))(x, w)
  assert float(metrics.sqnr_db(q.dequantize(), exact)) >= SITE_SQNR_DB
  cot = jax.random.normal(keys[0], (m, n))
  grads = jax.jit(jax.grad(lambda x, w, b: jnp.sum(fused.fused_dense(
      x, w, bias=b, block_size=256, activation="hard_swish", out_dtype=jnp.float32) * cot),
                           argnums=(0, 1, 2)))(x, w, bias)
  want = jax.grad(lambda x, w, b: jnp.sum(fused.fused_dense_reference(
      x, w, bias=b, block_size=256, activation="hard_swish", out_dtype=jnp.float32) * cot),
                  argnums=(0, 1, 2))(x, w, bias)
  for got, ref in zip(grads, want):
    assert float(metrics.sqnr_db(got, ref)) >= SITE_SQNR_DB


def test_autotune_writes_the_cache():
  with tempfile.TemporaryDirectory() as tmp:
    os.environ[tuning.ENV_DIR] = tmp
    tuning.clear_memory()
    try:
      x = _heavy(jax.random.key(0), (1024, 512))
      w = jax.random.normal(jax.random.key(1), (512, 512)).astype(jnp.bfloat16)
      qx = kq.quantize(x, "e4m3", "rowwise", (1,))
      qw = kq.quantize(w, "e4m3", "rowwise", (0,))
      dims = (1, 1024, 512, 512)
      cands = gemm_lib.candidate_configs(dims, Epilogue(), gemm_lib.ROWWISE_SCALES)[:3]
      args = (qx.data[None], qw.data[None], qx.scale.reshape(1, -1), qw.scale.reshape(1, -1))
      best = tuning.tune("test_kernel", "key", cands, lambda c: (
          functools.partial(gemm_lib.gemm, config=c), args))
      tuning.clear_memory()
      assert tuning.cached("test_kernel", "key") == best
    finally:
      os.environ.pop(tuning.ENV_DIR, None)
      tuning.clear_memory()
