"""Delayed-scaling FP8 with one Pallas quantize pass per operand (interpret mode on the CPU).

The quantize kernel against its pure-jnp twin (bit-exact, ragged tiles, NaN/Inf); the fused
ops' passes against the fp32 product of their own dequantized operands and against Flax's
delayed-scaling ops (same state, same scales); their plain passes against autodiff's."""
import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from kernels_pallas import compat
from kernels_pallas import delayed as kd
from kernels_pallas import delayed_op
from loka_jax import _compat, kernels
from loka_jax.kernels import check
from loka_jax.kernels.flax_delayed import FP8_META, merge_fp8_meta, run_delayed_passes
from loka_jax.precision import metrics
from loka_jax.probe import evaluate

PALLAS_DELAYED = ("pallas_fp8_delayed", "pallas_fp8_delayed_grad_lhs", "pallas_fp8_delayed_fwd")
f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))


def _poisoned(key, shape, dtype):
  """Heavy-tailed values with a NaN, +-Inf and a zero row."""
  x = jax.random.normal(key, shape) * jnp.exp(jax.random.normal(jax.random.fold_in(key, 1), shape))
  x = x.at[0, 3].set(jnp.nan).at[1, 5].set(jnp.inf).at[2, 7].set(-jnp.inf).at[3].set(0.0)
  return x.astype(dtype)


def _delayed_passes(kernel, lhs, rhs, g, warmup):
  """`run_delayed_passes` on "mk,kn->mn" as one jitted program (its warm-up calls unrolled):
  op by op, each eager step compiles a small XLA program of its own, which on the CPU costs
  more than the interpret-mode kernels."""
  return jax.jit(functools.partial(run_delayed_passes, "mk,kn->mn", warmup=warmup,
                                   kernel=kernel))(lhs, rhs, g)


def _operands(seed, m, k, n, dtype=jnp.bfloat16):
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kx, (m, k)).astype(dtype),
          (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(dtype),
          jax.random.normal(kg, (m, n)).astype(dtype))


class QuantizeDelayedTest(parameterized.TestCase):

  @parameterized.product(fmt=("e4m3", "e5m2"), dtype=(jnp.bfloat16, jnp.float32),
                         layouts=((True, False), (False, True), (True, True)))
  def test_matches_its_reference_bit_for_bit(self, fmt, dtype, layouts):
    row_major, transposed = layouts
    x = _poisoned(jax.random.key(7), (50, 40), dtype)   # 4 x 3 tiles of 16 x 16, ragged
    scale = jnp.float32(0.37)   # small enough that the outliers saturate
    got = kd.quantize_delayed(x, scale, fmt, row_major=row_major, transposed=transposed,
                              block=(16, 16))
    want = kd.quantize_delayed_reference(x, scale, fmt, row_major=row_major,
                                         transposed=transposed)
    for g, w in zip(got[:2], want[:2]):
      self.assertEqual(g is None, w is None)
      if g is not None:
        self.assertEqual(g.dtype, w.dtype)
        np.testing.assert_array_equal(f32(g), f32(w))
    # The amax is the largest finite |x| (NaN and +-Inf left out), from every tile.
    finite = np.abs(f32(x))[np.isfinite(f32(x))]
    self.assertEqual(float(got[2]), float(finite.max()))
    q = f32(got[0] if row_major else got[1].T)
    self.assertTrue(np.isnan(q[0, 3]))
    fmt_max = float(jnp.finfo(jnp.float8_e4m3fn if fmt == "e4m3" else jnp.float8_e5m2).max)
    self.assertEqual(q[1, 5], fmt_max)
    self.assertEqual(q[2, 7], -fmt_max)
    self.assertFalse(np.any(q[3]))

  def test_the_default_tiles_agree_with_small_ones(self):
    x = _poisoned(jax.random.key(3), (130, 300), jnp.bfloat16)
    big = kd.quantize_delayed(x, jnp.float32(0.02), transposed=True)
    small = kd.quantize_delayed(x, jnp.float32(0.02), transposed=True, block=(32, 64))
    for a, b in zip(big, small):
      np.testing.assert_array_equal(f32(a), f32(b))

  def test_bad_arguments_are_named(self):
    x = jnp.ones((8, 8), jnp.bfloat16)
    cases = ((jnp.ones((8,)), jnp.float32(1), {}, "2-D"),
             (x.astype(jnp.int32), jnp.float32(1), {}, "dtype"),
             (x, jnp.ones((2,)), {}, "one float"),
             (x, jnp.float32(1), dict(row_major=False), "neither layout"),
             (x, jnp.float32(1), dict(block=(16, 24)), "powers of two"))
    for a, s, kwargs, message in cases:
      with self.assertRaisesRegex(ValueError, message):
        kd.quantize_delayed(a, s, **kwargs)

  def test_lowers_to_triton_for_cuda(self):
    """The Triton lowering (no GPU needed) accepts every layout of the kernel."""
    spec = jax.ShapeDtypeStruct((96, 200), jnp.bfloat16)
    for row_major, transposed in ((True, False), (False, True), (True, True)):
      fn = jax.jit(lambda x, r=row_major, t=transposed: kd.quantize_delayed(
          x, jnp.float32(0.5), "e5m2", row_major=r, transposed=t))
      with compat.compiled_kernels(), _compat.abstract_gpu():
        text = fn.trace(spec).lower(lowering_platforms=("cuda",)).as_text()
      self.assertIn("__gpu$xla.gpu.triton", text, (row_major, transposed))


