"""Fused FP8 quantize: amax + scale + saturating cast in Pallas, emitting a QTensor.

Same convention as `loka_jax.precision.quantize` (its pure-jnp reference): dequantization
scale = amax / fmt.max with amax over finite values, amax = 0 gives scale 1, values saturate
at +-fmt.max, NaN stays NaN. Every tensor is viewed as (P, R, C) with the contracting axes
either C ("last") or R ("middle"); P goes on the grid.

Triton's float min/max drop NaN (maxnumf), so NaN is carried past the clip explicitly.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import compat
from loka_jax.precision import formats as formats_lib
from loka_jax.precision import scaling
from loka_jax.precision.qtensor import (BLOCK, BLOCK_1x128, BLOCK_128x128, GRANULARITIES,
                                        ROWWISE, TENSORWISE, QTensor)

_F32_MAX = float(jnp.finfo(jnp.float32).max)
_TINY = float(jnp.finfo(jnp.float32).tiny)
_TENSORWISE_PROGRAMS = 256  # phase-1 partial amaxes; phase 2 reads them all (a power of 2)


# --- In-kernel helpers (also used by the GEMM epilogue). ---

def finite_abs(x):
  """|x| with NaN and +-Inf replaced by 0 (`<= max` is False for both)."""
  ax = jnp.abs(x)
  return jnp.where(ax <= _F32_MAX, ax, 0.0)


def scale_from_amax(amax, fmt_max: float):
  """Dequantization scale from a finite amax; 1 where amax is 0."""
  scale = jnp.maximum(amax / fmt_max, _TINY)
  return jnp.where(amax > 0, scale, 1.0)


def saturating_cast(y, fmt):
  """Clips to +-fmt.max (keeping NaN, which Triton's min/max would drop) and casts."""
  clipped = jnp.minimum(jnp.maximum(y, -fmt.max), fmt.max)
  return jnp.where(y != y, y, clipped).astype(fmt.dtype)


def _mask2(rows, cols, nrows, ncols):
  return (rows < nrows)[:, None] & (cols < ncols)[None, :]


def load_tile(x_ref, i, j, *, br, bc, R, C):
  """(tile, mask): the (br, bc) tile (i, j) of an (R, C) ref in float32, 0 outside the
  tensor, and the mask of its in-bounds elements (for the stores)."""
  mask = _mask2(i * br + jnp.arange(br), j * bc + jnp.arange(bc), R, C)
  x = compat.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], mask=mask, other=0.0)
  return x.astype(jnp.float32), mask


# --- Layout: any tensor + contracting axes -> (P, R, C) and back. ---

def pcr_view(shape: Sequence[int], axes: Tuple[int, ...]):
  """(P, R, C, contract) with contract 'C' or 'R'; None when the axes are not contiguous."""
  ndim = len(shape)
  if not axes or list(axes) != list(range(axes[0], axes[-1] + 1)):
    return None
  lo, hi = axes[0], axes[-1] + 1
  if hi == ndim:
    return 1, math.prod(shape[:lo]), math.prod(shape[lo:]), "C"
  return math.prod(shape[:lo]), math.prod(shape[lo:hi]), math.prod(shape[hi:]), "R"


# --- Kernels. ---

def _rowwise_last_kernel(x_ref, q_ref, s_ref, *, R, C, br, bc, fmt):
  """Scale per row of an (R, C) slab: two sweeps over C (amax, then cast)."""
  i = pl.program_id(1)
  rows = i * br + jnp.arange(br)
  nchunks = pl.cdiv(C, bc)

  def tile(c):
    cols = c * bc + jnp.arange(bc)
    mask = _mask2(rows, cols, R, C)
    ref = x_ref.at[pl.ds(i * br, br), pl.ds(c * bc, bc)]
    return ref, mask

  def amax_body(c, amax):
    ref, mask = tile(c)
    x = compat.load(ref, mask=mask, other=0.0).astype(jnp.float32)
    return jnp.maximum(amax, jnp.max(finite_abs(x), axis=1))

  amax = lax.fori_loop(0, nchunks, amax_body, jnp.zeros((br,), jnp.float32))
  scale = scale_from_amax(amax, fmt.max)

  def cast_body(c, carry):
    ref, mask = tile(c)
    x = compat.load(ref, mask=mask, other=0.0).astype(jnp.float32)
    q = saturating_cast(x / scale[:, None], fmt)
    compat.store(q_ref.at[pl.ds(i * br, br), pl.ds(c * bc, bc)], q, mask=mask)
    return carry

  lax.fori_loop(0, nchunks, cast_body, 0)
  compat.store(s_ref.at[pl.ds(i * br, br)], scale, mask=rows < R)


