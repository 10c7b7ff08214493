"""Scaling recipes and saturating quantize / dequantize.

Conventions (docs/ARCHITECTURE.md, "Numerics"):
- `scale` is the dequantization scale: x ~= fp8_data * scale, scale = amax / fmt.max.
- amax is taken over finite values only; amax = 0 (an all-zero tensor or block) gives scale 1.
- Values are clipped to +-fmt.max before the cast, so overflow saturates and never wraps;
  +-Inf saturate too. NaN stays NaN (e4m3fn and e5m2 both have NaN) so the NaN guard
  downstream still sees it rather than a silently plausible number.
- Scales lie on the non-contracting axes of the product being computed: `contracting_axes`
  are reduced away (tensorwise: every axis).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp

from loka_jax.precision import formats as formats_lib
from loka_jax.precision.qtensor import (BLOCK, BLOCK_1x128, BLOCK_128x128, GRANULARITIES,
                                        ROWWISE, TENSORWISE, QTensor)

_TINY = float(jnp.finfo(jnp.float32).tiny)


def _normalize_axes(axes: Sequence[int], ndim: int) -> Tuple[int, ...]:
  out = tuple(sorted(a % ndim for a in axes))
  if len(set(out)) != len(out):
    raise ValueError(f"repeated axis in contracting axes {tuple(axes)}")
  return out


def finite_abs(x: jax.Array) -> jax.Array:
  """|x| in fp32 with non-finite entries replaced by 0 (they must not set the scale)."""
  ax = jnp.abs(x.astype(jnp.float32))
  return jnp.where(jnp.isfinite(ax), ax, 0.0)


def scale_from_amax(amax: jax.Array, fmt, power_of_two: bool = False,
                    margin: float = 0.0) -> jax.Array:
  """Dequantization scale amax / (fmt.max / 2**margin), guarded against 0 and non-finite."""
  fmt = formats_lib.get_format(fmt)
  amax = amax.astype(jnp.float32)
  target = fmt.max / (2.0 ** margin)
  scale = amax / target
  if power_of_two:
    # Round up so that amax / scale never exceeds the target (no overflow from rounding).
    # frexp/ldexp are exact where exp2(ceil(log2(.))) is not in float32.
    mantissa, exponent = jnp.frexp(jnp.maximum(scale, _TINY))
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    scale = jnp.ldexp(jnp.ones_like(scale), exponent)
  good = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(good, jnp.maximum(scale, _TINY), 1.0).astype(jnp.float32)


def _block_reshape(x: jax.Array, axis: int) -> Tuple[jax.Array, int]:
  """Pads `axis` to a multiple of BLOCK with zeros and splits it into (nblocks, BLOCK)."""
  size = x.shape[axis]
  nblocks = -(-size // BLOCK)
  pad = nblocks * BLOCK - size
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
  return x.reshape(x.shape[:axis] + (nblocks, BLOCK) + x.shape[axis + 1:]), nblocks


# Hooks applied to every tensorwise amax (loka_jax.parallel: one amax across all shards
# instead of each shard's own under shard_map). Rowwise and blockwise amaxes are left alone.
TENSORWISE_AMAX_HOOKS = []


def compute_amax(x: jax.Array, granularity: str, contracting_axes: Sequence[int]) -> jax.Array:
  """Per-scale amax with the shape the scale will have (keepdims / one entry per block)."""
  amax = _local_amax(x, granularity, contracting_axes)
  if granularity == TENSORWISE:
    for hook in TENSORWISE_AMAX_HOOKS:
      amax = hook(amax)
  return amax


def _local_amax(x: jax.Array, granularity: str, contracting_axes: Sequence[int]) -> jax.Array:
  if granularity not in GRANULARITIES:
    raise ValueError(f"unknown granularity {granularity!r}; known: {GRANULARITIES}")
  absx = finite_abs(x)
  axes = _normalize_axes(contracting_axes, x.ndim)
  if granularity == TENSORWISE:
    return jnp.max(absx, keepdims=True) if x.ndim else jnp.max(absx)
  if granularity == ROWWISE:
    if not axes:
      raise ValueError(f"rowwise scaling of shape {x.shape} needs at least one contracting "
                       "axis (contracting_axes=...); use tensorwise for a product without one")
    return jnp.max(absx, axis=axes, keepdims=True)
  if granularity == BLOCK_1x128:
    if len(axes) != 1:
      raise ValueError(
          f"block_1x128 scaling needs exactly one contracting axis, got {axes}; "
          "flatten the contracting axes first")
    blocked, _ = _block_reshape(absx, axes[0])
    return jnp.max(blocked, axis=axes[0] + 1)
  # BLOCK_128x128: 128 x 128 tiles of a 2-D operand (weights).
  if x.ndim != 2:
    raise ValueError(f"block_128x128 scaling needs a 2-D operand, got shape {x.shape}")
  blocked, nb0 = _block_reshape(absx, 0)             # (nb0, 128, N)
  blocked, nb1 = _block_reshape(blocked, 2)          # (nb0, 128, nb1, 128)
  return jnp.max(blocked, axis=(1, 3))


def quantize_with_scale(x: jax.Array, scale_expanded: jax.Array, fmt) -> jax.Array:
  """Divides by an already-broadcast scale, saturates to the format range and casts."""
  fmt = formats_lib.get_format(fmt)
  y = x.astype(jnp.float32) / scale_expanded
  y = jnp.clip(y, -fmt.max, fmt.max)  # NaN passes through clip unchanged.
  return y.astype(fmt.dtype)


def quantize(x: jax.Array, fmt, granularity: str = TENSORWISE,
             contracting_axes: Sequence[int] = (), *, power_of_two: bool = False,
             margin: float = 0.0, amax: jax.Array | None = None) -> QTensor:
  """Current scaling (or delayed, when `amax` comes from a history): x -> QTensor."""
  axes = _normalize_axes(contracting_axes, x.ndim) if x.ndim else ()
  if amax is None:
    amax = compute_amax(x, granularity, axes)
  scale = scale_from_amax(amax, fmt, power_of_two=power_of_two, margin=margin)
  shell = QTensor(data=x, scale=scale, granularity=granularity, axis=axes)
  data = quantize_with_scale(x, shell.expanded_scale(), fmt)
  return QTensor(data=data, scale=scale, granularity=granularity, axis=axes)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  return q.dequantize(dtype)


def quantize_dequantize(x: jax.Array, fmt, granularity: str = TENSORWISE,
                        contracting_axes: Sequence[int] = (), **kwargs) -> jax.Array:
  """Round trip in x's dtype: the value a kernel actually multiplies."""
  return quantize(x, fmt, granularity, contracting_axes, **kwargs).dequantize(x.dtype)


