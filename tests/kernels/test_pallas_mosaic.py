"""The Mosaic GPU FP8 GEMM core and its per-pass kernels, run in jax's GPU interpret mode
(shared memory, TMA and wgmma simulated on the CPU) against fp32 HIGHEST products of their
own dequantized operands on fresh random inputs, and lowered for 'cuda' (the compiled
kernel's Mosaic GPU module is built, so wgmma shapes, layouts and shared memory are checked
without a GPU)."""
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import chex

from kernels_pallas import epilogue as ep_lib
from kernels_pallas import fused, mosaic_gemm, products, registration, tuning
from loka_jax import kernels
from loka_jax.kernels import EinsumSpec, reference_einsum
from loka_jax.kernels.backend import backend_from_hlo
from loka_jax.models import fused as fused_sites
from loka_jax.precision import E4M3, ROWWISE, QTensor, metrics, scaling
from loka_jax.probe import candidates, chains

from kernel_helpers import assert_close as _assert_close
from kernel_helpers import (e4m3_steps, fused_dense_against_reference, mosaic_core_operands,
                            mosaic_shared_memory)
from kernel_helpers import rel_err as _rel_err

DENSE = EinsumSpec.parse("mk,kn->mn")


def _core_reference(a, b, sa, sb, epilogue, bias):
  return mosaic_gemm.reference(a.astype(jnp.float32) * sa[..., None],
                               b.astype(jnp.float32) * sb[..., None], epilogue=epilogue,
                               bias=bias if epilogue.bias else None)