class PallasDelayedOpTest(parameterized.TestCase):

  @parameterized.parameters(
      ("pallas_fp8_delayed", "flax_fp8_delayed", ("fwd", "grad_lhs", "grad_rhs")),
      ("pallas_fp8_delayed_grad_lhs", "flax_fp8_delayed_grad_lhs", ("fwd", "grad_lhs")),
      ("pallas_fp8_delayed_fwd", "flax_fp8_delayed_fwd", ("fwd",)))
  def test_passes_against_their_dequantized_operands_autodiff_and_flax(self, name, flax_name,
                                                                        fp8):
    x, w, g = _operands(5, 40, 96, 48)
    # The state returned is the one the measured (fourth) call started from.
    *ours, meta = _delayed_passes(name, x, w, g, warmup=3)
    refs = delayed_op.delayed_dense_reference(x, w, g, meta)
    _, vjp = jax.vjp(lambda a, b: jnp.einsum("mk,kn->mn", a, b), x, w)
    exact = dict(zip(kernels.PASSES, (f32(x) @ f32(w), *vjp(g))))
    for p, got in zip(kernels.PASSES, ours):
      self.assertEqual(got.dtype, jnp.bfloat16, p)
      if p in fp8:   # the product of its quantized operands, up to the bf16 output
        self.assertGreater(float(metrics.sqnr_db(got, refs[p])), 45.0, p)
        self.assertLess(float(metrics.sqnr_db(got, f32(exact[p]))), 40.0, p)  # it quantized
      else:          # the plain product's gradient in the compute dtype, bit for bit
        np.testing.assert_array_equal(f32(got), f32(exact[p]), p)
    # Flax's op of the same recipe learns the same state from the same operands ...
    *flax, flax_meta = _delayed_passes(flax_name, x, w, g, warmup=3)
    self.assertEqual(sorted(meta), sorted(flax_meta))
    for key in meta:
      np.testing.assert_array_equal(f32(meta[key]), f32(flax_meta[key]), key)
    self.assertNotEqual(float(meta["input_scale"][0]), 1.0)
    # ... and computes nearly the same products: Flax divides in bf16 by the scale rounded
    # to bf16 (up to 2^-9 off), we in fp32 by the scale itself, so about 3% of the casts
    # round the other way. Ours are as accurate.
    for p, a, b in zip(kernels.PASSES, ours, flax):
      self.assertGreater(float(metrics.sqnr_db(a, b)), 30.0, p)
      self.assertGreater(float(metrics.sqnr_db(a, exact[p])),
                         float(metrics.sqnr_db(b, exact[p])) - 0.5, p)

  def test_leading_axes_of_the_activation_are_flattened(self):
    x, w, _ = _operands(2, 24, 32, 16)
    module = kernels.get("pallas_fp8_delayed").make_module(name=None)
    x3 = x.reshape((4, 6, 32))
    variables = jax.jit(lambda x3, w: module.init(jax.random.PRNGKey(0), "bsk,kn->bsn", x3,
                                                  w))(x3, w)
    out3 = jax.jit(lambda v, x3, w: module.apply(v, "bsk,kn->bsn", x3, w))(variables, x3, w)
    out2 = jax.jit(lambda v, x, w: module.apply(v, "mk,kn->mn", x, w))(variables, x, w)
    chex.assert_shape(out3, (4, 6, 16))
    np.testing.assert_array_equal(f32(out3).reshape(24, 16), f32(out2))

  def test_vmapped_as_the_probe_evaluates_it(self):
    """The probe evaluates fused ops under vmap (one problem per sample): the quantize's
    batching puts the samples on the grid."""
    xs = jax.random.normal(jax.random.PRNGKey(4), (3, 24, 40)).astype(jnp.bfloat16)
    scales = jnp.asarray([0.01, 0.02, 0.005], jnp.float32)
    run = lambda x, s: kd.quantize_delayed(x, s, "e5m2", transposed=True, block=(16, 16))
    batched = jax.vmap(run)(xs, scales)
    for i in range(3):
      for got, want in zip(batched, kd.quantize_delayed_reference(xs[i], scales[i], "e5m2",
                                                                  transposed=True)):
        np.testing.assert_array_equal(f32(got[i]), f32(want))

  def test_the_probe_reads_it_as_accurately_as_flax_at_a_logit_head(self):
    """The probe's own evaluation (vmapped over samples, state warmed on the preceding ones)
    at a K -> 1 head, where GPU probes read this op's forward 3-8 dB against Flax's 27-40:
    on average the two read alike. Single samples differ by rounding luck (Flax's quantize
    rounds twice, through the compute dtype), so the test compares means over 16."""
    lhs, rhs, grad = check.logit_head_samples(16, 256, 128)
    refs = evaluate.references("mk,kn->mn")(lhs, rhs, grad)
    read = lambda name: evaluate.fused_evaluator(name, "mk,kn->mn", "bfloat16")(
        lhs, rhs, grad, refs)
    ours, flax = read("pallas_fp8_delayed"), read("flax_fp8_delayed")
    for p in kernels.PASSES:
      a, b = np.asarray(ours[p]["sqnr_db"]), np.asarray(flax[p]["sqnr_db"])
      self.assertGreater(a.mean(), b.mean() - 2.0, (p, a, b))

  def test_refuses_what_it_cannot_compute(self):
    kernel = kernels.get("pallas_fp8_delayed")
    spec = kernels.EinsumSpec.parse
    self.assertIsNone(kernel.unsupported_reason(spec("mk,kn->mn"), "fwd", "act_weight",
                                                (8, 4), (4, 2)))
    # Each pass is asked with its own spec (`EinsumSpec.for_pass`).
    for p in kernels.PASSES:
      self.assertIsNone(kernel.unsupported_reason(spec("bsk,kn->bsn").for_pass(p), p,
                                                  "act_weight", (2, 8, 4), (4, 2)), p)
    self.assertRegex(kernel.unsupported_reason(spec("bnd,nl->bld"), "fwd", "act_weight",
                                               (2, 3, 4), (3, 5)), "2-D weight")
    self.assertRegex(kernel.unsupported_reason(spec("bnd,bmd->bnm"), "fwd", "act_act",
                                               (2, 3, 4), (2, 5, 4)), "act_act")
    module = kernel.make_module(name=None)
    with self.assertRaisesRegex(ValueError, "2-D weight"):
      module.init(jax.random.PRNGKey(0), "bnd,nl->bld", jnp.ones((2, 3, 4)), jnp.ones((3, 5)))
    with self.assertRaisesRegex(ValueError, "unknown mode"):
      delayed_op.PallasDelayedEinsum(mode="both").init(
          jax.random.PRNGKey(0), "mk,kn->mn", jnp.ones((2, 4)), jnp.ones((4, 2)))

  def test_the_forward_accumulates_fast_at_every_width(self):
    """On the GPU XLA's FP8 dot at N = 1 reads lower with precise accumulation (31 dB against
    its dequantized product) than with fast (above 35): the forward runs at DEFAULT at every
    width, a K -> 1 head included."""
    module = delayed_op.PallasDelayedEinsum(mode=delayed_op.FWD)
    for n in (1, 8, 16):
      x, w, _ = _operands(n, 32, 64, n)
      # The variables' shapes are all the traced program needs.
      variables = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), "mk,kn->mn", x, w))
      text = str(jax.make_jaxpr(lambda v: module.apply(v, "mk,kn->mn", x, w))(variables))
      precisions = re.findall(r"precision=\(?Precision\.(\w+)", text)
      self.assertEqual(set(precisions), {"DEFAULT"}, (n, precisions))

  def test_registered_as_stateful_fused_ops(self):
    for name in PALLAS_DELAYED:
      kernel = kernels.get(name)
      self.assertEqual((kernel.sort, kernel.backend), (kernels.FUSED_OP, "pallas_triton"))
      self.assertTrue(kernel.stateful and kernel.fp8)
    # Which passes each quantizes, as its Flax twin does.
    for name, quantized in (("pallas_fp8_delayed", (True, True, True)),
                            ("pallas_fp8_delayed_grad_lhs", (True, True, False)),
                            ("pallas_fp8_delayed_fwd", (True, False, False))):
      self.assertEqual(tuple(kernels.get(name).quantizes(p)
                             for p in ("fwd", "grad_lhs", "grad_rhs")), quantized, name)

  def test_passes_named_alike_compute_alike(self):
    # `Kernel.pass_numerics`: validation counts a pass two ops name alike as equally
    # accurate, so the name must mean bit-identical results, and different names different
    # (tests/gpu/test_pallas_delayed_gpu.py checks the same on the GPU's compiled kernels).
    x, w, g = _operands(12, 48, 96, 40)
    x = x * jnp.exp(jax.random.normal(jax.random.PRNGKey(13), (48, 1))).astype(x.dtype)
    results = {k: _delayed_passes(k, x, w, g, warmup=2)[:3] for k in PALLAS_DELAYED}
    self.assertEqual(check.pass_numerics_disagreements(results), [])
    # The forwards did quantize: a shared name is not a shared exact product.
    self.assertLess(float(metrics.sqnr_db(results["pallas_fp8_delayed"][0], x @ w)), 45.0)


