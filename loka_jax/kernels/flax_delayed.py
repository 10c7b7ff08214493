"""Delayed-scaling FP8 as fused-op kernels, built on Flax's own op.

  flax_fp8_delayed      Flax's `Fp8Einsum`: e4m3 forward, e5m2 output gradient in both
                        backward products. The in-ecosystem peer, wrapped rather than
                        reimplemented.
  flax_fp8_delayed_fwd  the same delayed-scaling e4m3 forward (Flax's `in_q` / `out_dq`),
                        with both gradients computed in the compute dtype from the
                        unquantized operands. For sites whose forward FP8 pays and is
                        accurate while their weight gradient is not (Wukong `large`'s wide
                        MLPs: docs/BENCHMARKS.md, section 7); a per-pass split cannot
                        express it, since delayed scaling keeps state across the passes.

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


def _delayed_forward_dot_general(lhs, rhs, dimension_numbers, precision=None,
                                 preferred_element_type=None, *, lhs_scale, rhs_scale,
                                 lhs_amax_history, rhs_amax_history, compute_dtype):
  """Flax's `fp8_scaled_dot_general` without its output-gradient quantization."""
  del precision  # the product's precision is the e4m3 dot's
  q_lhs, lhs_scale = fp8_ops.in_q(compute_dtype, jnp.float8_e4m3fn, lhs, lhs_scale,
                                  lhs_amax_history)
  q_rhs, rhs_scale = fp8_ops.in_q(compute_dtype, jnp.float8_e4m3fn, rhs, rhs_scale,
                                  rhs_amax_history)
  out = _fp8_product_exact_grads(lhs, q_lhs, rhs, q_rhs, dimension_numbers,
                                 preferred_element_type)
  return fp8_ops.out_dq(preferred_element_type, lhs_scale, rhs_scale, out)


class Fp8EinsumForward(nn.Module):
  """Delayed-scaling e4m3 einsum forward; gradients in the compute dtype. State: the
  operands' scales and amax histories (no output-gradient state: it is never quantized)."""
  amax_history_length: int = 1024

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    meta = lambda name, shape, fill: self.variable(
        FP8_META, name, lambda: jnp.full(shape, fill, jnp.float32))
    history = (self.amax_history_length,)
    dot = functools.partial(
        _delayed_forward_dot_general,
        lhs_scale=meta("input_scale", (1,), 1.0).value,
        rhs_scale=meta("kernel_scale", (1,), 1.0).value,
        lhs_amax_history=meta("input_amax_history", history, 0.0).value,
        rhs_amax_history=meta("kernel_amax_history", history, 0.0).value,
        compute_dtype=rhs.dtype)  # as Flax: the rhs (weight) dtype is the compute dtype
    return jnp.einsum(eqn, lhs.astype(rhs.dtype), rhs, _dot_general=dot)


@dataclasses.dataclass(frozen=True)
class FlaxDelayedForward(FlaxDelayed):

  def make_module(self, name: str):
    return Fp8EinsumForward(amax_history_length=self.amax_history_length, name=name)


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
