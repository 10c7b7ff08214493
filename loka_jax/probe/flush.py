"""Underflow and saturation fractions per FP8 format and scaling granularity, cheaply.

With current scaling (scale = amax / fmt.max over the scale's group) a value x flushes to zero
exactly when |x| / scale <= fmt.min_subnormal / 2 (round to nearest even sends the half-way
value to 0), so counting needs one amax reduction and one comparison per granularity: no cast.
`tests/test_probe_stats.py` checks the count against real quantization.
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from loka_jax.precision import (BLOCK_1x128, BLOCK_128x128, E4M3, E5M2, ROWWISE, TENSORWISE,
                                compute_amax, scale_from_amax)
from loka_jax.precision.qtensor import QTensor

FORMATS = (E4M3, E5M2)
GRANULARITIES = (TENSORWISE, ROWWISE, BLOCK_1x128, BLOCK_128x128)


def underflow_fraction(x: jax.Array, fmt, granularity: str, contracting_axis: int) -> jax.Array:
  """Fraction of the nonzero finite entries of `x` that current scaling flushes to zero.

  `x` is a canonical (batch, free, features) operand; `contracting_axis` is 1 or 2. The
  128x128 granularity tiles the (free, features) matrix of each batch entry.
  """
  xf = x.astype(jnp.float32)
  if granularity == BLOCK_128x128:
    b, f, k = xf.shape
    amax = jax.vmap(lambda m: compute_amax(m, BLOCK_128x128, (contracting_axis - 1,)))(xf)
    scale = scale_from_amax(amax, fmt)
    expand = jax.vmap(lambda s, m: QTensor(m, s, BLOCK_128x128, (contracting_axis - 1,))
                      .expanded_scale())
    scale = expand(scale, xf)
  else:
    amax = compute_amax(xf, granularity, (contracting_axis,))
    scale = QTensor(xf, scale_from_amax(amax, fmt), granularity,
                    (contracting_axis,)).expanded_scale()
  finite_nonzero = jnp.isfinite(xf) & (xf != 0)
  flushed = finite_nonzero & (jnp.abs(xf) / scale <= fmt.min_subnormal / 2)
  return jnp.sum(flushed) / jnp.maximum(jnp.sum(finite_nonzero), 1)


def table(x: jax.Array, contracting_axis: int) -> jax.Array:
  """Underflow fractions [format, granularity] (FORMATS x GRANULARITIES) for one use of x."""
  rows = []
  for fmt in FORMATS:
    rows.append(jnp.stack([underflow_fraction(x, fmt, g, contracting_axis)
                           for g in GRANULARITIES]))
  return jnp.stack(rows)


def delayed_saturation(x: jax.Array, previous_amax: jax.Array) -> jax.Array:
  """Fraction of nonzero finite entries above the previous observation's amax: what a
  tensorwise delayed-scaling recipe would clip (0 before any previous amax exists)."""
  xf = jnp.abs(x.astype(jnp.float32))
  finite_nonzero = jnp.isfinite(xf) & (xf != 0)
  over = finite_nonzero & (xf > previous_amax) & (previous_amax > 0)
  return jnp.sum(over) / jnp.maximum(jnp.sum(finite_nonzero), 1)


def amax(x: jax.Array) -> jax.Array:
  xf = jnp.abs(x.astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isfinite(xf), xf, 0.0))


def names() -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
  """(format names, granularity names): the axes of `table`."""
  return tuple(f.name for f in FORMATS), GRANULARITIES


def as_dict(values) -> Dict[str, Dict[str, float]]:
  """A [format, granularity] array -> {format: {granularity: value}} (host side)."""
  fmts, grans = names()
  return {f: {g: float(values[i][j]) for j, g in enumerate(grans)} for i, f in enumerate(fmts)}
