"""One site's product with a kernel per pass, mixed inside one custom_vjp."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from loka_jax.kernels import registry
from loka_jax.kernels.base import FUSED_OP
from loka_jax.kernels.choice import KernelChoice
from loka_jax.kernels.spec import PASSES, EinsumSpec


def validate_choice(choice: KernelChoice, spec: EinsumSpec, kind: str, lhs_shape, rhs_shape,
                    site_name: str = "<site>") -> None:
  """Raises one error listing every pass whose kernel cannot run this site."""
  problems = []
  kernels = {p: registry.get(choice.for_pass(p)) for p in PASSES}
  fused = {k.name for k in kernels.values() if k.sort == FUSED_OP}
  if fused and len({k.name for k in kernels.values()}) != 1:
    problems.append(f"fused-op kernel {sorted(fused)} must be chosen for all three passes, "
                    f"got {choice.to_dict()}")
  for p, kernel in kernels.items():
    reason = kernel.unsupported_reason(spec.for_pass(p), p, kind, lhs_shape, rhs_shape)
    if reason:
      problems.append(f"{p}: {reason}")
  if problems:
    raise ValueError(f"site {site_name} ({kind}, {spec}, lhs {tuple(lhs_shape)}, "
                     f"rhs {tuple(rhs_shape)}): " + "; ".join(problems))


def per_pass_product(spec: EinsumSpec, choice: KernelChoice, out_dtype, lhs, rhs):
  """out = einsum(spec, lhs, rhs) with the choice's kernel for each pass.

  When every pass uses the same high-precision kernel the plain product is returned and JAX
  differentiates it, so the bf16 baseline is exactly what XLA would build without loka_jax.
  """
  kernels = {p: registry.get(choice.for_pass(p)) for p in PASSES}
  if len({k.name for k in kernels.values()}) == 1 and not kernels["fwd"].fp8:
    return kernels["fwd"].einsum(spec, lhs, rhs, pass_name="fwd", out_dtype=out_dtype)
  return _mixed_product(spec, choice, jnp.dtype(out_dtype), lhs, rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mixed_product(spec, choice, out_dtype, lhs, rhs):
  return registry.get(choice.fwd).einsum(spec, lhs, rhs, pass_name="fwd", out_dtype=out_dtype)


def _mixed_fwd(spec, choice, out_dtype, lhs, rhs):
  # Residuals are the operands in the compute dtype (FP8 residuals would be opt-in).
  return _mixed_product(spec, choice, out_dtype, lhs, rhs), (lhs, rhs)


def _mixed_bwd(spec, choice, out_dtype, residuals, g):
  lhs, rhs = residuals
  g = g.astype(lhs.dtype)
  d_lhs = registry.get(choice.grad_lhs).einsum(
      spec.for_pass("grad_lhs"), g, rhs, pass_name="grad_lhs", out_dtype=lhs.dtype)
  d_rhs = registry.get(choice.grad_rhs).einsum(
      spec.for_pass("grad_rhs"), lhs, g, pass_name="grad_rhs", out_dtype=rhs.dtype)
  return d_lhs, d_rhs


_mixed_product.defvjp(_mixed_fwd, _mixed_bwd)
