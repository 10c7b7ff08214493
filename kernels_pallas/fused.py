"""Fused dense layer: quantize -> FP8 GEMM -> bias -> BlockNorm -> activation (-> quantize).

The GEMM and its epilogue run as one Pallas kernel on either core: Triton (`gemm`) or
Mosaic GPU (`mosaic_gemm`, Hopper only).

`fused_dense` is the functional API Mods layers call; `fused_dense_reference` computes the
same function unfused in pure jnp (fp32 HIGHEST product of the dequantized operands). The
fused op has a custom_vjp: backward recomputes BlockNorm/activation from the saved pre-norm
value in jnp and runs dgrad and wgrad with a registered per-pass kernel (Pallas rowwise FP8
by default), treating quantization as straight-through, so the layer trains.

Output quantization (a rowwise e4m3 QTensor for the next layer) and QTensor inputs are
forward-only (inference, or the first half of a chain whose backward is owned elsewhere):
a QTensor carries no float gradient, so differentiating through one raises.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import epilogue as epilogue_lib
from kernels_pallas import gemm as gemm_lib
from kernels_pallas import mosaic_gemm
from kernels_pallas import quantize as quantize_lib
from loka_jax.kernels import registry
from loka_jax.kernels.spec import EinsumSpec
from loka_jax.mods import functional
from loka_jax.precision import E4M3, ROWWISE, TENSORWISE, QTensor
from loka_jax.precision import scaling

_FWD = EinsumSpec.parse("mk,kn->mn")
TRITON = "triton"          # kernels_pallas.gemm: Pallas' Triton backend
MOSAIC_GPU = "mosaic_gpu"  # kernels_pallas.mosaic_gemm: Pallas' Mosaic GPU backend (Hopper)
CORES = (TRITON, MOSAIC_GPU)


def _epilogue(bias, block_size, activation, quantize_output, eps, emit_pre=False):
  return epilogue_lib.Epilogue(bias=bias is not None, block_size=block_size, eps=eps,
                               activation=activation, quantize_output=quantize_output,
                               emit_pre=emit_pre)


def _check(x, w, bias, core=TRITON, ep=None):
  if core not in CORES:
    raise ValueError(f"fused_dense: unknown core {core!r}; use one of {', '.join(CORES)}")
  if core == MOSAIC_GPU and ep is not None:
    reason = mosaic_gemm.unsupported_epilogue(ep, w.shape[-1] if w.ndim == 2 else None)
    if reason:
      raise ValueError(f"fused_dense on the mosaic_gpu core: {reason}; use core='triton'")
  k = x.shape[-1]
  if w.ndim != 2 or w.shape[0] != k:
    raise ValueError(f"fused_dense: weight must be (K={k}, N), got {w.shape}")
  if bias is not None and bias.shape != (w.shape[1],):
    raise ValueError(f"fused_dense: bias must be ({w.shape[1]},), got {bias.shape}")


def _x_operand(x, quantize=quantize_lib.quantize):
  """(data (1, M, K), row scales (1, M)) from an array or a rowwise/tensorwise QTensor."""
  if isinstance(x, QTensor):
    if x.data.dtype != E4M3.dtype:
      raise ValueError(f"fused_dense: QTensor input must hold e4m3 data, got {x.data.dtype}")
    if x.granularity == ROWWISE:
      x.check_axis((x.data.ndim - 1,), "fused_dense input")
    elif x.granularity != TENSORWISE:
      raise ValueError(f"fused_dense: QTensor input must be rowwise (over the last axis) or "
                       f"tensorwise, got {x.granularity}; dequantize it first")
    data = x.data.reshape((1, -1, x.data.shape[-1]))
    scale = jnp.broadcast_to(x.scale, x.data.shape[:-1] + (1,)).reshape((1, -1))
    return data, scale
  q = quantize(x.reshape((-1, x.shape[-1])), E4M3, ROWWISE, (1,))
  return q.data[None], q.scale.reshape((1, -1))


def _forward(x, w, bias, ep, out_dtype, pre_dtype, core=TRITON):
  lead = x.shape[:-1]
  quantize = mosaic_gemm.QUANTIZE if core == MOSAIC_GPU else quantize_lib.quantize
  xd, xs = _x_operand(x, quantize)
  qw = quantize(w, E4M3, ROWWISE, (0,))
  if core == MOSAIC_GPU:  # wgmma's 8-bit operands are K-major: the weight's codes as (N, K)
    outs = mosaic_gemm.gemm(xd, qw.data.T[None], xs, qw.scale.reshape((1, -1)), epilogue=ep,
                            bias=bias, out_dtype=out_dtype, pre_dtype=pre_dtype,
                            kernel_name="pallas_mosaic_fp8_rowwise_fused")
  else:
    outs = gemm_lib.gemm(xd, qw.data[None], xs, qw.scale.reshape((1, -1)), epilogue=ep,
                         bias=bias, out_dtype=out_dtype, pre_dtype=pre_dtype,
                         kernel_name="pallas_fp8_rowwise_fused")
  n = w.shape[1]
  outs = outs if isinstance(outs, tuple) else (outs,)
  if ep.quantize_output:
    q, qs = outs[0].reshape(lead + (n,)), outs[1].reshape(lead + (1,))
    result = QTensor(q, qs, ROWWISE, (len(lead),))
    rest = outs[2:]
  else:
    result = outs[0].reshape(lead + (n,))
    rest = outs[1:]
  pre = rest[0].reshape(lead + (n,)) if ep.emit_pre else None
  return result, pre


def _post(pre, block_size, activation, eps):
  """The jnp tail of the epilogue (BlockNorm + activation), differentiated in backward."""
  y = pre.astype(jnp.float32)
  if block_size is not None:
    y = functional.block_norm(y, block_size, eps)
  return functional.activation(activation)(y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _trainable(x, w, bias, block_size, activation, out_dtype, backward, eps, core):
  ep = _epilogue(bias, block_size, activation, False, eps)
  return _forward(x, w, bias, ep, out_dtype, x.dtype, core)[0]


def _trainable_fwd(x, w, bias, block_size, activation, out_dtype, backward, eps, core):
  ep = _epilogue(bias, block_size, activation, False, eps, emit_pre=True)
  out, pre = _forward(x, w, bias, ep, out_dtype, x.dtype, core)
  # Residuals in the compute dtype (x's): the operands and the pre-norm value.
  return out, (x, w, pre, bias is not None)


def _trainable_bwd(block_size, activation, out_dtype, backward, eps, core, res, dy):
  x, w, pre, has_bias = res
  _, post_vjp = jax.vjp(lambda p: _post(p, block_size, activation, eps),
                        pre.astype(jnp.float32))
  (dz,) = post_vjp(dy.astype(jnp.float32))
  dz = dz.astype(x.dtype)
  lead = x.shape[:-1]
  x2 = x.reshape((-1, x.shape[-1]))
  dz2 = dz.reshape((-1, w.shape[1]))
  kernel = registry.get(backward)
  dx = kernel.einsum(_FWD.for_pass("grad_lhs"), dz2, w.astype(x.dtype), pass_name="grad_lhs",
                     out_dtype=x.dtype)
  dw = kernel.einsum(_FWD.for_pass("grad_rhs"), x2, dz2, pass_name="grad_rhs",
                     out_dtype=w.dtype)
  db = jnp.sum(dz2.astype(jnp.float32), axis=0) if has_bias else None
  return dx.reshape(lead + (x.shape[-1],)), dw, db


_trainable.defvjp(_trainable_fwd, _trainable_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _forward_only(x, w, bias, ep, out_dtype, core):
  return _forward(x, w, bias, ep, out_dtype, jnp.float32, core)[0]


def _forward_only_fwd(x, w, bias, ep, out_dtype, core):
  raise ValueError(
      "fused_dense with quantize_output=True or a QTensor input is forward-only (a QTensor "
      "carries no float gradient); train with quantize_output=False and array inputs")


_forward_only.defvjp(_forward_only_fwd, lambda *args: None)


def fused_dense(x: Union[jax.Array, QTensor], w: jax.Array, *, bias: Optional[jax.Array] = None,
                block_size: Optional[int] = None, activation: str = "identity",
                quantize_output: bool = False, out_dtype=jnp.bfloat16,
                backward: str = "pallas_fp8_rowwise",
                eps: float = functional.DEFAULT_EPS,
                core: str = TRITON) -> Union[jax.Array, QTensor]:
  """act(block_norm(x @ w + bias)) with e4m3 rowwise operands in one Pallas kernel.

  Args:
    x: (..., K) activations, or a QTensor (e4m3, rowwise over the last axis or tensorwise),
      e.g. the output of a previous fused_dense(quantize_output=True).
    w: (K, N) weight, quantized per output column.
    bias: optional (N,) bias, added before BlockNorm.
    block_size: BlockNorm block (a power of two in [16, 1024]) or None for no norm.
    activation: 'identity', 'relu' or 'hard_swish'.
    quantize_output: return a rowwise e4m3 QTensor (scales over the last axis) for the next
      layer instead of an out_dtype array (forward-only; the Triton core holds rows of up to
      gemm.MAX_FULL_ROW columns, the Mosaic GPU core see `core`).
    out_dtype: dtype of the array output.
    backward: registered per-pass kernel for dgrad and wgrad in the custom_vjp.
    eps: BlockNorm epsilon.
    core: the GEMM kernel: 'triton' (`kernels_pallas.gemm`) or 'mosaic_gpu'
      (`kernels_pallas.mosaic_gemm`: Hopper FP8 wgmma; BlockNorm blocks of 64, 128 or 256,
      and output quantization for N up to 256, or the BlockNorm block).
  """
  ep = _epilogue(bias, block_size, activation, quantize_output, eps)
  _check(x, w, bias, core, ep)
  if bias is not None:
    bias = bias.astype(jnp.float32)
  if quantize_output or isinstance(x, QTensor):
    return _forward_only(x, w, bias, ep, jnp.dtype(out_dtype), core)
  return _trainable(x, w, bias, block_size, activation, jnp.dtype(out_dtype), backward, eps,
                    core)


def pre_norm(x: jax.Array, w: jax.Array, *, bias: Optional[jax.Array] = None,
             block_size: Optional[int] = None, activation: str = "identity",
             out_dtype=jnp.bfloat16, eps: float = functional.DEFAULT_EPS,
             core: str = TRITON) -> jax.Array:
  """The pre-norm value (scaled product + bias) fused_dense saves for its backward, in x's
  dtype: where its backward evaluates the epilogue's derivative."""
  ep = _epilogue(bias, block_size, activation, False, eps, emit_pre=True)
  _check(x, w, bias, core, ep)
  if bias is not None:
    bias = bias.astype(jnp.float32)
  return _forward(x, w, bias, ep, jnp.dtype(out_dtype), x.dtype, core)[1]


