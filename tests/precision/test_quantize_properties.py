"""Property-based checks of quantize / dequantize and scaling (hypothesis)."""
import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest
from hypothesis import given, settings, strategies as st

from loka_jax import precision as P

finite32 = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True,
                     width=32)
# A few fixed shapes (one with a partial 128-block) so eager ops compile once per shape.
arrays = hnp.arrays(np.float32, st.sampled_from([(1, 1), (8, 24), (3, 130)]),
                    elements=finite32)
granularities = st.sampled_from(P.GRANULARITIES)
formats = st.sampled_from(("e4m3", "e5m2"))


class QuantizeProperties(absltest.TestCase):

  @settings(max_examples=30)
  @given(arrays, granularities, formats)
  def test_finite_in_finite_out_and_saturated(self, x, granularity, fmt):
    q = P.quantize(jnp.asarray(x), fmt, granularity, (1,))
    data = np.asarray(q.data.astype(jnp.float32))
    self.assertTrue(np.isfinite(data).all())
    self.assertLessEqual(np.abs(data).max(), P.get_format(fmt).max)
    self.assertTrue(np.isfinite(np.asarray(q.dequantize())).all())

  @settings(max_examples=30)
  @given(arrays, granularities, formats)
  def test_error_bound_per_element(self, x, granularity, fmt):
    # Every element is within half an ULP of its scaled value, or flushed below the smallest
    # subnormal: |x - dq| <= max(eps/2 * |x|, min_subnormal/2 * scale) (plus fp32 slack).
    f = P.get_format(fmt)
    q = P.quantize(jnp.asarray(x), fmt, granularity, (1,))
    scale = np.asarray(q.expanded_scale(), np.float64)
    dq = np.asarray(q.dequantize(), np.float64)
    err = np.abs(x.astype(np.float64) - dq)
    bound = np.maximum(f.epsilon / 2 * np.abs(x), f.min_subnormal / 2 * scale)
    np.testing.assert_array_less(err, bound * (1 + 1e-5) + 1e-30 + 1e-6 * np.abs(x))

  @settings(max_examples=30)
  @given(st.data(), formats)
  def test_representable_values_round_trip_exactly(self, data, fmt):
    f = P.get_format(fmt)
    bits = data.draw(hnp.arrays(np.uint8, (8, 16)))
    values = bits.view(getattr(ml_dtypes, str(f.dtype))).astype(np.float32)
    values = np.where(np.isfinite(values), values, 1.0).astype(np.float32)
    if np.abs(values).max() == 0:
      values[0, 0] = 1.0
    # With the amax pinned to the format max the scale is exactly 1: values are unchanged.
    amax = jnp.full((1, 1), f.max, jnp.float32)
    q = P.quantize(jnp.asarray(values), fmt, P.TENSORWISE, (1,), amax=amax)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), values)

  @settings(max_examples=30)
  @given(arrays, granularities, formats, st.floats(2.0, 1e6))
  def test_values_beyond_the_range_saturate_at_the_format_max(self, x, granularity, fmt,
                                                              stale):
    # A stale (delayed-scaling) amax `stale` times too small pushes values past the format
    # range: they must land exactly on +-max with their sign, never wrap, Inf or NaN.
    f = P.get_format(fmt)
    amax = P.compute_amax(jnp.asarray(x), granularity, (1,)) / stale
    q = P.quantize(jnp.asarray(x), fmt, granularity, (1,), amax=amax)
    data = np.asarray(q.data.astype(jnp.float32))
    self.assertTrue(np.isfinite(data).all())
    self.assertLessEqual(np.abs(data).max(), f.max)
    scaled = x.astype(np.float64) / np.asarray(q.expanded_scale(), np.float64)
    beyond = np.abs(scaled) > f.max * 1.01
    np.testing.assert_array_equal(data[beyond], np.sign(scaled[beyond]) * f.max)

  @settings(max_examples=30)
  @given(st.data(), granularities, formats)
  def test_representable_values_round_trip_exactly_per_recipe(self, data, granularity, fmt):
    # FP8 values times a power-of-two scale per row / block are exactly representable: with
    # the amax pinned to max * scale, quantize must recover the FP8 values and the inputs.
    f = P.get_format(fmt)
    shape = data.draw(st.sampled_from([(8, 24), (3, 130), (130, 5)]))
    bits = data.draw(hnp.arrays(np.uint8, shape))
    values = bits.view(getattr(ml_dtypes, str(f.dtype))).astype(np.float32)
    values = np.where(np.isfinite(values), values, 1.0).astype(np.float32)
    scale_shape = P.compute_amax(jnp.asarray(values), granularity, (1,)).shape
    exponents = data.draw(hnp.arrays(np.int32, scale_shape, elements=st.integers(-20, 20)))
    scale = jnp.asarray(np.ldexp(np.float32(1), exponents).astype(np.float32))
    shell = P.QTensor(data=jnp.asarray(values), scale=scale, granularity=granularity, axis=(1,))
    x = jnp.asarray(values) * shell.expanded_scale()
    q = P.quantize(x, fmt, granularity, (1,), amax=scale * f.max)
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(scale))
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32)), values)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(x))

  @settings(max_examples=30)
  @given(hnp.arrays(np.float32, st.sampled_from([(1, 1), (24, 8), (130, 3)]),
                    elements=finite32),
         st.sampled_from((P.ROWWISE, P.BLOCK_1x128)), formats, st.booleans())
  def test_error_bound_for_gradient_layouts(self, x, granularity, fmt, power_of_two):
    # Backward passes contract axis 0 (scales per column, 1x128 blocks become 128x1), and
    # power-of-two scales round the scale up: the half-ULP bound holds for both.
    f = P.get_format(fmt)
    q = P.quantize(jnp.asarray(x), fmt, granularity, (0,), power_of_two=power_of_two)
    self.assertTrue(np.isfinite(np.asarray(q.data.astype(jnp.float32))).all())
    scale = np.asarray(q.expanded_scale(), np.float64)
    err = np.abs(x.astype(np.float64) - np.asarray(q.dequantize(), np.float64))
    bound = np.maximum(f.epsilon / 2 * np.abs(x), f.min_subnormal / 2 * scale)
    np.testing.assert_array_less(err, bound * (1 + 1e-5) + 1e-30 + 1e-6 * np.abs(x))

  @settings(max_examples=30)
  @given(arrays, formats)
  def test_power_of_two_scales_never_overflow(self, x, fmt):
    q = P.quantize(jnp.asarray(x), fmt, P.ROWWISE, (1,), power_of_two=True)
    scale = np.asarray(q.scale)
    np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))
    self.assertEqual(float(P.flush_fractions(jnp.asarray(x), q)[1]), 0.0)


if __name__ == "__main__":
  absltest.main()
