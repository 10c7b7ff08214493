"""XLA kernels: bf16 / fp32 baselines and FP8 with scales applied after the product.

FP8 operands go straight into lax.dot_general (XLA then emits cuBLASLt FP8 or its Triton
GEMM; a dequantize-then-dot is not reliably rewritten). Precision DEFAULT on FP8 dots
means fast accumulation on the GPU; HIGHEST asks for precise accumulation.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from loka_jax.kernels import registry
from loka_jax.kernels.base import Kernel, check_operands, dot_einsum
from loka_jax.kernels.spec import EinsumSpec, operand_roles
from loka_jax.precision import E4M3, E5M2, ROWWISE, TENSORWISE, quantize

FWD_ONLY_FAST = "fwd"   # fast accumulation forward, precise backward (the common recipe)
ALL_FAST = "all"
NONE_FAST = "none"


@dataclasses.dataclass(frozen=True)
class XlaHighPrecision(Kernel):
  """Plain dot_general in `dtype` with fp32 accumulation."""
  dtype: str = "bfloat16"
  precision: str = "DEFAULT"

  def einsum(self, spec, a, b, *, pass_name, out_dtype):
    check_operands(f"kernel {self.name} ({pass_name})", spec, a, b)
    dt = jnp.dtype(self.dtype)
    a, b = a.astype(dt), b.astype(dt)
    result_dtype = dt
    if dt == jnp.bfloat16 and jax.default_backend() == "cpu":
      # XLA:CPU's DotThunk lacks some bf16 products (e.g. a gather feeding the product);
      # bf16 values are exact in f32, so the CPU computes the same products in f32.
      a, b, result_dtype = a.astype(jnp.float32), b.astype(jnp.float32), jnp.float32
    # The product comes out in the operand dtype (the GEMM accumulates in fp32 inside), as
    # nn.Dense does, so autodiff's backward multiplies bf16 cotangents by bf16 operands: the
    # honest bf16 baseline, not one with fp32 backward GEMMs.
    out = dot_einsum(spec, a, b, precision=getattr(lax.Precision, self.precision),
                     preferred_element_type=result_dtype)
    return out.astype(out_dtype)


def operand_formats(pass_name: str):
  """e4m3 for activations and weights, e5m2 for output gradients."""
  return tuple(E5M2 if role == "g" else E4M3 for role in operand_roles(pass_name))


def output_scale(spec: EinsumSpec, qa, qb) -> jax.Array:
  """Product of the operands' scales laid out on the output (scales never vary along
  contracting axes here, so they factor out of the sum)."""
  sa = jnp.squeeze(qa.scale, axis=spec.contracting_axes("lhs"))
  sb = jnp.squeeze(qb.scale, axis=spec.contracting_axes("rhs"))
  la = "".join(i for i in spec.lhs if i in spec.out)
  lb = "".join(i for i in spec.rhs if i in spec.out)
  return jnp.einsum(f"{la},{lb}->{spec.out}", sa, sb)


@dataclasses.dataclass(frozen=True)
class XlaFp8(Kernel):
  """Current-scaling FP8 (tensorwise or rowwise) through XLA's native FP8 dot."""
  granularity: str = TENSORWISE
  fast_accum: str = FWD_ONLY_FAST

  def quantized_operands(self, spec, a, b, *, pass_name):
    fa, fb = operand_formats(pass_name)
    return (quantize(a, fa, self.granularity, spec.contracting_axes("lhs")),
            quantize(b, fb, self.granularity, spec.contracting_axes("rhs")))

  def accumulates_fast(self, pass_name: str) -> bool:
    return self.fast_accum == ALL_FAST or (self.fast_accum == FWD_ONLY_FAST and pass_name == "fwd")

  def pass_numerics(self, pass_name: str) -> str:
    # XLA's FP8 kernels differ only in granularity and accumulation: two that agree on both
    # for a pass (a fast-accumulation variant's precise-backward sibling in the forward, say)
    # run the same program for it.
    fast = "fast" if self.accumulates_fast(pass_name) else "precise"
    return f"xla_fp8_{self.granularity}_{fast}/{pass_name}"

  def einsum(self, spec, a, b, *, pass_name, out_dtype):
    check_operands(f"kernel {self.name} ({pass_name})", spec, a, b)
    qa, qb = self.quantized_operands(spec, a, b, pass_name=pass_name)
    precision = lax.Precision.DEFAULT if self.accumulates_fast(pass_name) else lax.Precision.HIGHEST
    if self.granularity == TENSORWISE:
      # One scalar scale for the whole product: the dot writes the output dtype and the scale
      # follows in it, the form of Flax's delayed-scaling forward, which cuBLASLt runs as one
      # FP8 GEMM. A float32 product costs a float32 write and a separate scaling pass (on an
      # H200 the export's products at the largest tower serve at 1.40x bf16 this way, 1.24x
      # with a float32 product).
      out = dot_einsum(spec, qa.data, qb.data, precision=precision,
                       preferred_element_type=out_dtype)
      return out * (qa.scale.reshape(()) * qb.scale.reshape(())).astype(out_dtype)
    # Per-row/column scales vary over the output: scale the float32 product, then round.
    out = dot_einsum(spec, qa.data, qb.data, precision=precision,
                     preferred_element_type=jnp.float32)
    return (out * output_scale(spec, qa, qb)).astype(out_dtype)


def _register_all():
  registry.register(XlaHighPrecision(
      name="xla_bf16", backend="xla", fp8=False,
      description="bf16 operands, fp32 accumulation (the baseline every FP8 kernel must beat)"))
  registry.register(XlaHighPrecision(
      name="xla_fp32", backend="xla", fp8=False, dtype="float32", precision="HIGHEST",
      description="fp32 operands, precision HIGHEST (reference arm)"))
  for gran in (TENSORWISE, ROWWISE):
    revision = 2 if gran == TENSORWISE else 1  # 2: the dot writes the output dtype
    registry.register(XlaFp8(
        name=f"xla_fp8_{gran}", backend="xla", granularity=gran, fast_accum=FWD_ONLY_FAST,
        revision=revision,
        description=f"FP8 {gran} current scaling; fast accumulation fwd, precise bwd"))
    registry.register(XlaFp8(
        name=f"xla_fp8_{gran}_fastacc", backend="xla", granularity=gran, fast_accum=ALL_FAST,
        revision=revision,
        description=f"FP8 {gran} current scaling; fast accumulation in every pass"))
    registry.register(XlaFp8(
        name=f"xla_fp8_{gran}_precise", backend="xla", granularity=gran, fast_accum=NONE_FAST,
        revision=revision,
        description=f"FP8 {gran} current scaling; precise accumulation in every pass"))


_register_all()