def _rowwise_middle_kernel(x_ref, q_ref, s_ref, *, R, C, br, bc, fmt):
  """Scale per column of an (R, C) slab (contracting axis R): two sweeps over R."""
  j = pl.program_id(1)
  cols = j * bc + jnp.arange(bc)
  nchunks = pl.cdiv(R, br)

  def tile(r):
    rows = r * br + jnp.arange(br)
    return x_ref.at[pl.ds(r * br, br), pl.ds(j * bc, bc)], _mask2(rows, cols, R, C)

  def amax_body(r, amax):
    ref, mask = tile(r)
    x = compat.load(ref, mask=mask, other=0.0).astype(jnp.float32)
    return jnp.maximum(amax, jnp.max(finite_abs(x), axis=0))

  amax = lax.fori_loop(0, nchunks, amax_body, jnp.zeros((bc,), jnp.float32))
  scale = scale_from_amax(amax, fmt.max)

  def cast_body(r, carry):
    ref, mask = tile(r)
    x = compat.load(ref, mask=mask, other=0.0).astype(jnp.float32)
    q = saturating_cast(x / scale[None, :], fmt)
    compat.store(q_ref.at[pl.ds(r * br, br), pl.ds(j * bc, bc)], q, mask=mask)
    return carry

  lax.fori_loop(0, nchunks, cast_body, 0)
  compat.store(s_ref.at[pl.ds(j * bc, bc)], scale, mask=cols < C)


def _column_amax_kernel(x_ref, p_ref, *, R, C, br, bc, groups):
  """Phase 1 of column scales on tall slabs: group g reduces row tiles g, g + groups, ...
  of one column tile, so a (123200, 1024) weight spreads over groups x C/bc programs."""
  g, j = pl.program_id(1), pl.program_id(2)
  cols = j * bc + jnp.arange(bc)
  per_group = pl.cdiv(pl.cdiv(R, br), groups)

  def body(t, amax):
    r = g + t * groups
    rows = r * br + jnp.arange(br)
    x = compat.load(x_ref.at[pl.ds(r * br, br), pl.ds(j * bc, bc)],
                    mask=_mask2(rows, cols, R, C), other=0.0).astype(jnp.float32)
    return jnp.maximum(amax, jnp.max(finite_abs(x), axis=0))

  amax = lax.fori_loop(0, per_group, body, jnp.zeros((bc,), jnp.float32))
  compat.store(p_ref.at[g, pl.ds(j * bc, bc)], amax, mask=cols < C)


def _column_cast_kernel(x_ref, p_ref, q_ref, s_ref, *, R, C, br, bc, groups, fmt):
  """Phase 2: every program reduces its columns' partials, then casts one (br, bc) tile."""
  i, j = pl.program_id(1), pl.program_id(2)
  rows = i * br + jnp.arange(br)
  cols = j * bc + jnp.arange(bc)
  partial = compat.load(p_ref.at[pl.ds(0, groups), pl.ds(j * bc, bc)],
                        mask=(cols < C)[None, :], other=0.0)
  scale = scale_from_amax(jnp.max(partial, axis=0), fmt.max)
  mask = _mask2(rows, cols, R, C)
  x = compat.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], mask=mask,
                  other=0.0).astype(jnp.float32)
  compat.store(q_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)],
               saturating_cast(x / scale[None, :], fmt), mask=mask)
  # Every row tile writes the same scales; choosing one would need a branch.
  compat.store(s_ref.at[pl.ds(j * bc, bc)], scale, mask=cols < C)


