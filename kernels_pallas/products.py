"""Einsum specs -> the GEMM core: layout analysis, per-pass quantization, scale layouts.

A spec runs on the core when its indices form groups that reshape (never transpose) each
operand into (batch, free, contract) or (batch, contract, free) and the output into
(batch, free_lhs, free_rhs) or (batch, free_rhs, free_lhs). That covers the 2-D passes
fwd 'mk,kn->mn', grad_lhs 'mn,kn->mk', grad_rhs 'mk,mn->kn', flattened leading dims
('bnd,dk->bnk') and batched products ('bnd,bdk->bnk' and their passes).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import jax
import jax.numpy as jnp

from kernels_pallas import gemm as gemm_lib
from kernels_pallas import quantize as quantize_lib
from loka_jax.kernels.spec import EinsumSpec
from loka_jax.precision import E4M3
from loka_jax.precision.qtensor import BLOCK, BLOCK_1x128, BLOCK_128x128, ROWWISE


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a spec maps onto the core. `swap`: the rhs supplies the output rows."""
  batch: str
  contract: str
  free_lhs: str
  free_rhs: str
  lhs_contract_first: bool   # lhs stored (batch, contract, free)
  rhs_contract_first: bool   # rhs stored (batch, contract, free)
  swap: bool

  @property
  def a_t(self) -> bool:
    """Row operand stored (K, M)."""
    return self.rhs_contract_first if self.swap else self.lhs_contract_first

  @property
  def b_t(self) -> bool:
    """Column operand stored (N, K)."""
    return not (self.lhs_contract_first if self.swap else self.rhs_contract_first)


def analyze(spec: EinsumSpec) -> Union[Layout, str]:
  """The Layout of a spec, or the reason it does not fit the core."""
  batch = "".join(i for i in spec.lhs if i in spec.rhs and i in spec.out)
  contract = spec.contracting
  free_lhs = "".join(i for i in spec.lhs if i not in spec.rhs)
  free_rhs = "".join(i for i in spec.rhs if i not in spec.lhs)
  if not contract:
    return f"spec {spec} contracts no index (an outer product is not a GEMM)"
  if not free_lhs or not free_rhs:
    return f"spec {spec}: each operand needs a free (output) index for a 2-D tile"
  if not (spec.lhs.startswith(batch) and spec.rhs.startswith(batch)
          and spec.out.startswith(batch)):
    return f"spec {spec}: batch indices {batch!r} must lead every operand and the output"
  c_rhs = "".join(i for i in spec.rhs if i in contract)
  if c_rhs != contract:
    return f"spec {spec}: contracting indices in different orders ({contract!r} vs {c_rhs!r})"
  lhs_rest, rhs_rest, out_rest = (s[len(batch):] for s in (spec.lhs, spec.rhs, spec.out))
  if lhs_rest == free_lhs + contract:
    lhs_cf = False
  elif lhs_rest == contract + free_lhs:
    lhs_cf = True
  else:
    return f"spec {spec}: lhs indices are not two contiguous groups (needs a transpose)"
  if rhs_rest == contract + free_rhs:
    rhs_cf = True
  elif rhs_rest == free_rhs + contract:
    rhs_cf = False
  else:
    return f"spec {spec}: rhs indices are not two contiguous groups (needs a transpose)"
  if out_rest == free_lhs + free_rhs:
    swap = False
  elif out_rest == free_rhs + free_lhs:
    swap = True
  else:
    return f"spec {spec}: output free indices interleave (needs a transpose)"
  return Layout(batch, contract, free_lhs, free_rhs, lhs_cf, rhs_cf, swap)


def _sizes(spec: EinsumSpec, lhs_shape, rhs_shape):
  sizes = dict(zip(spec.lhs, lhs_shape))
  sizes.update(zip(spec.rhs, rhs_shape))
  return sizes


def _prod(sizes, labels):
  return math.prod(sizes[i] for i in labels)


def _operand_3d(x, labels, layout: Layout, sizes, free: str, contract_first: bool):
  bat, c, f = (_prod(sizes, g) for g in (layout.batch, layout.contract, free))
  return x.reshape((bat, c, f) if contract_first else (bat, f, c))


def _contract_axes(labels: str, layout: Layout):
  return tuple(i for i, idx in enumerate(labels) if idx in layout.contract)


def _finish(out, spec, layout, sizes, out_dtype):
  """(batch, rows, cols) -> the spec's output shape."""
  return out.reshape(tuple(sizes[i] for i in spec.out)).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class CoreOperands:
  """A spec's operands quantized e4m3, as 3-D core operands in their stored layouts: `a`
  supplies the output rows, `b` its columns (the operands are swapped where the spec's rhs
  supplies the rows; `layout.a_t`, `layout.b_t` say how each is stored), with their scales:
  rowwise (B, rows) and (B, cols), or per 128-wide K block (B, KB, rows) and (B, KB, cols)."""
  layout: Layout
  sizes: dict
  a: jax.Array
  b: jax.Array
  sa: jax.Array
  sb: jax.Array

  def finish(self, out, spec: EinsumSpec, out_dtype) -> jax.Array:
    """The core's (batch, rows, cols) output in the spec's output shape."""
    return _finish(out, spec, self.layout, self.sizes, out_dtype)