def fused_dense_reference(x: Union[jax.Array, QTensor], w: jax.Array, *,
                          bias: Optional[jax.Array] = None, block_size: Optional[int] = None,
                          activation: str = "identity", quantize_output: bool = False,
                          out_dtype=jnp.bfloat16, eps: float = functional.DEFAULT_EPS,
                          quantizer=scaling.quantize):
  """The same function unfused in pure jnp: fp32 HIGHEST product of the dequantized e4m3
  operands. Quantization is straight-through: jax.grad of this differentiates the exact
  product, which is what fused_dense's backward computes with a full-precision kernel.
  `quantizer(x, fmt, granularity, contracting_axes) -> QTensor` defaults to the library's
  quantize; tests pass the Pallas one to check the GEMM on the kernel's own operands."""
  _check(x, w, bias)
  wf = w.astype(jnp.float32)
  wq = quantizer(lax.stop_gradient(wf), E4M3, ROWWISE, (0,)).dequantize()
  dot = functools.partial(jnp.einsum, "...k,kn->...n", precision=lax.Precision.HIGHEST)
  if isinstance(x, QTensor):
    z = dot(x.dequantize(jnp.float32), wq)
  else:
    xf = x.astype(jnp.float32)
    x2 = lax.stop_gradient(xf).reshape((-1, x.shape[-1]))
    xq = quantizer(x2, E4M3, ROWWISE, (1,)).dequantize().reshape(x.shape)
    exact = dot(xf, wf)
    z = exact + lax.stop_gradient(dot(xq, wq) - exact)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  y = _post(z, block_size, activation, eps)
  if quantize_output:
    return scaling.quantize(y, E4M3, ROWWISE, (y.ndim - 1,))
  return y.astype(out_dtype)