def _block_kernel(x_ref, q_ref, s_ref, *, R, C, br, bc, fmt, reduce_axis):
  """One (br, bc) tile per program; amax over `reduce_axis` of the tile (None: whole tile)."""
  i, j = pl.program_id(1), pl.program_id(2)
  rows = i * br + jnp.arange(br)
  cols = j * bc + jnp.arange(bc)
  x, mask = load_tile(x_ref, i, j, br=br, bc=bc, R=R, C=C)
  ax = finite_abs(x)
  if reduce_axis is None:
    scale = scale_from_amax(jnp.max(ax), fmt.max)
    q = saturating_cast(x / scale, fmt)
  elif reduce_axis == 1:
    scale = scale_from_amax(jnp.max(ax, axis=1), fmt.max)
    q = saturating_cast(x / scale[:, None], fmt)
  else:
    scale = scale_from_amax(jnp.max(ax, axis=0), fmt.max)
    q = saturating_cast(x / scale[None, :], fmt)
  compat.store(q_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], q, mask=mask)
  if reduce_axis is None:
    s_ref[i, j] = scale
  elif reduce_axis == 1:   # 1x128 blocks along C: one scale per (row, column block j)
    compat.store(s_ref.at[pl.ds(i * br, br), j], scale, mask=rows < R)
  else:                    # 128x1 blocks along R: one scale per (row block i, column)
    compat.store(s_ref.at[i, pl.ds(j * bc, bc)], scale, mask=cols < C)


def _amax_partial_kernel(x_ref, p_ref, *, rows, C, br, bc, programs):
  """Phase 1 of tensorwise: program g reduces the row tiles g, g + programs, ..."""
  g = pl.program_id(0)
  ntiles_r = pl.cdiv(rows, br)
  ntiles_c = pl.cdiv(C, bc)
  per_program = pl.cdiv(ntiles_r, programs)

  def body(t, amax):
    r = g + t * programs
    row_ids = r * br + jnp.arange(br)

    def col_body(c, amax):
      cols = c * bc + jnp.arange(bc)
      mask = _mask2(row_ids, cols, rows, C)
      x = compat.load(x_ref.at[pl.ds(r * br, br), pl.ds(c * bc, bc)], mask=mask,
                      other=0.0).astype(jnp.float32)
      return jnp.maximum(amax, jnp.max(finite_abs(x)))

    return lax.fori_loop(0, ntiles_c, col_body, amax)

  amax = lax.fori_loop(0, per_program, body, jnp.zeros((), jnp.float32))
  p_ref[g] = amax


def _tensorwise_cast_kernel(x_ref, p_ref, q_ref, s_ref, *, rows, C, br, bc, programs, fmt):
  """Phase 2 of tensorwise: every program reduces the partials itself, then casts a tile."""
  i, j = pl.program_id(0), pl.program_id(1)
  amax = jnp.max(p_ref[...])
  scale = scale_from_amax(amax, fmt.max)
  row_ids = i * br + jnp.arange(br)
  cols = j * bc + jnp.arange(bc)
  mask = _mask2(row_ids, cols, rows, C)
  x = compat.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], mask=mask,
                  other=0.0).astype(jnp.float32)
  compat.store(q_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)],
               saturating_cast(x / scale, fmt), mask=mask)
  # Every program writes the same value; program (0, 0) alone would need a branch.
  s_ref[0] = scale


# --- Wrappers. ---

def _slab_spec(shape2):
  """BlockSpec of one (R, C) slab of a (P, R, C) array, P squeezed onto grid axis 0."""
  return pl.BlockSpec((None,) + tuple(shape2), lambda p, *_: (p, 0, 0))


def _call(kernel, out_shape, grid, in_specs, out_specs, num_warps, name):
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      compiler_params=compat.compiler_params(num_warps=num_warps, num_stages=1),
      interpret=compat.use_interpret(), name=name)


_MIN_PROGRAMS = 128  # enough programs to spread a quantize over the SMs


def _prev_pow2(n: int) -> int:
  return 1 << (max(1, int(n)).bit_length() - 1)


