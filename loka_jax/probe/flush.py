"""Underflow and saturation fractions per FP8 format and scaling granularity, cheaply.

With current scaling (scale = amax / fmt.max over the scale's group, guarded as the quantizer
guards it) a value x flushes to zero exactly when |x| / scale <= fmt.min_subnormal / 2 (round
to nearest even sends the half-way value to 0), so counting needs one amax reduction per
granularity and one comparison per format: no cast. `tests/probe/test_stats.py` checks the
count against real quantization.
"""
from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from loka_jax.precision import (BLOCK_1x128, BLOCK_128x128, E4M3, E5M2, ROWWISE, TENSORWISE,
                                scale_from_amax)
from loka_jax.precision.qtensor import BLOCK

FORMATS = (E4M3, E5M2)
GRANULARITIES = (TENSORWISE, ROWWISE, BLOCK_1x128, BLOCK_128x128)


def _blocked_max(ax: jax.Array, axis: int) -> jax.Array:
  """Max of |x| over blocks of BLOCK along `axis`, broadcast back to x's shape."""
  size = ax.shape[axis]
  if size <= BLOCK:  # one block: a plain reduction (keeps small models' graphs small)
    return jnp.broadcast_to(jnp.max(ax, axis=axis, keepdims=True), ax.shape)
  nb = -(-size // BLOCK)
  widths = [(0, 0)] * ax.ndim
  widths[axis] = (0, nb * BLOCK - size)
  padded = jnp.pad(ax, widths)
  shape = list(padded.shape)
  shape[axis:axis + 1] = [nb, BLOCK]
  blocks = jnp.max(padded.reshape(shape), axis=axis + 1, keepdims=True)
  full = jnp.broadcast_to(blocks, shape).reshape(padded.shape)
  return jax.lax.slice(full, (0,) * ax.ndim, ax.shape)


def group_amax(ax: jax.Array, granularity: str, axis: int) -> jax.Array:
  """Per-scale-group amax of |x| (a canonical (batch, free, features) array), broadcast
  back to its shape; `axis` (1 or 2) is the contracting axis of the use."""
  if granularity == TENSORWISE:
    return jnp.broadcast_to(jnp.max(ax), ax.shape)
  if granularity == ROWWISE:
    return jnp.broadcast_to(jnp.max(ax, axis=axis, keepdims=True), ax.shape)
  if granularity == BLOCK_1x128:
    return _blocked_max(ax, axis)
  if granularity == BLOCK_128x128:  # tiles of each batch entry's (free, features) matrix
    return _blocked_max(_blocked_max(ax, 1), 2)
  raise ValueError(f"unknown granularity {granularity!r}; known: {GRANULARITIES}")


def table(x: jax.Array, contracting_axis: int, formats=FORMATS,
          granularities=GRANULARITIES) -> jax.Array:
  """Underflow fractions [format, granularity] for one use of the canonical operand x."""
  xf = x.astype(jnp.float32)
  finite_nonzero = jnp.isfinite(xf) & (xf != 0)
  ax = jnp.where(jnp.isfinite(xf), jnp.abs(xf), 0.0)
  count = jnp.maximum(jnp.sum(finite_nonzero), 1)
  # One count per (format, granularity), each fused with its group's amax: stacking the
  # broadcast amaxes would write 8 operand-sized arrays first.
  groups = [group_amax(ax, g, contracting_axis) for g in granularities]
  counts = []
  for fmt in formats:
    bar = jnp.float32(fmt.min_subnormal / 2)
    for group in groups:
      counts.append(jnp.sum(finite_nonzero & (ax / scale_from_amax(group, fmt) <= bar)))
  return jnp.stack(counts).reshape(len(formats), len(granularities)) / count


def underflow_fraction(x: jax.Array, fmt, granularity: str, contracting_axis: int) -> jax.Array:
  """Fraction of the nonzero finite entries of canonical `x` that current scaling flushes."""
  return table(x, contracting_axis, formats=(fmt,), granularities=(granularity,))[0, 0]


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
