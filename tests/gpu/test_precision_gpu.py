"""The FP8 round trip on the GPU: a program that quantizes and dequantizes multiplies the
quantized values (run on the GPU host: `python3 -m pytest tests/gpu -m gpu -q`)."""
import jax
import ml_dtypes
import numpy as np
import pytest

from loka_jax import precision as P

from gpu_helpers import heavy


def cast_codes(x, q):
  """The e4m3 codes of x / q's scales as ml_dtypes casts them, as float32."""
  scale = np.asarray(q.scale, np.float32)
  return (np.asarray(x) / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


@pytest.mark.parametrize("granularity,axes", [(P.ROWWISE, (1,)), (P.TENSORWISE, ())])
def test_round_trip_survives_one_program(granularity, axes):
  # Under XLA:GPU's default excess precision a bare convert pair f32 -> e4m3 -> f32 in one
  # program is simplified away; QTensor.dequantize keeps it (its codes pass a barrier).
  x = heavy(jax.random.key(5), (2048, 512), dtype=np.float32)
  q = P.quantize(x, P.E4M3, granularity, axes)
  want = cast_codes(x, q) * np.asarray(q.scale, np.float32)
  got = np.asarray(jax.jit(lambda x: P.quantize_dequantize(x, P.E4M3, granularity, axes))(x))

  def off(values):  # the fraction of entries that are not the cast's value
    return float(np.mean(np.abs(values - want) > 1e-6 * np.abs(want)))

  # A division rounded differently may move a rare value to the neighbouring code; the
  # unquantized values miss nearly every entry.
  assert off(got) <= 1e-4
  assert off(np.asarray(x)) > 0.5


def test_underflow_counts_the_codes_at_zero_in_one_program():
  # The probe's no-flush criterion reads flush_fractions inside its jitted evaluators.
  x = heavy(jax.random.key(6), (1024, 256), dtype=np.float32)
  x = x.at[:, :8].multiply(1e-6)   # 8 of 256 entries a row flush under the row's scale
  want = float(np.mean(cast_codes(x, P.quantize(x, P.E4M3, P.ROWWISE, (1,))) == 0))
  assert want >= 8 / 256
  got = jax.jit(lambda x: P.flush_fractions(x, P.quantize(x, P.E4M3, P.ROWWISE, (1,)))[0])(x)
  assert abs(float(got) - want) <= 1e-4
