"""`flax_fp8_delayed`: Flax's own delayed-scaling FP8 op, wrapped as a fused-op kernel.

It is the in-ecosystem peer, so it is wrapped rather than reimplemented. Its amax histories
and scales live in Flax's overwrite-with-gradient collection, which is loka_jax's `fp8_meta`
collection (one mechanism for every stateful recipe): the training step replaces those
variables by their "gradients" instead of applying the optimizer (see `merge_fp8_meta`).
Scales start at 1, so judge it only after a few warm-up steps.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from loka_jax.kernels import registry
from loka_jax.kernels.base import FUSED_OP, Kernel

FP8_META = fp8_ops.OVERWRITE_WITH_GRADIENT


@dataclasses.dataclass(frozen=True)
class FlaxDelayed(Kernel):
  amax_history_length: int = 1024

  def make_module(self, name: str):
    return fp8_ops.Fp8Einsum(amax_history_length=self.amax_history_length, name=name)


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


def run_delayed_passes(spec: str, lhs, rhs, g, *, warmup: int = 3,
                       amax_history_length: int = 1024):
  """All three passes of Flax's delayed op on one problem, after `warmup` state updates.

  Returns (out, d_lhs, d_rhs, fp8_meta). The state is updated exactly as training does
  (overwrite-with-gradient), so the final call uses scales learned from the earlier ones.
  """
  module = fp8_ops.Fp8Einsum(amax_history_length=amax_history_length)
  variables = module.init(jax.random.PRNGKey(0), spec, lhs, rhs)

  def apply(v, l, r):
    return module.apply(v, spec, l, r)

  for i in range(warmup + 1):
    out, vjp = jax.vjp(apply, variables, lhs, rhs)
    d_vars, d_lhs, d_rhs = vjp(g.astype(out.dtype))
    if i < warmup:
      variables = {FP8_META: merge_fp8_meta(d_vars[FP8_META])}
  return out, d_lhs, d_rhs, variables[FP8_META]