def flush_fractions(x: jax.Array, q: QTensor) -> Tuple[jax.Array, jax.Array]:
  """(underflow, saturation): fractions of the nonzero finite entries of `x` that quantize
  to zero, and that were clipped at the format max."""
  fmt_max = float(jnp.finfo(q.data.dtype).max)
  xf = x.astype(jnp.float32)
  finite_nonzero = jnp.isfinite(xf) & (xf != 0)
  count = jnp.maximum(jnp.sum(finite_nonzero), 1)
  scaled = jnp.abs(xf / q.expanded_scale())
  # A code is zero where its dequantized value is (every scale is positive); dequantize keeps
  # the round trip through the 8-bit format where XLA:GPU would simplify a bare cast away.
  flushed = finite_nonzero & (q.dequantize() == 0)
  saturated = finite_nonzero & (scaled > fmt_max)
  return jnp.sum(flushed) / count, jnp.sum(saturated) / count


# --- Delayed scaling: scales from an amax history (the recipe Flax's fp8_ops uses). ---

def init_amax_history(length: int) -> jax.Array:
  if length < 1:
    raise ValueError(f"amax history length must be >= 1, got {length}")
  return jnp.zeros((length,), jnp.float32)


def update_amax_history(history: jax.Array, x: jax.Array) -> jax.Array:
  """Rolls the history and writes the current (finite) amax into slot 0."""
  amax = jnp.max(finite_abs(x))
  return jnp.roll(history, 1).at[0].set(amax)


def delayed_scale(history: jax.Array, fmt, **kwargs) -> jax.Array:
  """The scale for this step from the max of past amaxes (guarded like current scaling)."""
  return scale_from_amax(jnp.max(history), fmt, **kwargs)
