"""Registered XLA / Flax kernels: correctness, site error, per-pass mixing, gradients."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import kernels
from loka_jax.kernels import base as kernels_base
from loka_jax.kernels import check
from loka_jax.kernels.base import reference_einsum
from loka_jax.precision import metrics

XLA_FP8 = ("xla_fp8_tensorwise", "xla_fp8_rowwise", "xla_fp8_tensorwise_fastacc",
           "xla_fp8_rowwise_precise")
DENSE = kernels.EinsumSpec.parse("mk,kn->mn")


def _delayed_passes(spec, lhs, rhs, g, kernel="flax_fp8_delayed"):
  """`run_delayed_passes` (3 warm-up calls) as one jitted program: op by op, each eager step
  of its calls compiles a small XLA program of its own, which on the CPU costs more than the
  products."""
  return jax.jit(functools.partial(kernels.flax_delayed.run_delayed_passes, spec, warmup=3,
                                   kernel=kernel))(lhs, rhs, g)


def _operands(seed, m, k, n):
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kx, (m, k)), jax.random.normal(kw, (k, n)) / np.sqrt(k),
          jax.random.normal(kg, (m, n)))


class PerPassKernelTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(name=XLA_FP8, pass_name=kernels.PASSES)
  def test_matches_product_of_its_own_dequantized_operands(self, name, pass_name):
    kernel = kernels.get(name)
    x, w, g = _operands(1, 48, 80, 24)  # M != K != N
    spec = DENSE.for_pass(pass_name)
    a, b = check.pass_operands(pass_name, x, w, g)
    out = self.variant(functools.partial(kernel.einsum, spec, pass_name=pass_name,
                                         out_dtype=jnp.float32))(a, b)
    qa, qb = kernel.quantized_operands(spec, a, b, pass_name=pass_name)
    ref_b = reference_einsum(spec, qa.dequantize(), qb.dequantize())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_b), rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(ref_b))))
    ref_a = reference_einsum(spec, a, b)
    self.assertGreaterEqual(float(metrics.sqnr_db(out, ref_a)), 18.0)

  @parameterized.product(name=("xla_fp8_tensorwise", "xla_fp8_rowwise"),
                         pass_name=kernels.PASSES)
  def test_one_scale_products_write_the_output_dtype(self, name, pass_name):
    # Tensorwise: the e4m3/e5m2 dot writes bf16 and the scalar scale follows in bf16 (one
    # cuBLASLt FP8 GEMM); rowwise scales vary over the output, so its product stays float32
    # until scaled. Both stay within bf16 rounding of the float32 product of the same
    # quantized operands.
    kernel = kernels.get(name)
    x, w, g = _operands(4, 64, 96, 40)
    spec = DENSE.for_pass(pass_name)
    a, b = (t.astype(jnp.bfloat16) for t in check.pass_operands(pass_name, x, w, g))
    run = functools.partial(kernel.einsum, spec, pass_name=pass_name, out_dtype=jnp.bfloat16)
    dots = [eqn.outvars[0].aval.dtype for eqn in jax.make_jaxpr(run)(a, b).jaxpr.eqns
            if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.dtype.itemsize == 1]
    self.assertEqual(dots, [jnp.dtype(jnp.bfloat16 if name == "xla_fp8_tensorwise"
                                      else jnp.float32)])
    out = run(a, b)
    self.assertEqual(out.dtype, jnp.bfloat16)
    qa, qb = kernel.quantized_operands(spec, a, b, pass_name=pass_name)
    ref = reference_einsum(spec, qa.dequantize(), qb.dequantize())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2 ** -7,
                               atol=2 ** -7 * float(jnp.max(jnp.abs(ref))))

  @parameterized.parameters("xla_bf16", "xla_fp32")
  def test_high_precision_kernels(self, name):
    x, w, _ = _operands(2, 33, 47, 21)
    out = kernels.get(name).einsum(DENSE, x, w, pass_name="fwd", out_dtype=jnp.float32)
    bar = 40.0 if name == "xla_bf16" else 100.0
    self.assertGreaterEqual(float(metrics.sqnr_db(out, reference_einsum(DENSE, x, w))), bar)

  def test_gradient_passes_use_e5m2_for_the_gradient_operand(self):
    kernel = kernels.get("xla_fp8_rowwise")
    x, w, g = _operands(3, 16, 32, 8)
    qg, qw = kernel.quantized_operands(DENSE.for_pass("grad_lhs"), g, w, pass_name="grad_lhs")
    self.assertEqual(qg.dtype, jnp.float8_e5m2)
    self.assertEqual(qw.dtype, jnp.float8_e4m3fn)
    # dgrad G W^T needs W per row of W (its non-contracting axis is k, axis 0).
    chex.assert_shape(qw.scale, (32, 1))
    qx, qg2 = kernel.quantized_operands(DENSE.for_pass("grad_rhs"), x, g, pass_name="grad_rhs")
    chex.assert_shape(qx.scale, (1, 32))   # wgrad X^T G: X per column
    chex.assert_shape(qg2.scale, (1, 8))

  @parameterized.parameters(*XLA_FP8)
  def test_shapes_not_multiple_of_16(self, name):
    x, w, _ = _operands(4, 37, 53, 29)
    out = kernels.get(name).einsum(DENSE, x, w, pass_name="fwd", out_dtype=jnp.float32)
    chex.assert_shape(out, (37, 29))
    self.assertGreaterEqual(float(metrics.sqnr_db(out, reference_einsum(DENSE, x, w))), 18.0)

  def test_batched_act_act_product(self):
    spec = kernels.EinsumSpec.parse("bnd,bdk->bnk")
    kx, ky = jax.random.split(jax.random.PRNGKey(5))
    x = jax.random.normal(kx, (6, 16, 40))
    p = jax.random.normal(ky, (6, 40, 12))
    for name in XLA_FP8:
      out = kernels.get(name).einsum(spec, x, p, pass_name="fwd", out_dtype=jnp.float32)
      self.assertGreaterEqual(float(metrics.sqnr_db(out, reference_einsum(spec, x, p))), 18.0)


class SiteProductTest(parameterized.TestCase):

  @parameterized.parameters(*XLA_FP8)
  def test_custom_vjp_gradients_against_reference_gradients(self, name):
    x, w, g = _operands(6, 40, 72, 24)
    choice = kernels.KernelChoice.uniform(name)

    def f(fn):
      return lambda x_, w_: jnp.sum(fn(x_, w_).astype(jnp.float32) * g)

    got, want = jax.jit(lambda x, w: (  # one program: eager, each op compiles on its own
        jax.grad(f(lambda a, b: kernels.per_pass_product(DENSE, choice, jnp.float32, a, b)),
                 argnums=(0, 1))(x, w),
        jax.grad(f(lambda a, b: reference_einsum(DENSE, a, b)), argnums=(0, 1))(x, w)))(x, w)
    for gi, wi in zip(got, want):
      self.assertGreaterEqual(float(metrics.sqnr_db(gi, wi)), 18.0)

  def test_each_pass_runs_its_own_kernel(self):
    # FP8 forward with fp32 gradients: the gradients are exact, the output is not.
    x, w, g = _operands(7, 32, 64, 16)
    choice = kernels.KernelChoice("xla_fp8_tensorwise", "xla_fp32", "xla_fp32")
    fn = lambda a, b: kernels.per_pass_product(DENSE, choice, jnp.float32, a, b)
    out, vjp = jax.vjp(fn, x, w)
    dx, dw = vjp(g)
    ref_out, ref_vjp = jax.vjp(lambda a, b: reference_einsum(DENSE, a, b), x, w)
    rdx, rdw = ref_vjp(g)
    self.assertLess(float(metrics.sqnr_db(out, ref_out)), 40.0)
    self.assertGreater(float(metrics.sqnr_db(dx, rdx)), 100.0)
    self.assertGreater(float(metrics.sqnr_db(dw, rdw)), 100.0)
    # And the other way round: exact forward, FP8 wgrad only.
    choice = kernels.KernelChoice("xla_fp32", "xla_fp32", "xla_fp8_rowwise")
    out, vjp = jax.vjp(lambda a, b: kernels.per_pass_product(DENSE, choice, jnp.float32, a, b),
                       x, w)
    dx, dw = vjp(g)
    self.assertGreater(float(metrics.sqnr_db(out, ref_out)), 100.0)
    self.assertGreater(float(metrics.sqnr_db(dx, rdx)), 100.0)
    self.assertLess(float(metrics.sqnr_db(dw, rdw)), 40.0)

  def test_validate_choice_lists_every_problem(self):
    with self.assertRaisesRegex(ValueError, "fused-op kernel"):
      kernels.validate_choice(kernels.KernelChoice("flax_fp8_delayed", "xla_bf16", "xla_bf16"),
                              DENSE, kernels.ACT_WEIGHT, (4, 8), (8, 2), site_name="a/b")
    with self.assertRaisesRegex(KeyError, "unknown kernel 'nope'.*xla_bf16"):
      kernels.get("nope")


class FlaxDelayedTest(absltest.TestCase):

  def test_reaches_site_error_bar_after_warmup(self):
    x, w, g = _operands(8, 64, 96, 32)
    out, dx, dw, meta = _delayed_passes("mk,kn->mn", x, w, g)
    self.assertNotEqual(float(meta["input_scale"][0]), 1.0)
    for got, want in ((out, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
      self.assertGreaterEqual(float(metrics.sqnr_db(got, want)), 18.0)


class FlaxDelayedForwardTest(absltest.TestCase):

  def test_forward_is_flax_delayed_and_gradients_are_the_plain_product(self):
    x, w, g = (a.astype(jnp.bfloat16) for a in _operands(9, 32, 128, 48))
    out, dx, dw, meta = _delayed_passes("mk,kn->mn", x, w, g, kernel="flax_fp8_delayed_fwd")
    flax_out, flax_dx, flax_dw, _ = _delayed_passes("mk,kn->mn", x, w, g)
    # The forward is Flax's delayed-scaling e4m3 product, bit for bit ...
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(flax_out, np.float32))
    self.assertLess(float(metrics.sqnr_db(out, x @ w)), 45.0)  # ... and it did quantize.
    # Both gradients are the plain product's in the compute dtype, where Flax's are e5m2.
    _, vjp = jax.vjp(lambda a, b: jnp.einsum("mk,kn->mn", a, b), x, w)
    exact_dx, exact_dw = vjp(g)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(exact_dx, np.float32))
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(exact_dw, np.float32))
    self.assertFalse(np.array_equal(np.asarray(flax_dw, np.float32),
                                    np.asarray(exact_dw, np.float32)))
    # State: the operands' scales (learned in the warm-up) and histories, nothing for the
    # output gradient, which is never quantized.
    self.assertEqual(sorted(meta), ["input_amax_history", "input_scale",
                                    "kernel_amax_history", "kernel_scale"])
    self.assertNotEqual(float(meta["input_scale"][0]), 1.0)

  def test_passes_named_alike_compute_alike(self):
    # `Kernel.pass_numerics`: validation counts a pass two ops name alike as equally
    # accurate, so the name must mean bit-identical results, and different names different.
    x, w, g = (a.astype(jnp.bfloat16) for a in _operands(10, 32, 128, 48))
    names = ("flax_fp8_delayed", "flax_fp8_delayed_grad_lhs", "flax_fp8_delayed_fwd")
    results = {k: _delayed_passes("mk,kn->mn", x, w, g, kernel=k)[:3] for k in names}
    self.assertEqual(check.pass_numerics_disagreements(results), [])
    # Each op quantized its forward: a shared name is not a shared exact product.
    self.assertLess(float(metrics.sqnr_db(results["flax_fp8_delayed_fwd"][0], x @ w)), 45.0)

  def test_registered_as_a_stateful_fused_op(self):
    for name in ("flax_fp8_delayed_fwd", "flax_fp8_delayed_grad_lhs"):
      kernel = kernels.get(name)
      self.assertEqual(kernel.sort, kernels.FUSED_OP)
      self.assertTrue(kernel.stateful and kernel.fp8)

  def test_each_op_names_the_passes_it_quantizes(self):
    # A plan names a fused op in all three passes; validation asks which run in FP8.
    expected = {"flax_fp8_delayed": (True, True, True),
                "flax_fp8_delayed_grad_lhs": (True, True, False),
                "flax_fp8_delayed_fwd": (True, False, False),
                "xla_fp8_rowwise": (True, True, True), "xla_bf16": (False, False, False)}
    for name, quantized in expected.items():
      self.assertEqual(tuple(kernels.get(name).quantizes(p) for p in ("fwd", "grad_lhs",
                                                                        "grad_rhs")),
                       quantized, name)
    with self.assertRaises(ValueError):
      kernels.get("flax_fp8_delayed_fwd").quantizes("backward")


class FlaxDelayedGradLhsTest(parameterized.TestCase):

  @parameterized.parameters(("mk,kn->mn", (32, 128), (128, 48), (32, 48)),
                            ("bnd,nk->bdk", (8, 16, 32), (16, 12), (8, 32, 12)))
  def test_forward_and_grad_lhs_are_flax_and_grad_rhs_is_the_plain_product(
      self, spec, lhs_shape, rhs_shape, out_shape):
    keys = jax.random.split(jax.random.PRNGKey(11), 3)
    x, w, g = (jax.random.normal(k, shape).astype(jnp.bfloat16)
               for k, shape in zip(keys, (lhs_shape, rhs_shape, out_shape)))
    out, dx, dw, meta = _delayed_passes(spec, x, w, g, kernel="flax_fp8_delayed_grad_lhs")
    flax_out, flax_dx, flax_dw, flax_meta = _delayed_passes(spec, x, w, g)
    f32 = lambda a: np.asarray(a, np.float32)
    # The forward and grad_lhs are Flax's delayed-scaling products, bit for bit (the same
    # scales, learned over the same warm-up) ...
    np.testing.assert_array_equal(f32(out), f32(flax_out))
    np.testing.assert_array_equal(f32(dx), f32(flax_dx))
    # The plain product's gradients in one jitted program, as the kernel's run: op by op,
    # jax 0.11's XLA:CPU sums the batched bf16 weight gradient less precisely (36 dB from the
    # jitted one at 'bnd,nk->bdk').
    exact_dx, exact_dw = jax.jit(
        lambda a, b, d: jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)[1](d))(x, w, g)
    self.assertLess(float(metrics.sqnr_db(dx, exact_dx)), 40.0)  # ... and both quantized;
    # grad_rhs is the plain product's in the compute dtype, where Flax's is e5m2 x e4m3.
    np.testing.assert_array_equal(f32(dw), f32(exact_dw))
    self.assertFalse(np.array_equal(f32(flax_dw), f32(exact_dw)))
    # State: Flax's six variables, the output gradient's scale learned as Flax learns it.
    self.assertEqual(sorted(meta), sorted(flax_meta))
    self.assertEqual(float(meta["output_grad_scale"][0]),
                     float(flax_meta["output_grad_scale"][0]))
    self.assertNotEqual(float(meta["output_grad_scale"][0]), 1.0)


class OwnErrorTest(absltest.TestCase):

  def test_independent_errors_add_in_power(self):
    # Two independent errors of known size on one signal: the measured SQNR of the sum is
    # what `with_own_error_db` predicts from the two readings alone.
    ky, k1, k2 = jax.random.split(jax.random.PRNGKey(3), 3)
    y = jax.random.normal(ky, (4096, 64))
    e1 = 0.05 * jax.random.normal(k1, y.shape)
    e2 = 0.02 * jax.random.normal(k2, y.shape)
    first, own = (float(metrics.sqnr_db(y + e, y)) for e in (e1, e2))
    both = float(metrics.sqnr_db(y + e1 + e2, y))
    self.assertAlmostEqual(float(check.with_own_error_db(first, own)), both, delta=0.1)
    self.assertLess(both, min(first, own))


class HeadRoundingTest(absltest.TestCase):

  def test_flax_rounds_some_elements_apart_and_single_readings_move(self):
    # Flax's quantize divides in bf16 before the cast to e4m3: some elements land on another
    # code than our single rounding gives, and on a head's rows that moves single readings,
    # while both products stay FP8 products of the same data (means alike).
    r = check.head_rounding_readings(8, 512, 256)
    for name in ("ours", "flax", "differ_x", "differ_w"):
      self.assertEqual(r[name].shape, (8,), name)
      self.assertTrue(np.all(np.isfinite(r[name])), name)
    for name in ("differ_x", "differ_w"):
      self.assertGreater(r[name].mean(), 0.0, name)
      self.assertLess(r[name].max(), 0.2, name)
    self.assertGreater(np.abs(r["ours"] - r["flax"]).max(), 0.1)
    self.assertLess(abs(r["ours"].mean() - r["flax"].mean()), 2.0)


@dataclasses.dataclass(frozen=True)
class _BfloatChain(kernels_base.ChainKernel):
  """relu(x @ w + bias) in bfloat16: a chain kernel that needs no Pallas; `broken` makes its
  output non-finite."""
  broken: bool = False

  def chain(self, x, w, bias, *, out_dtype):
    z = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) + bias.astype(jnp.bfloat16)
    return (jax.nn.relu(z) * (jnp.nan if self.broken else 1.0)).astype(out_dtype)

  def chain_reference(self, x, w, bias):
    return jax.nn.relu(reference_einsum(DENSE, x, w) + bias)


class ChainCheckTest(absltest.TestCase):

  def test_a_chain_is_checked_whole_and_every_kernel_gets_a_verdict(self):
    problem = check.Problem(8, 16, 16, seed=2)
    kernel = _BfloatChain(name="test_bf16_chain", backend="xla", sort=kernels.FUSED_OP,
                          passes=frozenset())
    rows = check.check_chain(kernel, problem)
    self.assertEqual([r["pass"] for r in rows], ["fwd", *check.CHAIN_GRADS])
    for r in rows:
      self.assertIsNone(r["error"], r["pass"])
      self.assertGreater(r["sqnr_db"], 30.0, r["pass"])  # bf16 rounding only
    broken = check.check_chain(_BfloatChain(name="test_broken_chain", backend="xla",
                                            broken=True), problem)
    unsupported = {"kernel": "k", "pass": "fwd", "error": "unsupported: no"}
    found = check.verdicts(rows + broken + [
        unsupported, {**unsupported, "kernel": "test_bf16_chain"}])
    self.assertEqual(found, {"test_bf16_chain": check.MEASURED,
                             "test_broken_chain": check.ERROR, "k": check.UNSUPPORTED})


class EinsumSpecTest(parameterized.TestCase):

  @parameterized.parameters(
      ("mk,kn", "two operands"), ("m...k,kn->mn", "ascii letters"),
      ("mkk,kn->mn", "repeated index"), ("mk,kn->mz", "in no operand"),
      ("mkj,kn->mn", "summed in one operand"))
  def test_bad_specs(self, spec, message):
    with self.assertRaisesRegex(ValueError, message):
      kernels.EinsumSpec.parse(spec)

  def test_passes_and_axes(self):
    s = kernels.EinsumSpec.parse("bnd,nk->bdk")
    self.assertEqual(str(s.for_pass("grad_lhs")), "bdk,nk->bnd")
    self.assertEqual(str(s.for_pass("grad_rhs")), "bnd,bdk->nk")
    self.assertEqual(s.contracting_axes("lhs"), (1,))
    self.assertEqual(s.shapes((2, 3, 4), (3, 5)), (2, 4, 5))
    with self.assertRaisesRegex(ValueError, "index 'n' has size 3"):
      s.shapes((2, 3, 4), (7, 5))


if __name__ == "__main__":
  absltest.main()
