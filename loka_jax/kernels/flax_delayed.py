"""Delayed-scaling FP8 as fused-op kernels, built on Flax's own op.

  flax_fp8_delayed           Flax's `Fp8Einsum`: e4m3 forward, e5m2 output gradient in both
                             backward products. The in-ecosystem peer, wrapped rather than
                             reimplemented.
  flax_fp8_delayed_fwd       the same delayed-scaling e4m3 forward (Flax's `in_q` / `out_dq`),
                             with both gradients computed in the compute dtype from the
                             unquantized operands. For sites whose forward FP8 pays and is
                             accurate while their weight gradient is not (Wukong `large`'s wide
                             MLPs on an H200); a per-pass split cannot express it, since
                             delayed scaling keeps state across the passes.
  flax_fp8_delayed_grad_lhs  the delayed forward, and grad_lhs as Flax computes it (e5m2
                             output gradient with its own delayed scale, times the e4m3
                             weight); only grad_rhs (the weight gradient) in the compute dtype.
                             For sites where FP8 fails only the weight gradient: the largest
                             tower's `dense_2/3` (grad_lhs 25 dB, grad_rhs 9-11 dB), whose bf16
                             grad_lhs costs the plan time (a whole-step profile on an H200).

Amax histories and scales live in Flax's overwrite-with-gradient collection, which is
loka_jax's `fp8_meta` collection (one mechanism for every stateful recipe): the training step
replaces those variables by their "gradients" instead of applying the optimizer (see
`merge_fp8_meta`). Scales start at 1, so judge them only after a few warm-up steps.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from loka_jax.kernels import registry
from loka_jax.kernels.base import FUSED_OP, Kernel

FP8_META = fp8_ops.OVERWRITE_WITH_GRADIENT


@dataclasses.dataclass(frozen=True)
class FlaxDelayed(Kernel):
  amax_history_length: int = 1024

  def make_module(self, name: str):
    return fp8_ops.Fp8Einsum(amax_history_length=self.amax_history_length, name=name)

  def pass_numerics(self, pass_name: str) -> str:
    # One e4m3 forward (Flax's in_q / out_dq) for every delayed op; a quantized gradient is
    # Flax's e5m2 product (`_fp8_grad_lhs_bwd` repeats `quantized_dot_bwd`'s grad_lhs), an
    # unquantized one the plain product's from the unquantized operands. On an H200 the
    # held-out check reads bit-identical log loss with flax_fp8_delayed and
    # flax_fp8_delayed_grad_lhs at Wukong `large`'s head, whose probe estimates of that
    # forward differ.
    return self.delayed_pass_numerics("flax_delayed", self.amax_history_length, pass_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_product_exact_grads(lhs, q_lhs, rhs, q_rhs, dimension_numbers,
                             preferred_element_type):
  """The e4m3 product of the quantized operands, whose gradients are those of the plain
  product of the unquantized ones (compute dtype, no gradient quantization)."""
  return lax.dot_general(q_lhs, q_rhs, dimension_numbers,
                         preferred_element_type=preferred_element_type)


def _exact_grads_fwd(lhs, q_lhs, rhs, q_rhs, dimension_numbers, preferred_element_type):
  out = _fp8_product_exact_grads(lhs, q_lhs, rhs, q_rhs, dimension_numbers,
                                 preferred_element_type)
  return out, (lhs, rhs)


def _exact_grads_bwd(dimension_numbers, preferred_element_type, residuals, g):
  lhs, rhs = residuals
  _, vjp = jax.vjp(lambda a, b: lax.dot_general(
      a, b, dimension_numbers, preferred_element_type=preferred_element_type), lhs, rhs)
  d_lhs, d_rhs = vjp(g)
  return d_lhs, None, d_rhs, None


_fp8_product_exact_grads.defvjp(_exact_grads_fwd, _exact_grads_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _fp8_product_fp8_grad_lhs(lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale, grad_scale,
                              grad_amax_history, dimension_numbers, preferred_element_type):
  """The e4m3 product whose grad_lhs is Flax's (e5m2 output gradient under delayed scaling,
  times the e4m3 rhs) and whose grad_rhs is the plain product's from the unquantized
  operands. The output gradient's new scale and history come back as the "gradients" of
  `grad_scale` and `grad_amax_history` (overwrite-with-gradient, as in Flax)."""
  del lhs, lhs_scale, rhs, rhs_scale, grad_scale, grad_amax_history
  return lax.dot_general(q_lhs, q_rhs, dimension_numbers,
                         preferred_element_type=preferred_element_type)


def _fp8_grad_lhs_fwd(lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale, grad_scale,
                      grad_amax_history, dimension_numbers, preferred_element_type):
  out = lax.dot_general(q_lhs, q_rhs, dimension_numbers,
                        preferred_element_type=preferred_element_type)
  return out, (lhs, rhs, q_rhs, rhs_scale, grad_scale, grad_amax_history)


def _fp8_grad_lhs_bwd(dimension_numbers, preferred_element_type, residuals, g):
  lhs, rhs, q_rhs, rhs_scale, grad_scale, grad_amax_history = residuals
  # grad_lhs exactly as Flax's `quantized_dot_bwd` computes it.
  new_scale, new_history = fp8_ops.update_fp8_meta(g, jnp.float8_e5m2, grad_scale,
                                                   grad_amax_history)
  q_g = fp8_ops.quantize(g, jnp.float8_e5m2, new_scale, preferred_element_type)
  d_lhs = fp8_ops.dot_general_transpose_lhs(
      q_g, lhs, q_rhs, dimension_numbers=dimension_numbers, precision=lax.Precision.HIGHEST,
      preferred_element_type=preferred_element_type)
  d_lhs = fp8_ops.dequantize(d_lhs, preferred_element_type, rhs_scale * new_scale)
  # grad_rhs: the plain product's, from the unquantized operands and gradient.
  _, vjp = jax.vjp(lambda b: lax.dot_general(
      lhs, b, dimension_numbers, preferred_element_type=preferred_element_type), rhs)
  (d_rhs,) = vjp(g)
  return d_lhs, None, None, d_rhs, None, None, new_scale, new_history


_fp8_product_fp8_grad_lhs.defvjp(_fp8_grad_lhs_fwd, _fp8_grad_lhs_bwd)


def _delayed_forward_dot_general(lhs, rhs, dimension_numbers, precision=None,
                                 preferred_element_type=None, *, lhs_scale, rhs_scale,
                                 lhs_amax_history, rhs_amax_history, compute_dtype,
                                 grad_scale=None, grad_amax_history=None):
  """Flax's `fp8_scaled_dot_general` without its output-gradient quantization, or (given
  the output gradient's scale and history) with it in grad_lhs only."""
  del precision  # the product's precision is the e4m3 dot's
  q_lhs, lhs_scale = fp8_ops.in_q(compute_dtype, jnp.float8_e4m3fn, lhs, lhs_scale,
                                  lhs_amax_history)
  q_rhs, rhs_scale = fp8_ops.in_q(compute_dtype, jnp.float8_e4m3fn, rhs, rhs_scale,
                                  rhs_amax_history)
  if grad_scale is None:
    out = _fp8_product_exact_grads(lhs, q_lhs, rhs, q_rhs, dimension_numbers,
                                   preferred_element_type)
  else:
    out = _fp8_product_fp8_grad_lhs(lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale, grad_scale,
                                    grad_amax_history, dimension_numbers,
                                    preferred_element_type)
  return fp8_ops.out_dq(preferred_element_type, lhs_scale, rhs_scale, out)


