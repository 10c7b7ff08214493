"""The epilogue of a Mosaic GPU FP8 tile on its fp32 accumulator, shared by the 1-warpgroup
core (`mosaic_gemm`) and the warp-specialized one (`mosaic_ws`): what follows the pre-norm
value (the scaled product + bias), computed on values in the wgmma accumulator's layout.

A tile is one BlockNorm block when BlockNorm is on and holds whole rows when the output is
quantized; its padded columns are zero (zero codes of B, zero bias), so neither the sum of
squares nor the row amax needs a mask.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import epilogue as epilogue_lib
from kernels_pallas.quantize import finite_abs, saturating_cast, scale_from_amax
from loka_jax.precision import E4M3


def layouts(interpret: bool):
  """(by_rows, by_cols): broadcast a per-row (block_m,) or per-column (block_n,) vector over
  a (block_m, block_n) accumulator tile in its layout (interpret mode knows no layouts)."""
  as_layout = (lambda x, _: x) if interpret else plgpu.layout_cast
  rows = plgpu.Layout.WGMMA.reduce(1)   # one value per accumulator row
  cols = plgpu.Layout.WGMMA.reduce(0)   # one value per accumulator column

  def by_rows(v, shape):
    return lax.broadcast_in_dim(as_layout(v, rows), shape, (0,))

  def by_cols(v, shape):
    return lax.broadcast_in_dim(as_layout(v, cols), shape, (1,))

  return by_rows, by_cols


def after_pre(pre, ep: epilogue_lib.Epilogue, n_left, by_rows):
  """(out, None), or with output quantization (e4m3 codes, one fp32 scale a row), of a
  tile's fp32 pre-norm value: BlockNorm over its columns (`n_left` of them real, the last,
  shorter block dividing by its own width as functional.block_norm does), the activation,
  and each row's scale and codes as quantize.quantize's rowwise ones."""
  y = pre
  if ep.block_size is not None:
    width = jnp.clip(n_left, 1, y.shape[1]).astype(jnp.float32)
    mean_square = jnp.sum(y * y, axis=1) / width
    y = y * lax.broadcast_in_dim(lax.rsqrt(mean_square + ep.eps), y.shape, (0,))
  y = epilogue_lib.activate(y, ep.activation)
  if not ep.quantize_output:
    return y, None
  scale = scale_from_amax(jnp.max(finite_abs(y), axis=1), E4M3.max)
  return saturating_cast(y / by_rows(scale, y.shape), E4M3), scale


def out_types(bt: int, mp: int, np_: int, ep: epilogue_lib.Epilogue, out_dtype, pre_dtype):
  """A kernel's outputs on padded sizes: the result (Bt, Mp, Np), or with output
  quantization its e4m3 codes and one fp32 scale a row (Bt, Mp); then the pre-norm value
  (Bt, Mp, Np) with `ep.emit_pre`."""
  types = [jax.ShapeDtypeStruct((bt, mp, np_), E4M3.dtype if ep.quantize_output else out_dtype)]
  if ep.quantize_output:
    types.append(jax.ShapeDtypeStruct((bt, mp), jnp.float32))
  if ep.emit_pre:
    types.append(jax.ShapeDtypeStruct((bt, mp, np_), pre_dtype))
  return tuple(types)


def out_slices(out_g, scale_g, pre_g, bi, m_slice, n_slice):
  """A tile's slices of the kernel's outputs (None where an output is not emitted)."""
  return (out_g.at[bi, m_slice, n_slice],
          None if scale_g is None else scale_g.at[bi, m_slice],
          None if pre_g is None else pre_g.at[bi, m_slice, n_slice])


def write_tile(pre, ep: epilogue_lib.Epilogue, n_left, by_rows, out_dtype, pre_dtype, smem,
               gmem):
  """Finishes a tile from its fp32 pre-norm value and sends it out: the pre-norm value (with
  `ep.emit_pre`) and `after_pre`'s output (or codes and row scales) into their shared-memory
  tiles `smem` = (out, scale, pre), then by TMA to the global slices `gmem` = (out, scale,
  pre); a tile an epilogue does not emit is None in both."""
  out_smem, scale_smem, pre_smem = smem
  out_g, scale_g, pre_g = gmem
  if ep.emit_pre:
    pre_smem[...] = pre.astype(pre_dtype)
  y, scale = after_pre(pre, ep, n_left, by_rows)
  out_smem[...] = y if ep.quantize_output else y.astype(out_dtype)
  if ep.quantize_output:
    scale_smem[...] = scale
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_g)
  if ep.quantize_output:
    plgpu.copy_smem_to_gmem(scale_smem, scale_g)
  if ep.emit_pre:
    plgpu.copy_smem_to_gmem(pre_smem, pre_g)
  plgpu.wait_smem_to_gmem(0)
