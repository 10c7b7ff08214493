"""Pallas FP8 GEMM core and per-pass kernels (interpret mode) against fp32 HIGHEST references
on their own dequantized operands. Interpret mode leaves unwritten outputs NaN, so every
output is also checked to be finite (the inputs are finite)."""
import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from kernels_pallas import compat
from kernels_pallas import epilogue as ep_lib
from kernels_pallas import gemm as gemm_lib
from kernels_pallas import products, tuning
from loka_jax import _compat, kernels
from loka_jax.kernels import EinsumSpec, reference_einsum
from loka_jax.precision import E4M3, scaling

from kernel_helpers import RTOL
from kernel_helpers import assert_close as _assert_close

# Tiles smaller than the (48, 200) x (200, 96) problem: M, N and K tails all get exercised.
SMALL = tuning.TileConfig(block_m=32, block_n=64, block_k=64, n_sub=1, num_warps=4,
                          num_stages=2, batch_per_program=1)


def _jitted(fn, *args):
  """fn(*args) as one jitted program. The operands, kernels and references below run so: op
  by op, each eager step compiles a small XLA program of its own, which on the CPU costs more
  than the interpret-mode kernels themselves."""
  return jax.jit(fn)(*args)


@functools.partial(jax.jit, static_argnames=("bt", "m", "k", "n"))
def _rowwise_operands(key, bt=1, m=48, k=200, n=96):
  ka, kb = jax.random.split(key)
  x = jax.random.normal(ka, (bt, m, k)) * jnp.exp(jax.random.normal(kb, (bt, m, 1)))
  w = jax.random.normal(kb, (bt, k, n))
  qx = scaling.quantize(x, E4M3, "rowwise", (2,))
  qw = scaling.quantize(w, E4M3, "rowwise", (1,))
  return qx, qw


