"""Delayed-scaling FP8 fused ops whose quantization is one Pallas pass per operand.

The same recipe as `loka_jax.kernels.flax_delayed` (Flax's delayed scaling: e4m3 operands,
e5m2 output gradient, each tensor's scale from the max of its amax history, state in the
`fp8_meta` collection under Flax's variable names), with the quantization done by
`kernels_pallas.delayed.quantize_delayed`: the cast, the tensor's amax and, where a product
reads the tensor contraction-major, its transposed copy come from a single read. The products
stay XLA's FP8 dots (cuBLASLt on Hopper), given their operands already in the "TN" layout:

  fwd       out[M,N]  = x_q[M,K]   . w_qT[N,K]    (fast accumulation, as Flax's forward)
  grad_lhs  dx[M,K]   = g_q[M,N]   . w_q[K,N]     (precise accumulation, as Flax's)
  grad_rhs  dw[K,N]   = x_qT[K,M]  . g_qT[N,M]    (precise accumulation)

At one output column (a logit head's N = 1) the precise dot carries an error of its own,
about 31 dB against its operands' exact product on sm_90 (`check.PRECISE_AT_ONE_COLUMN_DB`),
which Flax's layout of the weight gradient does not show; plans keep heads in bf16.

Modes, by which passes run in FP8 (the others are the plain product's, in the compute dtype,
from the unquantized operands), the same three as the Flax family:
  all       every pass (`pallas_fp8_delayed`; its backward keeps only FP8 residuals),
  grad_lhs  fwd and grad_lhs (`pallas_fp8_delayed_grad_lhs`),
  fwd       the forward alone (`pallas_fp8_delayed_fwd`).

Sites: act x weight products whose weight is 2-D and contracted on its first axis with the
activation's last (`mk,kn->mn`, DenseSite's product, and `...k,kn->...n`).
"""
from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from kernels_pallas.delayed import quantize_delayed, quantize_delayed_reference
from loka_jax.kernels.flax_delayed import FP8_META
from loka_jax.kernels.spec import EinsumSpec

ALL, GRAD_LHS, FWD = "all", "grad_lhs", "fwd"
MODES = (ALL, GRAD_LHS, FWD)
_CONTRACT_LAST = (((1,), (1,)), ((), ()))   # both operands contraction-major: "TN"


def dense_spec_reason(spec: EinsumSpec, pass_name: str = "fwd") -> Optional[str]:
  """None when the site whose `pass_name` pass is `spec` multiplies an activation by a 2-D
  weight contracted on its first axis."""
  if pass_name == "grad_lhs":     # (g, rhs -> lhs) of the site (lhs, rhs -> out)
    spec = EinsumSpec(spec.out, spec.rhs, spec.lhs)
  elif pass_name == "grad_rhs":   # (lhs, g -> rhs)
    spec = EinsumSpec(spec.lhs, spec.out, spec.rhs)
  if (len(spec.rhs) == 2 and spec.contracting == spec.rhs[0] == spec.lhs[-1]
      and not spec.batch and spec.out == spec.lhs[:-1] + spec.rhs[1]):
    return None
  return (f"spec {spec} is not an activation times a 2-D weight contracted on its first "
          "axis ('...k,kn->...n')")


def next_scale(scale, history, fmt_dtype):
  """Flax's delayed scale for this step: from the max of the history, as `update_fp8_meta`."""
  return fp8_ops.compute_scale(jnp.max(history, axis=0), scale,
                               fp8_ops.get_fp8_max(fmt_dtype, jnp.float32))


def next_history(history, amax):
  """The history with this step's amax: Flax's `compute_amax_history`, given the amax the
  quantize already took (the max |.| of a non-negative scalar is itself)."""
  return fp8_ops.compute_amax_history(amax, history)


def delayed_dense_reference(x2, w, g, meta) -> dict:
  """{pass: fp32 product} of the operands quantized (`quantize_delayed_reference`) with the
  scales the op derives from its state `meta` (the `fp8_meta` it starts a step from), then
  dequantized: what each FP8 pass computes, up to accumulation and its output dtype.
  'grad_lhs' and 'grad_rhs' only where `meta` holds the output gradient's state."""
  def dequantized(a, scale, history, fmt, dtype):
    s = next_scale(meta[scale], meta[history], dtype)
    q = quantize_delayed_reference(a, s, fmt)[0]
    return q.astype(jnp.float32) * s.reshape(()).astype(jnp.float32)

  hi = lax.Precision.HIGHEST
  qx = dequantized(x2, "input_scale", "input_amax_history", "e4m3", jnp.float8_e4m3fn)
  qw = dequantized(w, "kernel_scale", "kernel_amax_history", "e4m3", jnp.float8_e4m3fn)
  out = {"fwd": jnp.matmul(qx, qw, precision=hi)}
  if "output_grad_scale" in meta:
    qg = dequantized(g, "output_grad_scale", "output_grad_amax_history", "e5m2",
                     jnp.float8_e5m2)
    out.update(grad_lhs=jnp.matmul(qg, qw.T, precision=hi),
               grad_rhs=jnp.matmul(qx.T, qg, precision=hi))
  return out


def _scaled(product, scale_a, scale_b, dtype):
  """The product times one scalar scale, in the product's dtype (as Flax's `out_dq`)."""
  return product * (scale_a * scale_b).reshape(()).astype(dtype)


