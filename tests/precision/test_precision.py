"""FP8 formats, scaling recipes, quantize / dequantize, QTensor."""
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import precision as P
from loka_jax.precision import metrics


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


class FormatsTest(absltest.TestCase):

  def test_limits_match_the_ocp_fp8_spec(self):
    # Constants from the OCP 8-bit floating point specification, not from the code under test.
    self.assertEqual(P.E4M3.max, 448.0)
    self.assertEqual(P.E4M3.min_normal, 2.0 ** -6)
    self.assertEqual(P.E4M3.min_subnormal, 2.0 ** -9)
    self.assertEqual(P.E4M3.epsilon, 0.125)
    self.assertEqual(P.E5M2.max, 57344.0)
    self.assertEqual(P.E5M2.min_normal, 2.0 ** -14)
    self.assertEqual(P.E5M2.min_subnormal, 2.0 ** -16)
    self.assertEqual(P.E5M2.epsilon, 0.25)
    self.assertEqual(P.get_format("e4m3"), P.E4M3)
    with self.assertRaisesRegex(ValueError, "unknown FP8 format"):
      P.get_format("e3m4")

  def test_policy_rejects_fp8_and_integers(self):
    with self.assertRaisesRegex(ValueError, "FP8 is a kernel's storage format"):
      P.DtypePolicy(compute_dtype=jnp.float8_e4m3fn)
    with self.assertRaisesRegex(ValueError, "floating"):
      P.DtypePolicy(param_dtype=jnp.int32)
    self.assertEqual(P.DtypePolicy.named("bf16").compute_dtype, jnp.bfloat16)
    with self.assertRaisesRegex(ValueError, "unknown dtype policy"):
      P.DtypePolicy.named("fp16")