class PallasDelayedTrainingTest(absltest.TestCase):

  def test_a_dense_tower_trains_as_with_flax_delayed_scaling(self):
    """Three SGD steps of a two-layer tower with the op at both layers: its fp8_meta state
    moves and the losses track Flax's op's."""
    from loka_jax.models import DenseSite, SiteConfig

    class Tower(nn.Module):
      config: SiteConfig

      @nn.compact
      def __call__(self, x):
        h = nn.relu(DenseSite(64, use_bias=False, config=self.config, name="dense_0")(x))
        return DenseSite(1, use_bias=False, config=self.config, name="dense_1")(h)[:, 0]

    kx, ky = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (128, 32)).astype(jnp.bfloat16)
    y = (jax.random.uniform(ky, (128,)) < 0.3).astype(jnp.float32)

    def losses(kernel):
      model = Tower(SiteConfig.for_precision("fp8_all", kernel=kernel))
      variables = model.init(jax.random.PRNGKey(1), x)
      params, meta = variables["params"], variables[FP8_META]

      @jax.jit
      def step(params, meta):
        def loss_fn(p, m):
          logits = model.apply({"params": p, FP8_META: m}, x).astype(jnp.float32)
          return jnp.mean(jnp.logaddexp(0.0, logits) - y * logits)
        loss, (gp, gm) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta)
        params = jax.tree.map(lambda p, d: p - 0.5 * d.astype(p.dtype), params, gp)
        return params, merge_fp8_meta(gm), loss

      out = []
      for _ in range(3):
        params, meta, loss = step(params, meta)
        out.append(float(loss))
      return out, meta

    ours, meta = losses("pallas_fp8_delayed")
    flax, _ = losses("flax_fp8_delayed")
    self.assertTrue(np.all(np.isfinite(ours)))
    self.assertLess(ours[-1], ours[0])
    np.testing.assert_allclose(ours, flax, rtol=2e-2)
    self.assertNotEqual(float(meta["dense_0"]["fp8_op"]["output_grad_scale"][0]), 1.0)


if __name__ == "__main__":
  absltest.main()
