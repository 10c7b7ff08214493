"""Delayed-scaling FP8 quantize in one pass: amax, saturating cast and the transposed copy.

Delayed scaling casts a tensor with a scale known *before* the tensor is read (from the amax
history of earlier steps), and only records the tensor's own amax for later steps. The cast
and the amax therefore read the same input independently, and one kernel can do both in a
single read. XLA does not fuse them: in the profiled steps the amax reductions run as kernels
of their own (on an H200: Wukong `large`, 16 ms of reductions a step; 8192x2048x8 with
current scaling, +470 us of reductions and +231 us of FP8 transposes).

`quantize_delayed(x2, scale, fmt, row_major=..., transposed=...)` reads a 2-D tensor once and
writes any of: its e4m3/e5m2 cast in the same layout, the cast transposed (the contraction-
major "TN" layout that Hopper's FP8 GEMMs read, so XLA inserts no transpose of its own), and
one amax partial per tile, reduced to the tensor's amax by a tiny XLA max.

Conventions are the library's (`loka_jax.precision.scaling`): `scale` is the dequantization
scale (x ~= q * scale); values saturate at +-fmt.max; NaN stays NaN; the amax is taken over
finite values (Flax's `compute_amax_history` lets a NaN into the history, which then freezes
the scale for a whole history length: the NaN guard of the training loop sees the NaN in the
loss instead). The cast divides in float32 by the float32 scale; Flax's `quantize` divides in
the compute dtype, by the scale rounded to it.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import compat
from kernels_pallas.quantize import finite_abs, load_tile, saturating_cast
from loka_jax.precision import formats as formats_lib
from loka_jax.precision import scaling

# Tiles of 64 x 128 (16K elements, 32 KB of bf16) keep a wide layer's quantize at thousands of
# programs (8192 x 2048: 2,048) while each program still moves whole cache lines; a
# transposed copy uses square 64 x 64 tiles, so both stores are 128-byte rows of FP8.
_BLOCK = (64, 128)
_BLOCK_TRANSPOSED = (64, 64)


def _delayed_kernel(x_ref, s_ref, *refs, R, C, br, bc, fmt, row_major, transposed):
  """One (br, bc) tile per program: cast with the given scale, store it (and/or its
  transpose), and write the tile's finite amax."""
  refs = list(refs)
  q_ref = refs.pop(0) if row_major else None
  qt_ref = refs.pop(0) if transposed else None
  (a_ref,) = refs
  i, j = pl.program_id(0), pl.program_id(1)
  x, mask = load_tile(x_ref, i, j, br=br, bc=bc, R=R, C=C)
  q = saturating_cast(x / s_ref[0], fmt)
  if row_major:
    compat.store(q_ref.at[pl.ds(i * br, br), pl.ds(j * bc, bc)], q, mask=mask)
  if transposed:
    compat.store(qt_ref.at[pl.ds(j * bc, bc), pl.ds(i * br, br)], q.T, mask=mask.T)
  a_ref[i, j] = jnp.max(finite_abs(x))


def check_operand(x2: jax.Array, scale: jax.Array) -> None:
  if x2.ndim != 2 or x2.size == 0:
    raise ValueError(f"quantize_delayed: needs a non-empty 2-D tensor, got shape {x2.shape}")
  if not jnp.issubdtype(x2.dtype, jnp.floating) or x2.dtype.itemsize < 2:
    raise ValueError(f"quantize_delayed: input dtype must be bf16/f16/f32, got {x2.dtype}")
  if scale.size != 1 or not jnp.issubdtype(scale.dtype, jnp.floating):
    raise ValueError(f"quantize_delayed: scale must be one float, got {scale.dtype}"
                     f"{tuple(scale.shape)}")


def quantize_delayed(x2: jax.Array, scale: jax.Array, fmt="e4m3", *, row_major: bool = True,
                     transposed: bool = False, block: Optional[Tuple[int, int]] = None):
  """(q or None, q transposed or None, amax): `x2` cast with the dequantization `scale` in one
  read, and its finite amax for the next scale.

  Args:
    x2: (R, C) tensor (bf16, f16 or f32).
    scale: dequantization scale, one float (shape () or (1,)).
    fmt: 'e4m3' or 'e5m2' (or a formats.Format).
    row_major: write the cast in `x2`'s own (R, C) layout.
    transposed: write the cast transposed, (C, R).
    block: (rows, cols) tile, powers of two; the default suits the GPU (tests use small ones
      to put several tiles and ragged edges in a small tensor).
  """
  fmt = formats_lib.get_format(fmt)
  check_operand(x2, scale)
  if not (row_major or transposed):
    raise ValueError("quantize_delayed: asks for neither layout (row_major or transposed)")
  R, C = x2.shape
  br, bc = block or (_BLOCK_TRANSPOSED if transposed else _BLOCK)
  if br & (br - 1) or bc & (bc - 1):
    raise ValueError(f"quantize_delayed: tile {br}x{bc} must be powers of two")
  br, bc = min(br, compat.next_pow2(R)), min(bc, compat.next_pow2(C))
  grid = (pl.cdiv(R, br), pl.cdiv(C, bc))
  full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  out_shape = ([jax.ShapeDtypeStruct((R, C), fmt.dtype)] if row_major else []) + (
      [jax.ShapeDtypeStruct((C, R), fmt.dtype)] if transposed else []) + [
      jax.ShapeDtypeStruct(grid, jnp.float32)]
  kernel = functools.partial(_delayed_kernel, R=R, C=C, br=br, bc=bc, fmt=fmt,
                             row_major=row_major, transposed=transposed)
  outs = pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=grid,
      in_specs=[full((R, C)), full((1,))],
      out_specs=tuple(full(s.shape) for s in out_shape),
      compiler_params=compat.compiler_params(num_warps=4, num_stages=1),
      interpret=compat.use_interpret(),
      name=f"loka_quantize_delayed_{'t' if transposed else ''}{'r' if row_major else ''}",
  )(x2, scale.reshape((1,)).astype(jnp.float32))
  outs = list(outs)
  q = outs.pop(0) if row_major else None
  q_t = outs.pop(0) if transposed else None
  return q, q_t, jnp.max(outs[0])


def quantize_delayed_reference(x2: jax.Array, scale: jax.Array, fmt="e4m3", *,
                               row_major: bool = True, transposed: bool = False):
  """The pure-jnp twin of `quantize_delayed`: the library's own cast and finite amax."""
  q = scaling.quantize_with_scale(x2, scale.reshape(()).astype(jnp.float32), fmt)
  amax = jnp.max(scaling.finite_abs(x2.astype(jnp.float32)))
  return (q if row_major else None), (q.T if transposed else None), amax