class QuantizeTest(parameterized.TestCase):

  @parameterized.product(granularity=P.GRANULARITIES, fmt=("e4m3", "e5m2"))
  def test_round_trip_sqnr_on_standard_normal(self, granularity, fmt):
    x = _normal(1, (256, 384))
    y = P.quantize_dequantize(x, fmt, granularity, (1,))
    bar = 28.0 if fmt == "e4m3" else 22.0
    self.assertGreaterEqual(float(metrics.sqnr_db(y, x)), bar)

  @parameterized.parameters("e4m3", "e5m2")
  def test_cast_is_bit_exact_with_ml_dtypes(self, fmt):
    f = P.get_format(fmt)
    x = np.asarray(_normal(2, (64, 96), scale=3.0))
    scale = np.float32(2.0 ** -3)  # power of two: x / scale is exact in float32
    ours = np.asarray(P.quantize_with_scale(jnp.asarray(x), jnp.asarray(scale), f))
    theirs = (x / scale).clip(-f.max, f.max).astype(getattr(ml_dtypes, str(f.dtype)))
    np.testing.assert_array_equal(ours.view(np.uint8), theirs.view(np.uint8))

  @parameterized.parameters(*P.GRANULARITIES)
  def test_overflow_saturates_never_wraps(self, granularity):
    x = _normal(3, (128, 256))
    # Delayed scaling with a stale amax 1000x too small: most values overflow the format.
    amax = P.compute_amax(x, granularity, (1,)) / 1000.0
    q = P.quantize(x, P.E4M3, granularity, (1,), amax=amax)
    data = np.asarray(q.data.astype(jnp.float32))
    self.assertTrue(np.isfinite(data).all())
    self.assertEqual(np.abs(data).max(), 448.0)
    np.testing.assert_array_equal(np.sign(data[np.abs(np.asarray(x)) > 1e-2]),
                                  np.sign(np.asarray(x)[np.abs(np.asarray(x)) > 1e-2]))
    _, saturation = P.flush_fractions(x, q)
    self.assertGreater(float(saturation), 0.5)

  def test_all_zero_tensor_gets_unit_scale(self):
    x = jnp.zeros((16, 256))
    for g in P.GRANULARITIES:
      q = P.quantize(x, P.E4M3, g, (1,))
      np.testing.assert_array_equal(np.asarray(q.scale), 1.0)
      np.testing.assert_array_equal(np.asarray(q.dequantize()), 0.0)

  def test_non_finite_inputs_are_documented_behaviour(self):
    x = np.array(_normal(4, (8, 128)))
    x[0, 3] = np.inf
    x[1, 5] = -np.inf
    x[2, 7] = np.nan
    q = P.quantize(jnp.asarray(x), P.E4M3, P.TENSORWISE, (1,))
    finite_amax = np.abs(x[np.isfinite(x)]).max()
    np.testing.assert_allclose(float(q.scale.reshape(())), finite_amax / 448.0, rtol=1e-6)
    d = np.asarray(q.dequantize())
    self.assertEqual(d[0, 3], np.float32(448.0) * q.scale.reshape(()))   # +Inf saturates
    self.assertEqual(d[1, 5], -np.float32(448.0) * q.scale.reshape(()))  # -Inf saturates
    self.assertTrue(np.isnan(d[2, 7]))                                    # NaN propagates
    self.assertEqual(int(np.isnan(d).sum()), 1)

  def test_rowwise_scales_follow_the_non_contracting_axis(self):
    x = _normal(5, (32, 200)) * jnp.arange(1, 33, dtype=jnp.float32)[:, None]
    q = P.quantize(x, P.E4M3, P.ROWWISE, (1,))
    chex.assert_shape(q.scale, (32, 1))
    np.testing.assert_allclose(np.asarray(q.scale[:, 0]),
                               np.abs(np.asarray(x)).max(axis=1) / 448.0, rtol=1e-6)
    qt = P.quantize(x, P.E4M3, P.ROWWISE, (0,))  # as the wgrad pass would: per column
    chex.assert_shape(qt.scale, (1, 200))

  def test_blockwise_isolates_an_outlier_to_its_block(self):
    x = np.array(_normal(6, (4, 300)))
    x[0, 130] = 1e5
    q = P.quantize(jnp.asarray(x), P.E4M3, P.BLOCK_1x128, (1,))
    chex.assert_shape(q.scale, (4, 3))  # 300 = 2 full blocks + a masked tail block
    scale = np.asarray(q.scale)
    self.assertAlmostEqual(scale[0, 1], 1e5 / 448.0, delta=1.0)
    self.assertLess(scale[0, 0], 1.0)
    self.assertLess(scale[0, 2], 1.0)
    q2 = P.quantize(jnp.asarray(x[:, :256]), P.E4M3, P.BLOCK_128x128, (1,))
    chex.assert_shape(q2.scale, (1, 2))
    with self.assertRaisesRegex(ValueError, "exactly one contracting axis"):
      P.quantize(jnp.ones((2, 3, 4)), P.E4M3, P.BLOCK_1x128, (1, 2))

  def test_power_of_two_scales(self):
    x = _normal(7, (64, 64), scale=5.0)
    q = P.quantize(x, P.E4M3, P.ROWWISE, (1,), power_of_two=True)
    log2 = np.log2(np.asarray(q.scale))
    np.testing.assert_array_equal(log2, np.round(log2))
    self.assertLessEqual(float(jnp.max(jnp.abs(q.data.astype(jnp.float32)))), 448.0)
    _, saturation = P.flush_fractions(x, q)
    self.assertEqual(float(saturation), 0.0)

  def test_outlier_channels_flush_everyone_else(self):
    # 4 of 512 channels x1e6 flush ~99% of the other values in tensorwise and
    # rowwise e4m3, far fewer in 1x128 blockwise.
    x = np.array(_normal(8, (256, 512)))
    x[:, [3, 100, 260, 400]] *= 1e6
    fractions = {}
    for g in (P.TENSORWISE, P.ROWWISE, P.BLOCK_1x128):
      q = P.quantize(jnp.asarray(x), P.E4M3, g, (1,))
      fractions[g] = float(P.flush_fractions(jnp.asarray(x), q)[0])
    self.assertGreater(fractions[P.TENSORWISE], 0.9)
    self.assertGreater(fractions[P.ROWWISE], 0.9)
    self.assertLess(fractions[P.BLOCK_1x128], 0.9)

  def test_qtensor_refuses_a_product_with_other_contracting_axes(self):
    q = P.quantize(_normal(9, (16, 32)), P.E4M3, P.ROWWISE, (1,))
    q.check_axis((1,), "fwd")
    with self.assertRaisesRegex(ValueError, "requantize"):
      q.check_axis((0,), "grad_rhs")

  def test_dequantize_keeps_the_round_trip_in_one_program(self):
    # XLA:GPU simplifies a convert pair f32 -> e4m3 -> f32 away under its default excess
    # precision, so a program that quantizes and dequantizes would multiply unquantized
    # values. The codes reach the dequantize through an optimization barrier, which no
    # simplification crosses (tests/gpu/test_precision_gpu.py checks the values on a GPU).
    x = _normal(3, (64, 32))
    text = jax.jit(lambda x: P.quantize_dequantize(x, P.E4M3, P.ROWWISE, (1,))).lower(
        x).as_text()
    barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
    self.assertLen(barriers, 1)
    self.assertIn("f8E4M3FN", barriers[0])
    # And the round trip is the cast's, value for value (here on the CPU).
    q = P.quantize(x, P.E4M3, P.ROWWISE, (1,))
    scale = np.asarray(q.scale, np.float32)
    want = (np.asarray(x) / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    np.testing.assert_array_equal(
        jax.jit(lambda x: P.quantize_dequantize(x, P.E4M3, P.ROWWISE, (1,)))(x), want)
    # The underflow count reads its codes the same way (a cast simplified away would leave
    # none at zero, and the probe's no-flush criterion would pass every kernel).
    tiny = x.at[:, 0].set(1e-6)    # each row's first entry flushes under its row's scale
    flush = jax.jit(lambda x: P.flush_fractions(x, P.quantize(x, P.E4M3, P.ROWWISE, (1,)))[0])
    self.assertIn("optimization_barrier", flush.lower(tiny).as_text())
    self.assertAlmostEqual(float(flush(tiny)), 1 / 32, places=6)

  def test_qtensor_is_a_pytree_through_jit(self):
    q = P.quantize(_normal(10, (16, 32)), P.E4M3, P.ROWWISE, (1,))
    back = jax.jit(lambda t: t)(q)
    self.assertEqual(back.granularity, P.ROWWISE)
    chex.assert_trees_all_equal(back.dequantize(), q.dequantize())


class DelayedScalingTest(absltest.TestCase):

  def test_history_rolls_and_scale_uses_its_max(self):
    h = P.init_amax_history(4)
    for v in (2.0, 8.0, 4.0):
      h = P.update_amax_history(h, jnp.array([v, -v / 2]))
    np.testing.assert_array_equal(np.asarray(h), [4.0, 8.0, 2.0, 0.0])
    self.assertAlmostEqual(float(P.delayed_scale(h, P.E4M3)), 8.0 / 448.0, places=7)
    self.assertEqual(float(P.delayed_scale(P.init_amax_history(4), P.E4M3)), 1.0)
    with self.assertRaisesRegex(ValueError, ">= 1"):
      P.init_amax_history(0)


class MetricsTest(absltest.TestCase):

  def test_metrics_against_hand_values(self):
    ref = jnp.array([1.0, -2.0, 2.0, 4.0])
    out = jnp.array([1.1, -2.0, 2.0, 4.0])
    # signal 25, noise 0.01 -> 10 log10(2500) = 33.979 dB; rel_fro = 0.1 / 5.
    self.assertAlmostEqual(float(metrics.sqnr_db(out, ref)), 33.9794, places=3)
    self.assertAlmostEqual(float(metrics.rel_fro(out, ref)), 0.02, places=6)
    rms = np.sqrt(25 / 4)
    self.assertAlmostEqual(float(metrics.mere(out, ref)), 0.1 / (1 + 1e-3 * rms) / 4, places=6)
    self.assertEqual(float(metrics.sqnr_db(ref, ref)), metrics.SQNR_CAP_DB)
    self.assertIsNone(metrics.to_json_safe(float("nan")))


if __name__ == "__main__":
  absltest.main()
