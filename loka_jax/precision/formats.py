"""FP8 formats and their limits, one definition for the whole library."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class FP8Format:
  """An FP8 storage format: its dtype and the numbers that scaling needs."""
  name: str
  dtype: np.dtype
  max: float            # largest finite magnitude
  min_normal: float     # smallest normal magnitude
  min_subnormal: float  # smallest positive magnitude; below half of it a value flushes to 0
  epsilon: float        # spacing just above 1.0 (relative rounding step is epsilon / 2)

  @property
  def mantissa_bits(self) -> int:
    return int(round(-np.log2(self.epsilon)))


def _format(name: str, dtype) -> FP8Format:
  info = ml_dtypes.finfo(dtype)
  return FP8Format(
      name=name,
      dtype=jnp.dtype(dtype),
      max=float(info.max),
      min_normal=float(info.smallest_normal),
      min_subnormal=float(info.smallest_subnormal),
      epsilon=float(info.eps),
  )


# e4m3fn: no infinities, max 448; the forward-operand format.
E4M3 = _format("e4m3", jnp.float8_e4m3fn)
# e5m2: IEEE-like, max 57344; the gradient format (range over resolution).
E5M2 = _format("e5m2", jnp.float8_e5m2)

FORMATS = {f.name: f for f in (E4M3, E5M2)}


def get_format(name_or_format) -> FP8Format:
  """Looks a format up by name ('e4m3', 'e5m2'); passes FP8Format through."""
  if isinstance(name_or_format, FP8Format):
    return name_or_format
  try:
    return FORMATS[name_or_format]
  except KeyError:
    raise ValueError(
        f"unknown FP8 format {name_or_format!r}; known: {sorted(FORMATS)}") from None