class Fp8EinsumForward(nn.Module):
  """Delayed-scaling e4m3 einsum forward; gradients in the compute dtype, except grad_lhs in
  FP8 when `fp8_grad_lhs`. State: the operands' scales and amax histories, and the output
  gradient's only when it is quantized (in grad_lhs)."""
  amax_history_length: int = 1024
  fp8_grad_lhs: bool = False

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    meta = lambda name, shape, fill: self.variable(
        FP8_META, name, lambda: jnp.full(shape, fill, jnp.float32)).value
    history = (self.amax_history_length,)
    grad_state = {}
    if self.fp8_grad_lhs:  # Flax's names for the output gradient's state
      grad_state = dict(grad_scale=meta("output_grad_scale", (1,), 1.0),
                        grad_amax_history=meta("output_grad_amax_history", history, 0.0))
    dot = functools.partial(
        _delayed_forward_dot_general,
        lhs_scale=meta("input_scale", (1,), 1.0),
        rhs_scale=meta("kernel_scale", (1,), 1.0),
        lhs_amax_history=meta("input_amax_history", history, 0.0),
        rhs_amax_history=meta("kernel_amax_history", history, 0.0),
        compute_dtype=rhs.dtype,  # as Flax: the rhs (weight) dtype is the compute dtype
        **grad_state)
    return jnp.einsum(eqn, lhs.astype(rhs.dtype), rhs, _dot_general=dot)