@functools.partial(jax.jit, static_argnames=("m", "k", "n"))
def _block_operands(key, m=48, k=300, n=96):
  """x (M, K) in 1x128 blocks with K columns of very different scale, w (K, N) in 128x128
  blocks, and w's scales expanded to one per column (the core's (KB, N) layout)."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k)) * jnp.exp(2 * jax.random.normal(k2, (1, k)))
  w = jax.random.normal(k2, (k, n))
  qx = scaling.quantize(x, E4M3, "block_1x128", (1,))
  qw = scaling.quantize(w, E4M3, "block_128x128", (0,))
  return qx, qw, jnp.repeat(qw.scale, 128, axis=1)[:, :n]


class GemmCoreTest(parameterized.TestCase):

  @parameterized.product(a_t=(False, True), b_t=(False, True))
  def test_layouts_with_tails(self, a_t, b_t):
    qx, qw = _rowwise_operands(jax.random.key(11 + 2 * a_t + b_t))
    a = jnp.swapaxes(qx.data, 1, 2) if a_t else qx.data
    b = jnp.swapaxes(qw.data, 1, 2) if b_t else qw.data
    out, ref = _jitted(lambda a, b, qx, qw: (
        gemm_lib.gemm(a, b, qx.scale[:, :, 0], qw.scale[:, 0, :], a_t=a_t, b_t=b_t,
                      out_dtype=jnp.float32, config=SMALL),
        gemm_lib.reference(qx.dequantize(), qw.dequantize())), a, b, qx, qw)
    _assert_close(self, out, ref)

  def test_batch_tail_and_batch_per_program(self):
    qx, qw = _rowwise_operands(jax.random.key(5), bt=3, m=16, k=72, n=24)
    cfg = tuning.TileConfig(16, 32, 32, 1, 4, 2, batch_per_program=2)
    out, ref = _jitted(lambda qx, qw: (
        gemm_lib.gemm(qx.data, qw.data, qx.scale[:, :, 0], qw.scale[:, 0, :],
                      out_dtype=jnp.float32, config=cfg),
        gemm_lib.reference(qx.dequantize(), qw.dequantize())), qx, qw)
    _assert_close(self, out, ref)

  @parameterized.named_parameters(
      ("bias", ep_lib.Epilogue(bias=True)),
      ("relu", ep_lib.Epilogue(activation="relu")),
      ("blocknorm_hard_swish", ep_lib.Epilogue(block_size=32, activation="hard_swish")),
      ("bias_blocknorm_relu_pre", ep_lib.Epilogue(bias=True, block_size=64, activation="relu",
                                                  emit_pre=True)),
  )
  def test_epilogues(self, epilogue):
    qx, qw = _rowwise_operands(jax.random.key(21))
    bias = jax.random.normal(jax.random.key(22), (96,))
    bn = epilogue.block_size or 64
    cfg = tuning.TileConfig(32, bn, 64, 2 if bn == 32 else 1, 4, 2, 1)
    outs, ref, pre_ref = _jitted(lambda qx, qw, bias: (
        gemm_lib.gemm(qx.data, qw.data, qx.scale[:, :, 0], qw.scale[:, 0, :],
                      epilogue=epilogue, bias=bias, out_dtype=jnp.float32, config=cfg),
        gemm_lib.reference(qx.dequantize(), qw.dequantize(), epilogue=epilogue, bias=bias),
        gemm_lib.reference(qx.dequantize(), qw.dequantize()) + bias), qx, qw, bias)
    if epilogue.emit_pre:
      out, pre = outs
      _assert_close(self, pre, pre_ref)
    else:
      out = outs
    _assert_close(self, out, ref)

  def test_quantized_output_is_the_next_layers_rowwise_qtensor(self):
    qx, qw = _rowwise_operands(jax.random.key(31))
    bias = jax.random.normal(jax.random.key(32), (96,))
    epilogue = ep_lib.Epilogue(bias=True, block_size=32, activation="hard_swish",
                               quantize_output=True)
    cfg = tuning.TileConfig(16, 32, 64, 4, 4, 2, 1)  # 4 x 32 columns hold the 96-wide row
    (q, qs), want = _jitted(lambda qx, qw, bias: (
        gemm_lib.gemm(qx.data, qw.data, qx.scale[:, :, 0], qw.scale[:, 0, :],
                      epilogue=epilogue, bias=bias, config=cfg),
        scaling.quantize(gemm_lib.reference(qx.dequantize(), qw.dequantize(),
                                            epilogue=epilogue, bias=bias),
                         E4M3, "rowwise", (2,))), qx, qw, bias)
    np.testing.assert_allclose(np.asarray(qs), np.asarray(want.scale[:, :, 0]), rtol=RTOL)
    # Equal scales: the same e4m3 codes except values sitting on a rounding boundary.
    got_deq = q.astype(jnp.float32) * qs[..., None]
    np.testing.assert_allclose(np.asarray(got_deq), np.asarray(want.dequantize()),
                               atol=float(jnp.max(want.scale)) * 16 * 1.01, rtol=0.07)
    self.assertGreater(float(jnp.mean(q.astype(jnp.float32) == want.data.astype(jnp.float32))),
                       0.99)

  def test_block_scales_promote_each_k_block(self):
    qx, qw, sb = _block_operands(jax.random.key(41), k=300)
    cfg = tuning.TileConfig(32, 64, 64, 1, 4, 2, 1)  # two K steps per scale block
    out, ref = _jitted(lambda qx, qw, sb: (
        gemm_lib.gemm(qx.data[None], qw.data[None], qx.scale.T[None], sb[None],
                      scales=gemm_lib.BLOCK_SCALES, out_dtype=jnp.float32, config=cfg),
        gemm_lib.reference(qx.dequantize()[None], qw.dequantize()[None])), qx, qw, sb)
    _assert_close(self, out, ref)

  def test_bad_configs_and_inputs_raise(self):
    qx, qw = _rowwise_operands(jax.random.key(1))
    sa, sb = qx.scale[:, :, 0], qw.scale[:, 0, :]
    with self.assertRaisesRegex(ValueError, "block_n == block_size"):
      gemm_lib.gemm(qx.data, qw.data, sa, sb, epilogue=ep_lib.Epilogue(block_size=32),
                    config=SMALL)
    with self.assertRaisesRegex(ValueError, "whole rows"):
      gemm_lib.gemm(qx.data, qw.data, sa, sb, epilogue=ep_lib.Epilogue(quantize_output=True),
                    config=SMALL)
    with self.assertRaisesRegex(ValueError, "one operand dtype"):
      gemm_lib.gemm(qx.data, qw.data.astype(jnp.float8_e5m2), sa, sb, config=SMALL)
    with self.assertRaisesRegex(ValueError, "power of two"):
      ep_lib.Epilogue(block_size=96)

  def _k_first_rowwise(self, key, bt=2, k=512, m=40, n=72):
    """A weight gradient's operands: X (K, M) and G (K, N), each scaled per column."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (bt, k, m)) * jnp.exp(jax.random.normal(k3, (bt, 1, m)))
    g = jax.random.normal(k2, (bt, k, n))
    return (scaling.quantize(x, E4M3, "rowwise", (1,)),
            scaling.quantize(g, E4M3, "rowwise", (1,)))

  def test_split_k_sums_its_slices_to_the_whole_product(self):
    qx, qg = self._k_first_rowwise(jax.random.key(51))
    sa, sb = qx.scale[:, 0, :], qg.scale[:, 0, :]
    ref = gemm_lib.reference(qx.dequantize(), qg.dequantize(), a_t=True)
    whole = gemm_lib.gemm(qx.data, qg.data, sa, sb, a_t=True, out_dtype=jnp.float32,
                          split_k=1)
    _assert_close(self, whole, ref)
    with mock.patch.object(gemm_lib, "_split_k_gemm", wraps=gemm_lib._split_k_gemm) as split:
      out = gemm_lib.gemm(qx.data, qg.data, sa, sb, a_t=True, out_dtype=jnp.bfloat16,
                          split_k=4)
    self.assertEqual(split.call_args.args[4], 4)
    self.assertEqual(out.dtype, jnp.bfloat16)
    _assert_close(self, out.astype(jnp.float32), ref, rtol=1e-2)   # bf16 output rounding
    # In fp32 the slices differ from the whole only by the order of the additions.
    out32 = gemm_lib.gemm(qx.data, qg.data, sa, sb, a_t=True, out_dtype=jnp.float32,
                          split_k=4)
    _assert_close(self, out32, ref)

  def test_split_k_with_block_scales_gives_each_slice_its_blocks(self):
    # Scales that differ a lot between K blocks: a slice given another's would show.
    qx, qw, sb = _block_operands(jax.random.key(52), k=512)
    out, ref = _jitted(lambda qx, qw, sb: (
        gemm_lib.gemm(qx.data.T[None], qw.data[None], qx.scale.T[None], sb[None], a_t=True,
                      scales=gemm_lib.BLOCK_SCALES, out_dtype=jnp.float32, split_k=2),
        gemm_lib.reference(qx.dequantize()[None], qw.dequantize()[None])), qx, qw, sb)
    _assert_close(self, out, ref)

  def test_split_k_is_chosen_for_a_long_k_under_a_small_output_only(self):
    plain = ep_lib.Epilogue()
    # InterFormer small's sequence projections' grad_rhs: two programs over K = 540,672.
    dims = (1, 128, 128, 540672)
    splits = gemm_lib.split_k_for(dims, a_t=True, b_t=False, epilogue=plain)
    cfg = gemm_lib.default_config(dims, plain, gemm_lib.ROWWISE_SCALES)
    programs = -(-dims[1] // cfg.block_m) * -(-dims[2] // cfg.block_n)
    self.assertGreaterEqual(programs * splits, gemm_lib.TARGET_PROGRAMS // 2)
    self.assertLessEqual(programs * splits, gemm_lib.TARGET_PROGRAMS)
    self.assertEqual(dims[3] % (splits * 128), 0)
    self.assertGreaterEqual(dims[3] // splits, gemm_lib.MIN_SPLIT_K)
    for other in ((dict(a_t=False, b_t=False, epilogue=plain), dims),       # A stored (M, K)
                  (dict(a_t=True, b_t=True, epilogue=plain), dims),         # B stored (N, K)
                  (dict(a_t=True, b_t=False, epilogue=ep_lib.Epilogue(bias=True)), dims),
                  (dict(a_t=True, b_t=False, epilogue=plain), (1, 4096, 4096, 4096)),
                  (dict(a_t=True, b_t=False, epilogue=plain), (1, 128, 128, 540673)),
                  (dict(a_t=True, b_t=False, epilogue=plain), (4096, 16, 16, 4096))):
      self.assertEqual(gemm_lib.split_k_for(other[1], **other[0]), 1, other)

  def test_a_weight_gradient_pass_splits_on_its_own_and_stays_right(self):
    spec = EinsumSpec.parse("mk,kn->mn").for_pass("grad_rhs")   # 'mk,mn->kn': K = m
    k1, k2 = jax.random.split(jax.random.key(53))
    x = jax.random.normal(k1, (4096, 24))
    g = jax.random.normal(k2, (4096, 40)) * 1e-3
    with mock.patch.object(gemm_lib, "_split_k_gemm", wraps=gemm_lib._split_k_gemm) as split:
      out, ref = _jitted(lambda x, g: (
          kernels.get("pallas_fp8_rowwise").einsum(spec, x, g, pass_name="grad_rhs",
                                                   out_dtype=jnp.float32),
          reference_einsum(spec, *products.dequantized_operands(spec, x, g, mode="rowwise",
                                                                pass_name="grad_rhs"))), x, g)
    self.assertEqual(split.call_count, 1)
    _assert_close(self, out, ref)

  def test_split_k_refuses_what_it_cannot_split(self):
    qx, qg = self._k_first_rowwise(jax.random.key(54))
    sa, sb = qx.scale[:, 0, :], qg.scale[:, 0, :]
    with self.assertRaisesRegex(ValueError, "split_k=4 needs both operands stored K first"):
      gemm_lib.gemm(jnp.swapaxes(qx.data, 1, 2), qg.data, sa, sb, out_dtype=jnp.float32,
                    split_k=4)
    with self.assertRaisesRegex(ValueError, "K a multiple of 8 x 128"):
      gemm_lib.gemm(qx.data, qg.data, sa, sb, a_t=True, out_dtype=jnp.float32, split_k=8)

  def test_default_and_candidate_configs_are_valid(self):
    for dims, epilogue in (((1, 2048, 768, 256), ep_lib.Epilogue()),
                           ((1, 8192, 1024, 1024), ep_lib.Epilogue(block_size=256,
                                                                    activation="hard_swish",
                                                                    quantize_output=True)),
                           ((4096, 16, 24, 128), ep_lib.Epilogue()),
                           ((1, 2048, 1024, 123200), ep_lib.Epilogue())):
      default = gemm_lib.default_config(dims, epilogue, gemm_lib.ROWWISE_SCALES)
      self.assertIsNone(gemm_lib.validate_config(default, dims, epilogue,
                                                 gemm_lib.ROWWISE_SCALES))
      cands = gemm_lib.candidate_configs(dims, epilogue, gemm_lib.ROWWISE_SCALES)
      self.assertBetween(len(cands), 2, tuning.MAX_CANDIDATES)


class PerPassKernelTest(parameterized.TestCase):
  """Registered kernels through Kernel.einsum, each pass on its own pass spec."""

  @parameterized.product(name=("pallas_fp8_rowwise", "pallas_fp8_blockwise"),
                         pass_name=("fwd", "grad_lhs", "grad_rhs"))
  def test_dense_passes(self, name, pass_name):
    keys = jax.random.split(jax.random.key(sum(map(ord, name + pass_name))), 3)
    x = jax.random.normal(keys[0], (48, 200))
    w = jax.random.normal(keys[1], (200, 96))
    g = jax.random.normal(keys[2], (48, 96)) * 1e-3
    a, b = {"fwd": (x, w), "grad_lhs": (g, w), "grad_rhs": (x, g)}[pass_name]
    spec = EinsumSpec.parse("mk,kn->mn").for_pass(pass_name)
    kernel = kernels.get(name)
    self.assertIsNone(kernel.unsupported_reason(spec, pass_name, "act_weight", a.shape, b.shape))
    out, ref = _jitted(lambda a, b: (
        kernel.einsum(spec, a, b, pass_name=pass_name, out_dtype=jnp.float32),
        reference_einsum(spec, *products.dequantized_operands(spec, a, b, mode=kernel.mode,
                                                              pass_name=pass_name))), a, b)
    _assert_close(self, out, ref)

  @parameterized.named_parameters(
      ("fmb_fwd", "bnd,bdk->bnk", "fwd", (3, 16, 40), (3, 40, 24)),
      ("fmb_grad_lhs", "bnd,bdk->bnk", "grad_lhs", (3, 16, 24), (3, 40, 24)),
      ("fmb_grad_rhs", "bnd,bdk->bnk", "grad_rhs", (3, 16, 40), (3, 16, 24)),
      ("dlrm_fwd", "bfd,bgd->bfg", "fwd", (3, 12, 40), (3, 12, 40)),
  )
  def test_batched_passes(self, site_spec, pass_name, lhs_shape, rhs_shape):
    k1, k2 = jax.random.split(jax.random.key(len(site_spec) + len(pass_name)))
    a, b = jax.random.normal(k1, lhs_shape), jax.random.normal(k2, rhs_shape)
    spec = EinsumSpec.parse(site_spec).for_pass(pass_name)
    kernel = kernels.get("pallas_fp8_batched")
    self.assertIsNone(kernel.unsupported_reason(spec, pass_name, "act_act", a.shape, b.shape))
    out, ref = _jitted(lambda a, b: (
        kernel.einsum(spec, a, b, pass_name=pass_name, out_dtype=jnp.float32),
        reference_einsum(spec, *products.dequantized_operands(spec, a, b, mode="rowwise",
                                                              pass_name=pass_name))), a, b)
    _assert_close(self, out, ref)

  def test_unsupported_reasons_are_specific(self):
    rowwise, batched = kernels.get("pallas_fp8_rowwise"), kernels.get("pallas_fp8_batched")
    transpose = EinsumSpec.parse("bnd,nk->bdk")
    self.assertIn("transpose", rowwise.unsupported_reason(transpose, "fwd", "act_weight",
                                                          (2, 3, 4), (3, 5)))
    fmb = EinsumSpec.parse("bnd,bdk->bnk")
    self.assertIn("pallas_fp8_batched",
                  rowwise.unsupported_reason(fmb, "fwd", "act_act", (2, 3, 4), (2, 4, 5)))
    dense = EinsumSpec.parse("mk,kn->mn")
    self.assertIn("no batch index", batched.unsupported_reason(dense, "fwd", "act_weight",
                                                               (2, 3), (3, 4)))
    fused = kernels.get("pallas_fp8_rowwise_fused_blocknorm256_hard_swish")
    self.assertIn("fused_dense", fused.unsupported_reason(dense, "fwd", "act_weight",
                                                          (2, 3), (3, 4)))
    with self.assertRaisesRegex(ValueError, "transpose"):
      rowwise.einsum(transpose, jnp.ones((2, 3, 4)), jnp.ones((3, 5)), pass_name="fwd",
                     out_dtype=jnp.float32)

  def test_flattened_leading_dims(self):
    spec = EinsumSpec.parse("bnd,dk->bnk")
    k1, k2 = jax.random.split(jax.random.key(9))
    a, b = jax.random.normal(k1, (3, 7, 40)), jax.random.normal(k2, (40, 24))
    out, ref = _jitted(lambda a, b: (
        kernels.get("pallas_fp8_rowwise").einsum(spec, a, b, pass_name="fwd",
                                                 out_dtype=jnp.float32),
        reference_einsum(spec, *products.dequantized_operands(spec, a, b, mode="rowwise",
                                                              pass_name="fwd"))), a, b)
    _assert_close(self, out, ref)


class TritonLoweringTest(absltest.TestCase):
  """Each kernel family lowers through the Pallas Triton backend for 'cuda' (no GPU needed)."""

  def test_lowerings(self):
    f8 = jnp.float8_e4m3fn
    s = jax.ShapeDtypeStruct
    full = ep_lib.Epilogue(bias=True, block_size=256, activation="hard_swish",
                           quantize_output=True, emit_pre=True)
    cases = {
        "rowwise_dgrad_layout": (lambda a, b, sa, sb: gemm_lib.gemm(
            a, b, sa, sb, b_t=True, config=SMALL),
                                 (s((1, 48, 200), f8), s((1, 96, 200), f8), s((1, 48), jnp.float32),
                                  s((1, 96), jnp.float32))),
        "fused_epilogue": (lambda a, b, sa, sb, bias: gemm_lib.gemm(
            a, b, sa, sb, epilogue=full, bias=bias),
                           (s((1, 48, 200), f8), s((1, 200, 300), f8), s((1, 48), jnp.float32),
                            s((1, 300), jnp.float32), s((300,), jnp.float32))),
        "block_wgrad_layout": (lambda a, b, sa, sb: gemm_lib.gemm(
            a, b, sa, sb, a_t=True, scales=gemm_lib.BLOCK_SCALES),
                               (s((1, 200, 48), f8), s((1, 200, 96), f8),
                                s((1, 2, 48), jnp.float32), s((1, 2, 96), jnp.float32))),
        "batched": (lambda a, b, sa, sb: gemm_lib.gemm(a, b, sa, sb),
                    (s((64, 16, 128), f8), s((64, 128, 24), f8), s((64, 16), jnp.float32),
                     s((64, 24), jnp.float32))),
    }
    for name, (fn, args) in cases.items():
      # The abstract GPU gives jax 0.11's Triton lowering a compute capability without a GPU.
      with compat.compiled_kernels(), _compat.abstract_gpu():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      self.assertTrue("__gpu$xla.gpu.triton" in text, f"{name}: no Triton custom call")

  def test_fp8_accumulation_switch_reaches_the_triton_dot(self):
    """`maxNumImpreciseAcc` (what lets Triton use Hopper's FP8 wgmma) is on the lowered FP8 dot
    only while the switch is set, in the environment or by the context manager."""
    f8, s = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    args = (s((1, 64, 256), f8), s((1, 256, 128), f8), s((1, 64), jnp.float32),
            s((1, 128), jnp.float32))
    fn = lambda a, b, sa, sb: gemm_lib.gemm(a, b, sa, sb, config=SMALL)

    def dot_lines():
      [(ttir, grid)] = compat.triton_modules(fn, *args)
      self.assertEqual(grid, 2 * 2)  # 64/32 x 128/64 programs
      return [line for line in ttir.splitlines() if "tt.dot" in line]

    self.assertTrue(dot_lines())
    self.assertFalse(any("maxNumImpreciseAcc" in line for line in dot_lines()))
    with compat.fp8_accumulation(128):
      self.assertTrue(all("maxNumImpreciseAcc = 128" in line for line in dot_lines()))
    self.assertFalse(any("maxNumImpreciseAcc" in line for line in dot_lines()))
    with mock.patch.dict(os.environ, {compat.ENV_IMPRECISE_ACC: "64"}):
      compat.install_fp8_dot_hook()
      self.assertTrue(all("maxNumImpreciseAcc = 64" in line for line in dot_lines()))
    for bad in ("many", "-1"):
      with mock.patch.dict(os.environ, {compat.ENV_IMPRECISE_ACC: bad}):
        with self.assertRaisesRegex(ValueError, "imprecise|integer"):
          compat.fp8_imprecise_acc()


if __name__ == "__main__":
  absltest.main()