def _tile_sizes(R, C, contract):
  """Power-of-two tiles of at most 16K elements, wide along the memory-contiguous axis C;
  for row scales, short enough that the row tiles alone make _MIN_PROGRAMS programs."""
  bc = min(1024, compat.next_pow2(C))
  br = max(1, min(compat.next_pow2(R), 16384 // bc))
  if contract == "C":
    br = max(1, min(br, _prev_pow2(R // _MIN_PROGRAMS)))
  else:  # the reduction runs along rows: keep column tiles narrower
    bc = min(bc, 256)
    br = max(1, min(compat.next_pow2(R), 16384 // bc))
  return br, bc


_TALL_ROWS = 8192  # column scales over more rows than this use two phases, and so do
# slabs whose column tiles alone would leave most SMs idle (e.g. a 1024 x 1024 weight)


def _rowwise_tall(x3, fmt):
  """Column scales of tall slabs (weights of large K) in two parallel phases."""
  P, R, C = x3.shape
  bc = min(128, compat.next_pow2(C))
  br = 64
  groups = min(64, compat.next_pow2(pl.cdiv(R, br)))
  nc, nr = pl.cdiv(C, bc), pl.cdiv(R, br)
  partials = _call(
      functools.partial(_column_amax_kernel, R=R, C=C, br=br, bc=bc, groups=groups),
      jax.ShapeDtypeStruct((P, groups, C), jnp.float32), (P, groups, nc),
      [_slab_spec((R, C))], _slab_spec((groups, C)), num_warps=4,
      name="loka_quantize_colwise_amax")(x3)
  return _call(
      functools.partial(_column_cast_kernel, R=R, C=C, br=br, bc=bc, groups=groups, fmt=fmt),
      (jax.ShapeDtypeStruct(x3.shape, fmt.dtype), jax.ShapeDtypeStruct((P, C), jnp.float32)),
      (P, nr, nc), [_slab_spec((R, C)), _slab_spec((groups, C))],
      (_slab_spec((R, C)), pl.BlockSpec((None, C), lambda p, *_: (p, 0))), num_warps=4,
      name="loka_quantize_colwise_cast")(x3, partials)


def _rowwise(x3, contract, fmt):
  P, R, C = x3.shape
  br, bc = _tile_sizes(R, C, contract)
  if contract == "R" and (R > _TALL_ROWS or (
      P * pl.cdiv(C, bc) < _MIN_PROGRAMS // 2 and R > 128)):
    return _rowwise_tall(x3, fmt)
  if contract == "C":
    kernel = functools.partial(_rowwise_last_kernel, R=R, C=C, br=br, bc=bc, fmt=fmt)
    grid = (P, pl.cdiv(R, br))
    s_shape, s_block = (P, R), pl.BlockSpec((None, R), lambda p, i: (p, 0))
  else:
    kernel = functools.partial(_rowwise_middle_kernel, R=R, C=C, br=br, bc=bc, fmt=fmt)
    grid = (P, pl.cdiv(C, bc))
    s_shape, s_block = (P, C), pl.BlockSpec((None, C), lambda p, j: (p, 0))
  q, s = _call(kernel, (jax.ShapeDtypeStruct(x3.shape, fmt.dtype),
                        jax.ShapeDtypeStruct(s_shape, jnp.float32)),
               grid, [_slab_spec((R, C))], (_slab_spec((R, C)), s_block),
               num_warps=4, name=f"loka_quantize_rowwise_{contract}")(x3)
  return q, s


def _blockwise(x3, contract, fmt, square: bool):
  P, R, C = x3.shape
  if square:
    br = bc = BLOCK
    reduce_axis = None
  elif contract == "C":
    bc, reduce_axis = BLOCK, 1
    br = min(64, compat.next_pow2(R))
  else:
    br, reduce_axis = BLOCK, 0
    bc = min(64, compat.next_pow2(C))
  nr, nc = pl.cdiv(R, br), pl.cdiv(C, bc)
  if square:
    s_shape = (P, nr, nc)
  elif contract == "C":
    s_shape = (P, R, nc)
  else:
    s_shape = (P, nr, C)
  kernel = functools.partial(_block_kernel, R=R, C=C, br=br, bc=bc, fmt=fmt,
                             reduce_axis=reduce_axis)
  return _call(kernel, (jax.ShapeDtypeStruct(x3.shape, fmt.dtype),
                        jax.ShapeDtypeStruct(s_shape, jnp.float32)),
               (P, nr, nc), [_slab_spec((R, C))], (_slab_spec((R, C)), _slab_spec(s_shape[1:])),
               num_warps=4, name="loka_quantize_block")(x3)


def _tensorwise(x2, fmt):
  rows, C = x2.shape
  br, bc = _tile_sizes(rows, C, "C")
  programs = min(_TENSORWISE_PROGRAMS, compat.next_pow2(pl.cdiv(rows, br)))
  full = pl.BlockSpec(x2.shape, lambda *_: (0, 0))
  partials = _call(
      functools.partial(_amax_partial_kernel, rows=rows, C=C, br=br, bc=bc, programs=programs),
      jax.ShapeDtypeStruct((programs,), jnp.float32), (programs,), [full],
      pl.BlockSpec((programs,), lambda g: (0,)), num_warps=4,
      name="loka_quantize_tensorwise_amax")(x2)
  q, s = _call(
      functools.partial(_tensorwise_cast_kernel, rows=rows, C=C, br=br, bc=bc,
                        programs=programs, fmt=fmt),
      (jax.ShapeDtypeStruct(x2.shape, fmt.dtype), jax.ShapeDtypeStruct((1,), jnp.float32)),
      (pl.cdiv(rows, br), pl.cdiv(C, bc)),
      [full, pl.BlockSpec((programs,), lambda i, j: (0,))],
      (full, pl.BlockSpec((1,), lambda i, j: (0,))), num_warps=4,
      name="loka_quantize_tensorwise_cast")(x2, partials)
  return q, s


def quantize(x: jax.Array, fmt="e4m3", granularity: str = ROWWISE,
             contracting_axes: Sequence[int] = ()) -> QTensor:
  """Pallas twin of `loka_jax.precision.quantize` (current scaling): x -> QTensor.

  Rowwise and 1x128 need the contracting axes to be contiguous (e.g. (1,) of (M, K), (2,)
  of (B, n, d), (1,) of (B, d, k)); 1x128 needs exactly one; 128x128 needs a 2-D operand.
  """
  fmt = formats_lib.get_format(fmt)
  if granularity not in GRANULARITIES:
    raise ValueError(f"unknown granularity {granularity!r}; known: {GRANULARITIES}")
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize < 2:
    raise ValueError(f"quantize: input dtype must be bf16/f16/f32, got {x.dtype}")
  if x.ndim == 0 or x.size == 0:
    raise ValueError(f"quantize: needs a non-empty array with at least one axis, got {x.shape}")
  axes = tuple(sorted(a % x.ndim for a in contracting_axes))
  shape = x.shape
  if granularity == TENSORWISE:
    x2 = x.reshape((-1, shape[-1]))
    q, s = _tensorwise(x2, fmt)
    return QTensor(q.reshape(shape), s.reshape((1,) * x.ndim), TENSORWISE, axes)
  if granularity == BLOCK_128x128:
    if x.ndim != 2:
      raise ValueError(f"block_128x128 quantize needs a 2-D operand, got shape {shape}")
    q, s = _blockwise(x[None], "C", fmt, square=True)
    return QTensor(q[0], s[0], BLOCK_128x128, axes)
  view = pcr_view(shape, axes)
  if view is None:
    raise ValueError(
        f"{granularity} quantize of shape {shape}: contracting axes {axes} must be one "
        "contiguous, non-empty group of axes (reshape the operand first)")
  P, R, C, contract = view
  x3 = x.reshape((P, R, C))
  if granularity == ROWWISE:
    q, s = _rowwise(x3, contract, fmt)
    s_shape = tuple(1 if a in axes else n for a, n in enumerate(shape))
    return QTensor(q.reshape(shape), s.reshape(s_shape), ROWWISE, axes)
  if len(axes) != 1:
    raise ValueError(f"block_1x128 quantize needs exactly one contracting axis, got {axes}")
  q, s = _blockwise(x3, contract, fmt, square=False)
  s_shape = tuple(pl.cdiv(n, BLOCK) if a == axes[0] else n for a, n in enumerate(shape))
  return QTensor(q.reshape(shape), s.reshape(s_shape), BLOCK_1x128, axes)


def quantize_reference(x: jax.Array, fmt="e4m3", granularity: str = ROWWISE,
                       contracting_axes: Sequence[int] = ()) -> QTensor:
  """The pure-jnp reference: the library's own current-scaling quantize."""
  return scaling.quantize(x, fmt, granularity, contracting_axes)