@dataclasses.dataclass(frozen=True)
class FlaxDelayedForward(FlaxDelayed):
  fp8_grad_lhs: bool = False

  def quantizes(self, pass_name: str) -> bool:
    return super().quantizes(pass_name) and (
        pass_name == "fwd" or (pass_name == "grad_lhs" and self.fp8_grad_lhs))

  def make_module(self, name: str):
    return Fp8EinsumForward(amax_history_length=self.amax_history_length,
                            fp8_grad_lhs=self.fp8_grad_lhs, name=name)


def split_fp8_meta(variables):
  """(fp8_meta collection or {}, the rest)."""
  variables = dict(variables)
  return variables.pop(FP8_META, {}), variables


def merge_fp8_meta(grads_of_fp8_meta):
  """Overwrite-with-gradient: the new fp8_meta state is what the op wrote into its gradient.

  Each Site calls its op exactly once per step, so the cotangent is the op's new state; a
  module that called one op twice would sum two states, which Sites never do.
  """
  return jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads_of_fp8_meta)


registry.register(FlaxDelayed(
    name="flax_fp8_delayed", backend="flax", sort=FUSED_OP, stateful=True,
    description="flax.linen.fp8_ops.Fp8Einsum: delayed scaling (amax history 1024), "
                "e4m3 fwd / e5m2 grads, all passes in one op"))
registry.register(FlaxDelayedForward(
    name="flax_fp8_delayed_fwd", backend="flax", sort=FUSED_OP, stateful=True,
    description="delayed-scaling e4m3 forward (Flax's in_q/out_dq, amax history 1024); "
                "both gradients in the compute dtype from the unquantized operands"))
registry.register(FlaxDelayedForward(
    name="flax_fp8_delayed_grad_lhs", backend="flax", sort=FUSED_OP, stateful=True,
    fp8_grad_lhs=True,
    description="delayed-scaling e4m3 forward and Flax's e5m2 x e4m3 grad_lhs (amax history "
                "1024); grad_rhs in the compute dtype from the unquantized operands"))


def run_delayed_passes(spec: str, lhs, rhs, g, *, warmup: int = 3,
                       kernel: str = "flax_fp8_delayed"):
  """All three passes of a delayed-scaling fused op on one problem, after `warmup` state
  updates.

  Returns (out, d_lhs, d_rhs, fp8_meta). The state is updated exactly as training does
  (overwrite-with-gradient), so the final call uses scales learned from the earlier ones.
  """
  module = registry.get(kernel).make_module(name=None)
  variables = module.init(jax.random.PRNGKey(0), spec, lhs, rhs)

  def apply(v, l, r):
    return module.apply(v, spec, l, r)

  for i in range(warmup + 1):
    out, vjp = jax.vjp(apply, variables, lhs, rhs)
    d_vars, d_lhs, d_rhs = vjp(g.astype(out.dtype))
    if i < warmup:
      variables = {FP8_META: merge_fp8_meta(d_vars[FP8_META])}
  return out, d_lhs, d_rhs, variables[FP8_META]
