"""Fused Pallas quantize (interpret mode) against the library's quantize: bit-exact."""
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import chex

from kernels_pallas import compat
from kernels_pallas import quantize as kq
from loka_jax import _compat
from loka_jax.precision import E4M3, E5M2, scaling


def _poisoned(key, shape, dtype=jnp.float32):
  """Heavy-tailed data with NaN, +-Inf, an all-zero row and an outlier column."""
  x = jax.random.normal(key, shape) * jnp.exp(jax.random.normal(jax.random.fold_in(key, 1), shape))
  x = x.at[(0,) * (len(shape) - 1) + (3,)].set(jnp.nan)
  x = x.at[(1,) * (len(shape) - 1) + (5,)].set(jnp.inf)
  x = x.at[(2,) * (len(shape) - 1) + (7,)].set(-jnp.inf)
  x = x.at[(3,) * (len(shape) - 1)].set(0.0)
  return x.astype(dtype)


def _assert_same_qtensor(test, got, want, x):
  """Scales equal up to one ulp (XLA may divide by the format max as a reciprocal multiply);
  data bit-exact given the kernel's own scales."""
  chex.assert_shape(got.scale, want.scale.shape)
  test.assertEqual(got.data.dtype, want.data.dtype)
  test.assertEqual(got.granularity, want.granularity)
  test.assertEqual(got.axis, want.axis)
  np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), rtol=2.5e-7, atol=0)
  fmt = E4M3 if got.data.dtype == E4M3.dtype else E5M2
  expected = scaling.quantize_with_scale(x, got.expanded_scale(), fmt)
  np.testing.assert_array_equal(np.asarray(got.data.astype(jnp.float32)),
                                np.asarray(expected.astype(jnp.float32)))


class QuantizeTest(parameterized.TestCase):

  def test_interpret_mode_on_cpu(self):
    self.assertTrue(compat.use_interpret())

  @parameterized.named_parameters(
      ("rowwise_last", (48, 200), "rowwise", (1,)),
      ("rowwise_first", (48, 200), "rowwise", (0,)),
      ("tensorwise", (48, 200), "tensorwise", ()),
      ("block_1x128_last", (48, 200), "block_1x128", (1,)),
      ("block_128x1_first", (200, 48), "block_1x128", (0,)),
      ("block_128x128", (200, 150), "block_128x128", (0,)),
      ("rowwise_batched_last", (3, 10, 40), "rowwise", (2,)),
      ("rowwise_batched_middle", (3, 40, 24), "rowwise", (1,)),
      ("rowwise_tall_two_phase", (9000, 40), "rowwise", (0,)),
  )
  def test_matches_reference(self, shape, granularity, axes):
    x = _poisoned(jax.random.key(sum(shape)), shape)
    got = kq.quantize(x, "e4m3", granularity, axes)
    _assert_same_qtensor(self, got, kq.quantize_reference(x, "e4m3", granularity, axes), x)
    # NaN stays NaN, infinities saturate, the zero row gets scale 1 and zero data.
    self.assertTrue(bool(jnp.isnan(got.data.astype(jnp.float32)).any()))

  def test_bf16_input_e5m2(self):
    x = _poisoned(jax.random.key(7), (24, 136), jnp.bfloat16)
    got = kq.quantize(x, E5M2, "rowwise", (1,))
    _assert_same_qtensor(self, got, kq.quantize_reference(x, E5M2, "rowwise", (1,)), x)

  def test_saturates_and_keeps_zero_rows(self):
    x = jax.random.normal(jax.random.key(3), (20, 50)).at[4].set(0.0)
    q = kq.quantize(x, "e4m3", "rowwise", (1,))
    self.assertEqual(float(q.scale[4, 0]), 1.0)
    self.assertEqual(float(jnp.max(jnp.abs(q.data[4].astype(jnp.float32)))), 0.0)
    amax_q = jnp.max(jnp.abs(q.data.astype(jnp.float32)), axis=1)
    np.testing.assert_allclose(np.asarray(amax_q[jnp.arange(20) != 4]), 448.0)

  def test_bad_axes_raise(self):
    x = jnp.ones((2, 3, 4))
    with self.assertRaisesRegex(ValueError, "contiguous"):
      kq.quantize(x, "e4m3", "rowwise", (0, 2))
    with self.assertRaisesRegex(ValueError, "2-D"):
      kq.quantize(x, "e4m3", "block_128x128", (1,))
    with self.assertRaisesRegex(ValueError, "dtype"):
      kq.quantize(x.astype(jnp.int32), "e4m3", "rowwise", (2,))

  def test_lowers_to_triton_for_cuda(self):
    """The Triton lowering (no GPU needed) accepts every quantize kernel."""
    spec = jax.ShapeDtypeStruct((48, 200), jnp.bfloat16)
    for gran, axes in (("rowwise", (1,)), ("rowwise", (0,)), ("tensorwise", ()),
                       ("block_1x128", (1,)), ("block_128x128", (0,))):
      fn = jax.jit(lambda x, g=gran, a=axes: kq.quantize(x, "e4m3", g, a))
      # The abstract GPU gives jax 0.11's Triton lowering a compute capability without a GPU.
      with compat.compiled_kernels(), _compat.abstract_gpu():
        text = fn.trace(spec).lower(lowering_platforms=("cuda",)).as_text()
      self.assertTrue("__gpu$xla.gpu.triton" in text, f"{gran}: no Triton custom call")


if __name__ == "__main__":
  absltest.main()