def rowwise_operands(spec: EinsumSpec, a, b, *, kernel_name: str,
                     quantize=quantize_lib.quantize) -> CoreOperands:
  """Both operands e4m3 with one scale per non-contracting index, by `quantize` (the Pallas
  quantize kernel, or `scaling.quantize`, its pure-jnp twin, which XLA fuses with a
  transpose after it)."""
  layout = analyze(spec)
  if isinstance(layout, str):
    raise ValueError(f"{kernel_name}: {layout}")
  sizes = _sizes(spec, a.shape, b.shape)
  qa = quantize(a, E4M3, ROWWISE, _contract_axes(spec.lhs, layout))
  qb = quantize(b, E4M3, ROWWISE, _contract_axes(spec.rhs, layout))
  bat = _prod(sizes, layout.batch)
  da = _operand_3d(qa.data, spec.lhs, layout, sizes, layout.free_lhs, layout.lhs_contract_first)
  db = _operand_3d(qb.data, spec.rhs, layout, sizes, layout.free_rhs, layout.rhs_contract_first)
  sa, sb = qa.scale.reshape((bat, -1)), qb.scale.reshape((bat, -1))
  if layout.swap:
    da, db, sa, sb = db, da, sb, sa
  return CoreOperands(layout, sizes, da, db, sa, sb)


def rowwise_einsum(spec: EinsumSpec, a, b, *, out_dtype, kernel_name: str,
                   config=None) -> jax.Array:
  """Both operands quantized e4m3 with one scale per non-contracting index, then the core."""
  ops = rowwise_operands(spec, a, b, kernel_name=kernel_name)
  out = gemm_lib.gemm(ops.a, ops.b, ops.sa, ops.sb, a_t=ops.layout.a_t, b_t=ops.layout.b_t,
                      scales=gemm_lib.ROWWISE_SCALES, out_dtype=out_dtype, config=config,
                      kernel_name=kernel_name)
  return ops.finish(out, spec, out_dtype)


def _block_operand(x2, contract_first: bool, square: bool, quantize=quantize_lib.quantize):
  """Quantizes a 2-D operand stored (C, F) or (F, C); returns data and (KB, F) scales."""
  c_axis = 0 if contract_first else 1
  if square:
    q = quantize(x2, E4M3, BLOCK_128x128, (c_axis,))
    f_axis = 1 - c_axis
    s = jnp.repeat(q.scale, BLOCK, axis=f_axis)
    s = jax.lax.slice_in_dim(s, 0, x2.shape[f_axis], axis=f_axis)
  else:
    q = quantize(x2, E4M3, BLOCK_1x128, (c_axis,))
    s = q.scale
  return q.data, (s if contract_first else s.T)


def block_operands(spec: EinsumSpec, a, b, *, pass_name: str, kernel_name: str,
                   quantize=quantize_lib.quantize) -> CoreOperands:
  """1x128 blocks along the contraction for activations and gradients; 128x128 for the rhs
  of fwd and grad_lhs (the weight of an act x weight site: one quantization serves both).
  2-D specs only (batch 1)."""
  layout = analyze(spec)
  if isinstance(layout, str):
    raise ValueError(f"{kernel_name}: {layout}")
  if layout.batch:
    raise ValueError(f"{kernel_name}: spec {spec} has batch indices; use a batched kernel")
  sizes = _sizes(spec, a.shape, b.shape)
  square_rhs = pass_name in ("fwd", "grad_lhs")
  a2 = _operand_3d(a, spec.lhs, layout, sizes, layout.free_lhs, layout.lhs_contract_first)[0]
  b2 = _operand_3d(b, spec.rhs, layout, sizes, layout.free_rhs, layout.rhs_contract_first)[0]
  da, sa = _block_operand(a2, layout.lhs_contract_first, square=False, quantize=quantize)
  db, sb = _block_operand(b2, layout.rhs_contract_first, square=square_rhs, quantize=quantize)
  if layout.swap:
    da, db, sa, sb = db, da, sb, sa
  return CoreOperands(layout, sizes, da[None], db[None], sa[None], sb[None])


def blockwise_einsum(spec: EinsumSpec, a, b, *, pass_name: str, out_dtype,
                     kernel_name: str, config=None) -> jax.Array:
  """`block_operands`, then the core with per-K-block scales."""
  ops = block_operands(spec, a, b, pass_name=pass_name, kernel_name=kernel_name)
  out = gemm_lib.gemm(ops.a, ops.b, ops.sa, ops.sb, a_t=ops.layout.a_t, b_t=ops.layout.b_t,
                      scales=gemm_lib.BLOCK_SCALES, out_dtype=out_dtype, config=config,
                      kernel_name=kernel_name)
  return ops.finish(out, spec, out_dtype)


def dequantized_operands(spec: EinsumSpec, a, b, *, mode: str, pass_name: str,
                         quantize=quantize_lib.quantize):
  """The operands a kernel actually multiplies, from its own quantize calls (2-D for
  blockwise): the kernel-correctness reference is their fp32 HIGHEST product."""
  layout = analyze(spec)
  if isinstance(layout, str):
    raise ValueError(layout)
  ca, cb = _contract_axes(spec.lhs, layout), _contract_axes(spec.rhs, layout)
  if mode == "rowwise":
    return (quantize(a, E4M3, ROWWISE, ca).dequantize(),
            quantize(b, E4M3, ROWWISE, cb).dequantize())
  gran_b = BLOCK_128x128 if pass_name in ("fwd", "grad_lhs") else BLOCK_1x128
  return (quantize(a, E4M3, BLOCK_1x128, ca).dequantize(),
          quantize(b, E4M3, gran_b, cb).dequantize())


def unsupported(spec: EinsumSpec, *, batched: Optional[bool]) -> Optional[str]:
  """Why a spec cannot run (batched=True: needs batch indices; False: must have none)."""
  layout = analyze(spec)
  if isinstance(layout, str):
    return layout
  if batched is True and not layout.batch:
    return f"spec {spec} has no batch index (use pallas_fp8_rowwise)"
  if batched is False and layout.batch:
    return f"spec {spec} has batch indices {layout.batch!r} (use pallas_fp8_batched)"
  return None
