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
  @given(arrays, formats)
  def test_power_of_two_scales_never_overflow(self, x, fmt):
    q = P.quantize(jnp.asarray(x), fmt, P.ROWWISE, (1,), power_of_two=True)
    scale = np.asarray(q.scale)
    np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))
    self.assertEqual(float(P.flush_fractions(jnp.asarray(x), q)[1]), 0.0)


if __name__ == "__main__":
  absltest.main()