class MosaicCoreTest(parameterized.TestCase):

  def test_plain_product_with_every_tail(self):
    # M, N and K all fall short of whole tiles (64/128 rows, 64/128 columns, 128-wide K).
    a, b, sa, sb, _ = mosaic_core_operands(jax.random.key(1), 1, 100, 200, 300)
    out = mosaic_gemm.gemm(a, b, sa, sb, out_dtype=jnp.float32)
    _assert_close(self, out, _core_reference(a, b, sa, sb, ep_lib.Epilogue(), None))

  @parameterized.named_parameters(
      ("bias_blocknorm128_hard_swish_pre", ep_lib.Epilogue(
          bias=True, block_size=128, activation="hard_swish", emit_pre=True), (2, 128, 256, 256)),
      # 300 columns: the second BlockNorm(256) block is 44 wide and normalizes over its own.
      ("bias_blocknorm256_relu_short_block", ep_lib.Epilogue(
          bias=True, block_size=256, activation="relu"), (1, 64, 300, 128)))
  def test_fused_epilogue(self, epilogue, dims):
    a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(sum(dims)), *dims)
    outs = mosaic_gemm.gemm(a, b, sa, sb, epilogue=epilogue, bias=bias, out_dtype=jnp.float32)
    outs = outs if isinstance(outs, tuple) else (outs,)
    _assert_close(self, outs[0], _core_reference(a, b, sa, sb, epilogue, bias), rtol=1e-4)
    if epilogue.emit_pre:
      pre_ref = _core_reference(a, b, sa, sb, ep_lib.Epilogue(bias=True), bias)
      _assert_close(self, outs[1], pre_ref)

  @parameterized.named_parameters(
      # Two batch entries, and M, N and K all short of whole (128, 128) tiles and 128-wide
      # K steps.
      ("tails_fp32_out", ep_lib.Epilogue(), (2, 100, 200, 300), (64, 128, 2, 2),
       jnp.float32),
      ("rows_of_128_bf16_out", ep_lib.Epilogue(), (1, 256, 256, 512), (128, 128, 3, 2),
       jnp.bfloat16),
      ("bias_blocknorm128_hard_swish_pre", ep_lib.Epilogue(
          bias=True, block_size=128, activation="hard_swish", emit_pre=True),
       (1, 200, 256, 256), (64, 128, 2, 2), jnp.float32),
      ("bias_blocknorm256_relu_quantized", ep_lib.Epilogue(
          bias=True, block_size=256, activation="relu", quantize_output=True),
       (1, 130, 200, 256), (64, 256, 2, 2), jnp.bfloat16))
  def test_warp_specialized_core(self, epilogue, dims, tile, dtype):
    # One memory warpgroup feeding two compute warpgroups, each on its own rows, computes
    # what the 1-warpgroup core does, epilogue included: the same numbers in interpret mode.
    a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(sum(dims) + 2), *dims)
    cfg = mosaic_gemm.MosaicConfig(*tile)
    self.assertIsNone(mosaic_gemm.validate_config(cfg, dims, epilogue, dtype, dtype))
    run = lambda c: mosaic_gemm.gemm(a, b, sa, sb, epilogue=epilogue, bias=bias, out_dtype=dtype,
                                     pre_dtype=dtype, config=c)
    got, one = run(cfg), run(mosaic_gemm.MosaicConfig(tile[0], tile[1], 2))
    got, one = (x if isinstance(x, tuple) else (x,) for x in (got, one))
    self.assertLen(got, len(one))
    for g, o in zip(got, one):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(o, np.float32))
    if not epilogue.quantize_output:
      _assert_close(self, got[0], _core_reference(a, b, sa, sb, epilogue, bias),
                    rtol=1e-4 if dtype == jnp.float32 else 1e-2)
    # Its compiled module is built for 'cuda' by the shared-memory test's tiles below.

  def test_warp_specialized_tiles_only_where_they_apply(self):
    dims, ws = (1, 2048, 1024, 1024), mosaic_gemm.MosaicConfig(64, 128, 4, 2)
    plain = ep_lib.Epilogue()
    for ep in (plain, ep_lib.Epilogue(bias=True, block_size=256, activation="relu")):
      cands = mosaic_gemm.candidate_configs(dims, ep)
      self.assertBetween(len([c for c in cands if c.compute_wgs == 2]), 1, 3, ep)
    for kw in ({"promote": True}, {"block_scales": True}):
      cands = mosaic_gemm.candidate_configs(dims, plain, **kw)
      self.assertEqual([c for c in cands if c.compute_wgs != 1], [], kw)
    self.assertIn("accumulated on the tensor cores",
                  mosaic_gemm.validate_config(ws, dims, plain, promote=True))
    self.assertIn("compute_wgs=3 must be 1 or 2", mosaic_gemm.validate_config(
        mosaic_gemm.MosaicConfig(64, 128, 4, 3), dims, plain))
    # A tuning cache written before the field existed reads as the 1-warpgroup core.
    self.assertEqual(mosaic_gemm.MosaicConfig.from_dict(
        {"block_m": 64, "block_n": 128, "stages": 4}).compute_wgs, 1)

  @parameterized.named_parameters(
      # 200 columns in one 256-wide tile; 100 rows and K = 300 fall short of whole tiles.
      ("bias_blocknorm256_hard_swish_tails", ep_lib.Epilogue(
          bias=True, block_size=256, activation="hard_swish", quantize_output=True),
       (1, 100, 200, 300)),
      ("relu_two_batches_64_wide", ep_lib.Epilogue(activation="relu", quantize_output=True),
       (2, 128, 64, 128)))
  def test_output_quantization(self, epilogue, dims):
    # Each row's e4m3 codes and scale, as the library's rowwise quantize of the reference
    # epilogue gives them: the next layer's QTensor without a pass of its own.
    a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(sum(dims) + 1), *dims)
    codes, scales = mosaic_gemm.gemm(a, b, sa, sb, epilogue=epilogue, bias=bias)
    ref = _core_reference(a, b, sa, sb, epilogue, bias)
    want = scaling.quantize(ref, E4M3, ROWWISE, (2,))
    chex.assert_shape((codes, scales), (ref.shape, ref.shape[:2]))
    self.assertEqual(codes.dtype, jnp.float8_e4m3fn)
    _assert_close(self, scales, want.scale[..., 0])
    # The kernel sums its products in another order than the reference's einsum: a value on
    # a rounding boundary may round to the neighbouring code, never further.
    mismatched, furthest = e4m3_steps(codes, want.data)
    self.assertLessEqual(furthest, 1)
    self.assertLess(mismatched, 1e-3)
    # Its compiled module is built for 'cuda' by the shared-memory test's quantized tiles.

  @parameterized.named_parameters(("precise_rowwise", False), ("block_scales", True))
  def test_promoted_k_steps(self, block):
    # Each K step's product summed in fp32 registers (and, with block scales, scaled by its
    # K block's own scales first); K = 300 leaves a partial last block.
    bt, m, n, k = 1, 100, 200, 300
    a, b, sa, sb, _ = mosaic_core_operands(jax.random.key(5), bt, m, n, k)
    if block:
      keys = jax.random.split(jax.random.key(6), 2)
      kb = -(-k // mosaic_gemm.BLOCK_K)
      sa = jnp.exp(jax.random.uniform(keys[0], (bt, kb, m), minval=-2.3, maxval=2.3))
      sb = jnp.exp(jax.random.uniform(keys[1], (bt, kb, n), minval=-2.3, maxval=2.3))
      block_of = jnp.arange(k) // mosaic_gemm.BLOCK_K   # each K index's block
      da = a.astype(jnp.float32) * jnp.swapaxes(sa, 1, 2)[:, :, block_of]
      db = b.astype(jnp.float32) * jnp.swapaxes(sb, 1, 2)[:, :, block_of]
      out = mosaic_gemm.gemm(a, b, sa, sb, scales=mosaic_gemm.BLOCK_SCALES,
                             out_dtype=jnp.float32)
    else:
      da, db = a.astype(jnp.float32) * sa[..., None], b.astype(jnp.float32) * sb[..., None]
      out = mosaic_gemm.gemm(a, b, sa, sb, precise=True, out_dtype=jnp.float32)
    _assert_close(self, out, mosaic_gemm.reference(da, db))
    text = mosaic_gemm.lowered_for_cuda(
        lambda *x: mosaic_gemm.gemm(*x, scales=mosaic_gemm.BLOCK_SCALES if block else "rowwise",
                                    precise=not block), a, b, sa, sb)
    self.assertIn("mosaic_gpu", text)

  def test_lowers_for_cuda(self):
    # The compiled path (TMA into swizzled tiles, FP8 wgmma with a transposed B view,
    # layouts of the epilogue's row and column vectors) builds its Mosaic GPU module.
    a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(2), 1, 256, 512, 384)
    ep = ep_lib.Epilogue(bias=True, block_size=128, activation="hard_swish", emit_pre=True)
    text = mosaic_gemm.lowered_for_cuda(
        lambda *x: mosaic_gemm.gemm(*x[:4], epilogue=ep, bias=x[4]), a, b, sa, sb, bias)
    self.assertIn("mosaic_gpu", text)
    self.assertEqual(backend_from_hlo('custom_call_target="mosaic_gpu_v2"', "gpu"),
                     "pallas_mosaic_gpu")

  @parameterized.named_parameters(
      ("plain_bf16_out", ep_lib.Epilogue(), mosaic_gemm.ROWWISE_SCALES, False,
       jnp.bfloat16, (128, 128, 4)),
      # e4m3 codes and a row of scales in place of the output tile, and the row amax's
      # reduction scratch (beside BlockNorm's, or alone).
      ("blocknorm256_quantized", ep_lib.Epilogue(bias=True, block_size=256, activation="relu",
                                                 quantize_output=True),
       mosaic_gemm.ROWWISE_SCALES, False, jnp.bfloat16, (64, 256, 4), 256),
      ("quantized_64_wide", ep_lib.Epilogue(quantize_output=True),
       mosaic_gemm.ROWWISE_SCALES, False, jnp.bfloat16, (128, 64, 4), 64),
      # Warp-specialized: nothing is released before the output tiles, and each stage has a
      # full and a consumed barrier.
      ("warp_specialized_fp32_out", ep_lib.Epilogue(), mosaic_gemm.ROWWISE_SCALES, False,
       jnp.float32, (64, 128, 4, 2)),
      ("warp_specialized_256_wide", ep_lib.Epilogue(), mosaic_gemm.ROWWISE_SCALES, False,
       jnp.bfloat16, (64, 256, 3, 2)),
      ("warp_specialized_blocknorm_pre", ep_lib.Epilogue(
          bias=True, block_size=128, activation="hard_swish", emit_pre=True),
       mosaic_gemm.ROWWISE_SCALES, False, jnp.bfloat16, (64, 128, 3, 2)),
      ("warp_specialized_quantized", ep_lib.Epilogue(bias=True, activation="relu",
                                                     quantize_output=True),
       mosaic_gemm.ROWWISE_SCALES, False, jnp.bfloat16, (64, 256, 3, 2), 256),
      # K = 256 is two K steps: a pipeline keeps no more stages than it has steps.
      ("stages_past_the_k_steps", ep_lib.Epilogue(), mosaic_gemm.ROWWISE_SCALES, False,
       jnp.bfloat16, (64, 128, 4, 2), 512, 256),
      ("promoted_fp32_out", ep_lib.Epilogue(), mosaic_gemm.ROWWISE_SCALES, True,
       jnp.float32, (64, 128, 4)),
      ("block_scales", ep_lib.Epilogue(), mosaic_gemm.BLOCK_SCALES, False, jnp.bfloat16,
       (64, 128, 3)),
      # The two widest epilogues: fp32 output (and pre-norm) tiles 256 columns wide beside
      # as many stages as fit.
      ("blocknorm256_fp32_out", ep_lib.Epilogue(bias=True, block_size=256,
                                                activation="relu"),
       mosaic_gemm.ROWWISE_SCALES, False, jnp.float32, (64, 256, 4)),
      ("blocknorm256_fp32_pre", ep_lib.Epilogue(bias=True, block_size=256,
                                                activation="hard_swish", emit_pre=True),
       mosaic_gemm.ROWWISE_SCALES, False, jnp.float32, (64, 256, 2)))
  def test_shared_memory_is_counted_as_mosaic_allocates(self, ep, scales, precise, dtype,
                                                        tile, n=512, k=512):
    # validate_config keeps a tile within a Hopper block's shared memory only if
    # shared_memory_bytes counts what Mosaic GPU will ask for at launch.
    cfg, (bt, m) = mosaic_gemm.MosaicConfig(*tile), (1, 256)
    a, b, sa, sb, bias = mosaic_core_operands(jax.random.key(21), bt, m, n, k)
    if scales == mosaic_gemm.BLOCK_SCALES:
      sa = jnp.ones((bt, k // mosaic_gemm.BLOCK_K, m))
      sb = jnp.ones((bt, k // mosaic_gemm.BLOCK_K, n))
    block_scales = scales == mosaic_gemm.BLOCK_SCALES
    self.assertIsNone(mosaic_gemm.validate_config(cfg, (bt, m, n, k), ep, dtype, dtype,
                                                  precise, block_scales))
    sizes = mosaic_shared_memory(
        lambda a, b, sa, sb, bias: mosaic_gemm.gemm(
            a, b, sa, sb, scales=scales, precise=precise, epilogue=ep,
            bias=bias if ep.bias else None, out_dtype=dtype, pre_dtype=dtype, config=cfg),
        a, b, sa, sb, bias)
    self.assertLen(sizes, 1)
    self.assertEqual(sizes[0], mosaic_gemm.shared_memory_bytes(
        cfg, ep, dtype, dtype, block_scales, k_steps=k // mosaic_gemm.BLOCK_K))
    self.assertLessEqual(sizes[0], mosaic_gemm.SMEM_LIMIT)

  def test_default_configs_are_valid(self):
    quantized = ep_lib.Epilogue(bias=True, activation="hard_swish", quantize_output=True)
    for dims in ((1, 8192, 1024, 1024), (1, 64, 96, 4096), (4096, 16, 24, 128),
                 (1, 2048, 4096, 1024), (1, 8192, 256, 1024), (1, 2048, 130, 512)):
      for ep in (ep_lib.Epilogue(), ep_lib.Epilogue(bias=True, block_size=256,
                                                    activation="relu", emit_pre=True),
                 quantized):
        if ep.quantize_output and dims[2] > mosaic_gemm.MAX_BLOCK_N:
          continue
        for dtype in (jnp.bfloat16, jnp.float32):  # fp32 output and pre-norm: the widest
          cfg = mosaic_gemm.default_config(dims, ep, dtype, dtype)
          self.assertIsNone(mosaic_gemm.validate_config(cfg, dims, ep, dtype, dtype),
                            (dims, ep, cfg, dtype))

  def test_candidate_tiles_are_valid_and_the_tuning_cache_is_read(self):
    dims, ep = (1, 64, 64, 128), ep_lib.Epilogue(block_size=128)
    cands = mosaic_gemm.candidate_configs(dims, ep)
    self.assertEqual(cands[0], mosaic_gemm.default_config(dims, ep))
    self.assertBetween(len(cands), 2, tuning.MAX_CANDIDATES)
    for cfg in cands:
      self.assertIsNone(mosaic_gemm.validate_config(cfg, dims, ep), cfg)
    # A config in the tuning cache for this shape is the one the kernel runs: here one that
    # cannot run it (BlockNorm(128) needs 128-wide tiles), so the error names it.
    a, b, sa, sb, _ = mosaic_core_operands(jax.random.key(11), *dims)
    key = mosaic_gemm.shape_key(dims, "rowwise", False, ep, jnp.bfloat16, jnp.float32)
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ,
                                                               {tuning.ENV_DIR: tmp}):
      tuning.clear_memory()
      try:
        tuning.record("pallas_mosaic_gemm", key, mosaic_gemm.MosaicConfig(64, 64, 2), 1.0)
        tuning.clear_memory()   # read back from disk
        self.assertEqual(tuning.cached("pallas_mosaic_gemm", key,
                                       config_type=mosaic_gemm.MosaicConfig),
                         mosaic_gemm.MosaicConfig(64, 64, 2))
        with self.assertRaisesRegex(ValueError, r"MosaicConfig\(block_m=64, block_n=64, "
                                    r"stages=2, compute_wgs=1\) invalid: BlockNorm needs "
                                    r"block_n == block_size \(128\)"):
          mosaic_gemm.gemm(a, b, sa, sb, epilogue=ep)
      finally:
        tuning.clear_memory()

  def test_bad_input_is_one_clear_error(self):
    a, b, sa, sb, _ = mosaic_core_operands(jax.random.key(3), 1, 64, 64, 128)
    with self.assertRaisesRegex(ValueError, "multiple of 64"):
      mosaic_gemm.gemm(a, b, sa, sb, config=mosaic_gemm.MosaicConfig(32, 64, 2))
    with self.assertRaisesRegex(ValueError, "e4m3 operands"):
      mosaic_gemm.gemm(a.astype(jnp.bfloat16), b, sa, sb)
    with self.assertRaisesRegex(ValueError, r"scales must have shapes \(1, 64\)"):
      mosaic_gemm.gemm(a, b, sa[:, :32], sb)
    self.assertIn("BlockNorm(512)", mosaic_gemm.unsupported_epilogue(
        ep_lib.Epilogue(block_size=512)))
    quantized = ep_lib.Epilogue(quantize_output=True)
    self.assertIsNone(mosaic_gemm.unsupported_epilogue(quantized, 256))
    self.assertIn("N=300 is wider than 256 columns (the widest wgmma)",
                  mosaic_gemm.unsupported_epilogue(quantized, 300))
    self.assertIn("N=256 is wider than 128 columns (a BlockNorm block's tile)",
                  mosaic_gemm.unsupported_epilogue(
                      ep_lib.Epilogue(block_size=128, quantize_output=True), 256))
    a, b, sa, sb, _ = mosaic_core_operands(jax.random.key(3), 1, 64, 96, 128)
    with self.assertRaisesRegex(ValueError, "whole rows in one program: block_n=64 < N=96"):
      mosaic_gemm.gemm(a, b, sa, sb, epilogue=quantized,
                       config=mosaic_gemm.MosaicConfig(64, 64, 2))


def _pass_operands(key, pass_name, m, k, n):
  keys = jax.random.split(key, 3)
  x = jax.random.normal(keys[0], (m, k)) * jnp.exp(jax.random.normal(keys[2], (m, 1)))
  w = jax.random.normal(keys[1], (k, n)) / np.sqrt(k)
  g = jax.random.normal(keys[2], (m, n)) * 1e-3
  return {"fwd": (x, w), "grad_lhs": (g, w), "grad_rhs": (x, g)}[pass_name]


class MosaicKernelTest(parameterized.TestCase):

  @parameterized.parameters("fwd", "grad_lhs", "grad_rhs")
  def test_dense_pass(self, pass_name):
    # Each pass stores its operands differently: fwd's weight and grad_rhs's both operands
    # have K first and are transposed to K-last codes before the core.
    spec = DENSE.for_pass(pass_name)
    a, b = _pass_operands(jax.random.key(len(pass_name)), pass_name, 96, 200, 160)
    kernel = kernels.get("pallas_mosaic_fp8_rowwise")
    out = jax.jit(lambda a, b: kernel.einsum(spec, a, b, pass_name=pass_name,
                                             out_dtype=jnp.float32))(a, b)
    da, db = products.dequantized_operands(spec, a, b, mode="rowwise", pass_name=pass_name,
                                           quantize=kernel.quantizer)
    _assert_close(self, out, reference_einsum(spec, da, db))

  @parameterized.named_parameters(
      ("blockwise_fwd", "pallas_mosaic_fp8_blockwise", "blockwise", "fwd"),
      ("blockwise_grad_rhs", "pallas_mosaic_fp8_blockwise", "blockwise", "grad_rhs"),
      ("precise_grad_lhs", "pallas_mosaic_fp8_rowwise_precise", "rowwise", "grad_lhs"))
  def test_promoted_kernels(self, name, mode, pass_name):
    spec = DENSE.for_pass(pass_name)
    a, b = _pass_operands(jax.random.key(len(name)), pass_name, 96, 300, 160)
    kernel = kernels.get(name)
    out = jax.jit(lambda a, b: kernel.einsum(spec, a, b, pass_name=pass_name,
                                             out_dtype=jnp.float32))(a, b)
    da, db = products.dequantized_operands(spec, a, b, mode=mode, pass_name=pass_name,
                                           quantize=kernel.quantizer)
    _assert_close(self, out, reference_einsum(spec, da, db))

  def test_the_probes_vmapped_evaluation_lowers_for_cuda(self):
    # The probe evaluates a kernel vmapped over samples: the batched kernel must compile too.
    spec = DENSE.for_pass("grad_rhs")
    keys = jax.random.split(jax.random.key(7), 2)
    x, g = jax.random.normal(keys[0], (3, 64, 128)), jax.random.normal(keys[1], (3, 64, 96))
    kernel = kernels.get("pallas_mosaic_fp8_rowwise")
    text = mosaic_gemm.lowered_for_cuda(jax.vmap(
        lambda a, b: kernel.einsum(spec, a, b, pass_name="grad_rhs", out_dtype=jnp.float32)),
        x, g)
    self.assertIn("mosaic_gpu", text)

  def test_batched_interaction(self):
    spec = EinsumSpec.parse("bnd,bdk->bnk")
    keys = jax.random.split(jax.random.key(4), 2)
    a, b = jax.random.normal(keys[0], (3, 16, 64)), jax.random.normal(keys[1], (3, 64, 24))
    kernel = kernels.get("pallas_mosaic_fp8_batched")
    self.assertIsNone(kernel.unsupported_reason(spec, "fwd", "act_act", a.shape, b.shape))
    out = jax.jit(lambda a, b: kernel.einsum(spec, a, b, pass_name="fwd",
                                             out_dtype=jnp.float32))(a, b)
    da, db = products.dequantized_operands(spec, a, b, mode="rowwise", pass_name="fwd",
                                           quantize=kernel.quantizer)
    _assert_close(self, out, reference_einsum(spec, da, db))
    self.assertIn("has no batch index", kernel.unsupported_reason(
        DENSE, "fwd", "act_weight", (8, 8), (8, 8)))

  def test_registered_beside_triton_and_left_out_on_cpu(self):
    names = {k.name: k.backend for k in kernels.all_kernels()}
    self.assertEqual(names["pallas_mosaic_fp8_rowwise"], registration.MOSAIC_BACKEND)
    self.assertEqual(names["pallas_fp8_rowwise"], registration.BACKEND)
    self.assertIsNone(registration.mosaic_device_reason())   # CPU: interpret mode
    chosen, excluded = candidates.candidate_kernels(platform="cpu")
    self.assertNotIn("pallas_mosaic_fp8_rowwise", [k.name for k in chosen])
    self.assertIn("interpret mode", excluded["pallas_mosaic_fp8_rowwise"])
    chosen, excluded = candidates.candidate_kernels(platform="gpu")
    self.assertIn("pallas_mosaic_fp8_rowwise", [k.name for k in chosen])
    # The fused-epilogue kernels are default candidates on a GPU as well (chain kernels),
    # with and without output quantization, as the Triton ones.
    fused_names = [n for n in names if n.startswith("pallas_mosaic_fp8_rowwise_fused_")]
    self.assertLen(fused_names, 8)
    self.assertEqual(sorted(n.replace("pallas_mosaic_", "pallas_") for n in fused_names),
                     sorted(n for n in names if n.startswith("pallas_fp8_rowwise_fused_")))
    for name in fused_names:
      self.assertIn(name, [k.name for k in chosen])
      self.assertNotIn(name, excluded)


class MosaicFusedTest(parameterized.TestCase):
  """fused_dense on the Mosaic GPU core: the forward against the unfused reference on the
  core's own quantizer, the custom_vjp (dgrad, wgrad on pallas_mosaic_fp8_rowwise)
  against jax.grad of the reference."""

  def _inputs(self, seed, m=96, k=200, n=256):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (m, k)) * jnp.exp(jax.random.normal(keys[3], (m, 1)))
    return (x, jax.random.normal(keys[1], (k, n)) / np.sqrt(k),
            jax.random.normal(keys[2], (n,)))

  def test_forward_and_gradients(self):
    x, w, bias = self._inputs(7)
    cot = jax.random.normal(jax.random.key(8), (96, 256))
    out, ref, got, want = fused_dense_against_reference(
        x, w, bias, cot, core=fused.MOSAIC_GPU, backward="pallas_mosaic_fp8_rowwise",
        quantizer=mosaic_gemm.QUANTIZE,
        block_size=128, activation="hard_swish", out_dtype=jnp.float32)
    _assert_close(self, out, ref, rtol=1e-4)
    for name, g, r in zip(("dx", "dw", "dbias"), got, want):
      chex.assert_shape(g, r.shape)
      self.assertTrue(bool(jnp.all(jnp.isfinite(g))), name)
      if name == "dbias":  # never goes through an FP8 product
        self.assertLess(_rel_err(g, r), 1e-5, name)
      else:
        self.assertGreater(float(metrics.sqnr_db(g, r)), 25.0, name)

  def test_registered_chain_kernel_and_its_backward(self):
    kernel = kernels.get("pallas_mosaic_fp8_rowwise_fused_blocknorm256_relu")
    self.assertEqual((kernel.backend, kernel.core, kernel.equivalent),
                     (registration.MOSAIC_BACKEND, fused.MOSAIC_GPU,
                      "pallas_mosaic_fp8_rowwise"))
    self.assertEqual(chains.backward_of(kernel), "pallas_mosaic_fp8_rowwise")
    self.assertEqual(chains.core_of(kernel), fused.MOSAIC_GPU)
    triton = kernels.get("pallas_fp8_rowwise_fused_blocknorm256_relu")
    self.assertEqual(chains.backward_of(triton), "pallas_fp8_rowwise")
    # A plan naming the fused kernel in every pass runs its equivalent for dgrad and wgrad.
    choice = kernels.KernelChoice(kernel.name, kernel.name, kernel.name)
    self.assertEqual(fused_sites.backward_kernel(choice, "tower/0"),
                     "pallas_mosaic_fp8_rowwise")
    x, w, bias = self._inputs(9, m=64, k=128, n=256)
    out = jax.jit(lambda x, w, b: kernel.chain(x, w, b, out_dtype=jnp.float32))(x, w, bias)
    ref = fused.fused_dense_reference(x, w, bias=bias, block_size=256, activation="relu",
                                      out_dtype=jnp.float32, quantizer=mosaic_gemm.QUANTIZE)
    _assert_close(self, out, ref, rtol=1e-4)

  def test_quantized_output_feeds_the_next_layer(self):
    # A rowwise e4m3 QTensor straight from the first layer's kernel, read by the second's;
    # each against the reference on the core's own quantizer.
    x, w, bias = self._inputs(11, m=96, k=200, n=192)
    w2 = jax.random.normal(jax.random.key(12), (192, 64)) / np.sqrt(192)
    common = dict(bias=bias, activation="relu", quantize_output=True)
    q, want = jax.jit(lambda x, w, b: (
        fused.fused_dense(x, w, core=fused.MOSAIC_GPU, **{**common, "bias": b}),
        fused.fused_dense_reference(x, w, quantizer=mosaic_gemm.QUANTIZE,
                                    **{**common, "bias": b})))(x, w, bias)
    self.assertIsInstance(q, QTensor)
    chex.assert_shape((q.data, q.scale), ((96, 192), (96, 1)))
    _assert_close(self, q.scale, want.scale)
    mismatched, furthest = e4m3_steps(q.data, want.data)
    self.assertLessEqual(furthest, 1)
    self.assertLess(mismatched, 1e-3)
    out = fused.fused_dense(q, w2, block_size=64, activation="hard_swish",
                            out_dtype=jnp.float32, core=fused.MOSAIC_GPU)
    ref = fused.fused_dense_reference(q, w2, block_size=64, activation="hard_swish",
                                      out_dtype=jnp.float32, quantizer=mosaic_gemm.QUANTIZE)
    _assert_close(self, out, ref, rtol=1e-4)
    # The registered chain kernel returns the same codes dequantized, and refuses rows too
    # wide.
    kernel = kernels.get("pallas_mosaic_fp8_rowwise_fused_relu_quant")
    self.assertFalse(kernel.has_backward)
    got = jax.jit(lambda x, w, b: kernel.chain(x, w, b, out_dtype=jnp.float32))(x, w, bias)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(q.dequantize(jnp.float32)))
    self.assertIsNone(kernel.chain_unsupported_reason(96, 200, 256))
    self.assertIn("N=300 is wider than 256", kernel.chain_unsupported_reason(96, 200, 300))
    with self.assertRaisesRegex(ValueError, "forward-only"):
      jax.grad(lambda x: jnp.sum(fused.fused_dense(
          x, w, core=fused.MOSAIC_GPU, **common).dequantize(jnp.float32)))(x)

  def test_unfusable_epilogue_is_one_clear_error(self):
    x, w, _ = self._inputs(10, m=64, k=128, n=300)
    with self.assertRaisesRegex(ValueError, "mosaic_gpu core: output quantization needs each "
                                "row in one tile, and N=300"):
      fused.fused_dense(x, w, quantize_output=True, core=fused.MOSAIC_GPU)
    x, w, _ = self._inputs(10, m=64, k=128, n=64)
    with self.assertRaisesRegex(ValueError, "BlockNorm\\(32\\)"):
      fused.fused_dense(x, w, block_size=32, core=fused.MOSAIC_GPU)
    with self.assertRaisesRegex(ValueError, "unknown core 'cuda'"):
      fused.fused_dense(x, w, core="cuda")


if __name__ == "__main__":
  absltest.main()
