"""Fused-epilogue kernels as probe candidates: where they may run, and what they are judged on.

A fused-epilogue kernel (`kernels.base.ChainKernel`, e.g. `pallas_fp8_rowwise_fused_relu`)
computes a whole chain, `act(BlockNorm(x @ W + b))`, not a site's plain product. The models
build such a chain as one site, `models.fused.FusedDenseNormAct`, whose `Chain` the probe
records when it finds the sites (`SiteProbe.chain`). At a site whose chain has the kernel's
epilogue (block size, activation, output quantization) the kernel is a candidate like a
fused op, all three passes or none, with each pass judged on the chain:

  fwd       the chain's output (quantized output dequantized), against the chain in float32
            on the original operands with a HIGHEST product (reference (a), as every site
            error);
  grad_lhs  d loss / d x    as the fused kernel's backward computes them (the epilogue's
  grad_rhs  d loss / d W    backward on its own pre-norm value, then dgrad and wgrad with
                            its per-pass equivalent, `backward_of`: what a plan naming the
                            kernel in every pass runs),
                            against float32 HIGHEST products of the original operands with
                            the epilogue's backward taken in float32 at that same pre-norm
                            value.

The gradient passes thus carry the backward's own error, as a per-pass kernel's gradients
are judged on the sampled output gradient: the forward's error is the forward pass's. A
reference with the epilogue's backward at the exact product would count it twice: at a
ReLU, every unit the FP8 forward moves across zero takes or drops its whole gradient (at
256x256x128 the fused ReLU chain's d x read 15.6 dB that way, 28.9 dB this way; the bf16
chain's 28.2 dB that way). The probe observes the gradient at the product, not at the
chain's output; the sampled output gradient stands in for the chain's (the same array goes
to both sides). The bias is left out (the probe keeps no bias; both add it in float32).
Its times are those of the whole chain, forward and
backward, against the bf16 chain (`chain_timing`). At every other site, and in the passes a
kernel cannot run (an FP8 output carries no gradient), it is unsupported with the reason.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from loka_jax.kernels import EinsumSpec, registry, reference_einsum
from loka_jax.kernels.base import ChainKernel
from loka_jax.models import fused as fused_lib

DENSE = "mk,kn->mn"


def backward_of(kernel) -> str:
  """The per-pass kernel a fused-epilogue kernel's backward runs when a plan names it in
  every pass (`models.fused.equivalent_kernel`)."""
  return fused_lib.equivalent_kernel(kernel.name)


def core_of(kernel) -> str:
  """The GEMM core under a fused-epilogue kernel ('triton' unless it names another)."""
  return getattr(kernel, "core", None) or "triton"


def is_chain_kernel(kernel) -> bool:
  return isinstance(kernel, ChainKernel)


def kernel_chain(kernel) -> fused_lib.Chain:
  """The chain a fused-epilogue kernel computes (its epilogue; default epsilon, a bias)."""
  return fused_lib.Chain(kernel.block_size, kernel.activation, kernel.quantize_output)


def unsupported_reason(kernel, chain: Optional[fused_lib.Chain], spec: EinsumSpec,
                       pass_name: str, lhs_shape: Sequence[int],
                       rhs_shape: Sequence[int]) -> Optional[str]:
  """Why a fused-epilogue kernel cannot run `pass_name` at a site with `chain` (None: a plain
  product), or None."""
  own = kernel_chain(kernel).describe()
  if chain is None:
    return (f"kernel {kernel.name} computes {own} after its GEMM; it is a candidate only at "
            "a fused Mods layer (FusedDenseNormAct) with that epilogue, and this site is a "
            "plain product")
  if chain.epilogue != kernel_chain(kernel).epilogue:
    return f"kernel {kernel.name} computes {own}, this site's chain {chain.describe()}"
  if str(spec.for_pass("fwd")) != DENSE:
    return f"kernel {kernel.name} runs dense products ({DENSE}), not {spec.for_pass('fwd')}"
  if pass_name != "fwd" and not kernel.has_backward:
    return (f"kernel {kernel.name} quantizes its output to FP8, which carries no gradient: "
            "forward only")
  m, k = lhs_shape
  reason = kernel.chain_unsupported_reason(m, k, rhs_shape[1])
  if reason or pass_name == "fwd":
    return reason
  backward = registry.get(backward_of(kernel))
  return backward.unsupported_reason(spec.for_pass(pass_name), pass_name, "act_weight",
                                     lhs_shape, rhs_shape)


def run(kernel, x, w, chain: fused_lib.Chain, out_dtype, bias=None):
  """The chain as the fused kernel computes it (an FP8 output dequantized): `out_dtype`."""
  from kernels_pallas import fused  # the plugin that registered the kernel
  out = fused.fused_dense(x, w, bias=bias, block_size=chain.block_size,
                          activation=chain.activation, quantize_output=chain.quantize_output,
                          out_dtype=out_dtype, backward=backward_of(kernel),
                          eps=chain.epsilon, core=core_of(kernel))
  return out.dequantize(out_dtype) if hasattr(out, "dequantize") else out


def bf16_chain(x, w, chain: fused_lib.Chain, out_dtype, bias=None):
  """The unfused chain the baseline runs: XLA's product, bias, BlockNorm and activation in
  the compute dtype (`FusedDenseNormAct` on the xla_bf16 plan)."""
  z = registry.get("xla_bf16").einsum(EinsumSpec.parse(DENSE), x, w, pass_name="fwd",
                                      out_dtype=out_dtype)
  if bias is not None:
    z = z + bias.astype(z.dtype)
  return chain.apply(z).astype(out_dtype)


def pre_norm(kernel, x, w, chain: fused_lib.Chain):
  """The pre-norm value the fused kernel's backward evaluates the epilogue's derivative at."""
  from kernels_pallas import fused  # every fused-epilogue kernel is its fused_dense
  return fused.pre_norm(x, w, block_size=chain.block_size, activation=chain.activation,
                        out_dtype=x.dtype, eps=chain.epsilon, core=core_of(kernel))


def reference(lhs, rhs, grad, chain: fused_lib.Chain, pre):
  """(chain output, d lhs, d rhs, the gradient at the product) in float32 on the original
  operands with HIGHEST products; the epilogue's backward of the output gradient `grad` is
  taken at `pre` (the kernel's own pre-norm value: the module docstring)."""
  spec = EinsumSpec.parse(DENSE)
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  y = chain.apply(reference_einsum(spec, lhs, rhs))
  _, vjp = jax.vjp(chain.apply, pre.astype(jnp.float32))
  (dz,) = vjp(grad.astype(jnp.float32))
  d_lhs = reference_einsum(spec.for_pass("grad_lhs"), dz, rhs)
  d_rhs = reference_einsum(spec.for_pass("grad_rhs"), lhs, dz)
  return y, d_lhs, d_rhs, dz