# The forward dot keeps fast accumulation at every width, a K -> 1 logit head included,
# although the probe reads the op's forward low at such heads: on an H200, XLA's FP8 dot at
# N = 1 reads 31.2-31.7 dB against its dequantized product with precise accumulation, while
# the fast forward clears 35 dB (tests/gpu): there the fast forward is the more accurate one.
FORWARD_PRECISION = lax.Precision.DEFAULT


def _forward(x2, w, x_scale, w_scale, x_history, w_history, mode):
  dt = w.dtype
  sx = next_scale(x_scale, x_history, jnp.float8_e4m3fn)
  sw = next_scale(w_scale, w_history, jnp.float8_e4m3fn)
  x_q, x_qt, x_amax = quantize_delayed(x2, sx, "e4m3", row_major=True, transposed=mode == ALL)
  w_q, w_qt, w_amax = quantize_delayed(w, sw, "e4m3", row_major=mode != FWD, transposed=True)
  out = _scaled(lax.dot_general(x_q, w_qt, _CONTRACT_LAST,
                                precision=FORWARD_PRECISION,
                                preferred_element_type=dt), sx, sw, dt)
  state = (sx, sw, next_history(x_history, x_amax), next_history(w_history, w_amax))
  return out, state, (x_qt, w_q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def delayed_dense(x2, w, x_scale, w_scale, x_history, w_history, g_scale, g_history, mode):
  """(M,K) x (K,N) -> (M,N) under delayed scaling; FP8 in the passes `mode` names. Both
  operands are in the compute dtype, which the output and both gradients keep.

  The new scales and histories come back as the "gradients" of the state arguments
  (overwrite-with-gradient, as Flax's ops); `g_scale`/`g_history` are None in mode 'fwd'.
  """
  del g_scale, g_history
  return _forward(x2, w, x_scale, w_scale, x_history, w_history, mode)[0]


def _delayed_dense_fwd(x2, w, x_scale, w_scale, x_history, w_history, g_scale, g_history,
                       mode):
  out, state, (x_qt, w_q) = _forward(x2, w, x_scale, w_scale, x_history, w_history, mode)
  # Residuals: FP8 where the backward multiplies FP8, the unquantized operand where a pass
  # is the plain product (mode 'all' keeps no compute-dtype copy of x or w at all).
  plain_x = None if mode == ALL else x2
  plain_w = None if mode == ALL else w
  return out, (plain_x, plain_w, x_qt, w_q, state, g_scale, g_history)


def _plain_grads(x2, w, g):
  """Both gradients of the plain product in the compute dtype, as autodiff builds them."""
  _, vjp = jax.vjp(lambda a, b: lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), preferred_element_type=w.dtype), x2, w)
  return vjp(g)


def _delayed_dense_bwd(mode, residuals, g):
  x2, w, x_qt, w_q, state, g_scale, g_history = residuals
  sx, sw, x_history, w_history = state
  dt = g.dtype   # the output's, which is the compute dtype of both operands
  if mode == FWD:
    dx, dw = _plain_grads(x2, w, g)
    return dx, dw, sx, sw, x_history, w_history, None, None
  sg = next_scale(g_scale, g_history, jnp.float8_e5m2)
  g_q, g_qt, g_amax = quantize_delayed(g, sg, "e5m2", row_major=True, transposed=mode == ALL)
  dx = _scaled(lax.dot_general(g_q, w_q, _CONTRACT_LAST, precision=lax.Precision.HIGHEST,
                               preferred_element_type=dt), sg, sw, dt)
  if mode == ALL:
    dw = _scaled(lax.dot_general(x_qt, g_qt, _CONTRACT_LAST, precision=lax.Precision.HIGHEST,
                                 preferred_element_type=dt), sx, sg, dt)
  else:
    _, dw = _plain_grads(x2, w, g)
  return (dx, dw, sx, sw, x_history, w_history, sg,
          next_history(g_history, g_amax))


delayed_dense.defvjp(_delayed_dense_fwd, _delayed_dense_bwd)


class PallasDelayedEinsum(nn.Module):
  """A site's product under delayed-scaling FP8, quantized by one Pallas pass per operand.

  Called as Flax's `Fp8Einsum` is (`module(eqn, lhs, rhs)`), with its state under Flax's
  names: input/kernel scale and amax history, and the output gradient's where grad_lhs is
  FP8."""
  amax_history_length: int = 1024
  mode: str = ALL

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    if self.mode not in MODES:
      raise ValueError(f"PallasDelayedEinsum: unknown mode {self.mode!r}; modes are {MODES}")
    spec = EinsumSpec.parse(eqn)
    reason = dense_spec_reason(spec)
    if reason:
      raise ValueError(f"PallasDelayedEinsum: {reason}")
    spec.shapes(lhs.shape, rhs.shape)
    meta = lambda name, shape, fill: self.variable(
        FP8_META, name, lambda: jnp.full(shape, fill, jnp.float32)).value
    history = (self.amax_history_length,)
    g_scale = g_history = None
    if self.mode != FWD:
      g_scale = meta("output_grad_scale", (1,), 1.0)
      g_history = meta("output_grad_amax_history", history, 0.0)
    k, n = rhs.shape
    # As Flax: the rhs (weight) dtype is the compute dtype.
    out = delayed_dense(lhs.astype(rhs.dtype).reshape((-1, k)), rhs,
                        meta("input_scale", (1,), 1.0), meta("kernel_scale", (1,), 1.0),
                        meta("input_amax_history", history, 0.0),
                        meta("kernel_amax_history", history, 0.0), g_scale, g_history,
                        self.mode)
    return out.reshape(lhs.shape[:-1] + (n,))
