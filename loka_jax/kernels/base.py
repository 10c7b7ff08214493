"""The Kernel interface: one way to compute one or all passes of a GEMM site."""
from __future__ import annotations

import abc
import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from loka_jax.kernels.spec import KINDS, PASSES, EinsumSpec, check_pass

PER_PASS = "per_pass"   # stateless, one pass; mixes freely with others inside one custom_vjp
FUSED_OP = "fused_op"   # owns all three passes (and maybe state), e.g. Flax's delayed scaling,
                        # or a whole chain (ChainKernel: a GEMM with its epilogue)


@dataclasses.dataclass(frozen=True)
class Kernel(abc.ABC):
  """A registered way to run GEMM-site products.

  Attributes:
    name: registry key, used in plans and reports.
    backend: 'xla', 'pallas_triton', 'pallas_mosaic_gpu' or 'flax'.
    sort: PER_PASS or FUSED_OP.
    passes: passes it can compute.
    kinds: site kinds it supports ('act_weight', 'act_act').
    stateful: keeps state in the fp8_meta collection (delayed scaling).
    fp8: whether it computes in FP8 (False for the bf16 / fp32 baselines).
    description: one line for the registry's listing (`experiments.kernels`).
    revision: bumped when the kernel's computation changes, so timings measured before
      (caches, committed tables) are measured again rather than reused.
  """
  name: str
  backend: str
  sort: str = PER_PASS
  passes: frozenset = frozenset(PASSES)
  kinds: frozenset = frozenset(KINDS)
  stateful: bool = False
  fp8: bool = True
  description: str = ""
  revision: int = 1

  def quantizes(self, pass_name: str) -> bool:
    """Whether this kernel's `pass_name` pass runs in FP8. A fused op names itself in every
    pass of a plan, yet some keep their gradients in the compute dtype
    (`flax_fp8_delayed_fwd`): those override this."""
    check_pass(pass_name)
    return self.fp8

  def pass_numerics(self, pass_name: str) -> str:
    """What this kernel's `pass_name` pass computes, as a name: kernels that give the same
    name compute that pass identically (the delayed-scaling fused ops share one forward), so
    the probe's error estimates of it differ by sampling alone and must not rank them. By
    default each kernel's own."""
    check_pass(pass_name)
    return f"{self.name}/{pass_name}"

  def delayed_pass_numerics(self, family: str, amax_history_length: int,
                            pass_name: str) -> str:
    """`pass_numerics` of a delayed-scaling op `family` whose modes differ only in which
    passes they quantize: one e4m3 forward (at the amax history's length), one e5m2 product
    per quantized gradient pass, and the plain product's gradient where a mode keeps it
    unquantized."""
    check_pass(pass_name)
    history = f"h{amax_history_length}"
    if pass_name == "fwd":
      return f"{family}_e4m3/{history}"
    if self.quantizes(pass_name):
      return f"{family}_e5m2_{pass_name}/{history}"
    return f"{family}_unquantized_{pass_name}"

  def unsupported_reason(self, spec: EinsumSpec, pass_name: str, kind: str,
                         lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> Optional[str]:
    """None when this kernel can run the pass; otherwise why not (for plan errors)."""
    check_pass(pass_name)
    if pass_name not in self.passes:
      return f"kernel {self.name} has no {pass_name} pass"
    if kind not in self.kinds:
      return f"kernel {self.name} does not support {kind} sites"
    return None

  def quantized_operands(self, spec: EinsumSpec, a: jax.Array, b: jax.Array, *,
                         pass_name: str):
    """The (QTensor | None, QTensor | None) this kernel multiplies, for error metrics and
    the kernel-correctness reference; None where an operand is not quantized."""
    del spec, a, b, pass_name
    return None, None

  def einsum(self, spec: EinsumSpec, a: jax.Array, b: jax.Array, *, pass_name: str,
             out_dtype) -> jax.Array:
    """Per-pass kernels: the product of one pass (spec already the pass's spec)."""
    raise NotImplementedError(f"kernel {self.name} is {self.sort}; it has no single-pass einsum")


class ChainKernel(Kernel):
  """A kernel that computes a chain around a dense product, x (M, K) @ w (K, N), with more
  fused into it (bias, norm, activation, output quantization): not a site's plain passes,
  so a plan gives it only to layers that compute the same chain, and the kernel check runs
  the whole chain against `chain_reference` (forward, and backward where it has one)."""

  @property
  def has_backward(self) -> bool:
    """Whether the chain is differentiable (an output quantized to FP8 is forward-only)."""
    return True

  def chain_unsupported_reason(self, m: int, k: int, n: int) -> Optional[str]:
    """None when the chain runs at this size on this device; otherwise why not."""
    del m, k, n
    return None

  @abc.abstractmethod
  def chain(self, x: jax.Array, w: jax.Array, bias: jax.Array, *, out_dtype) -> jax.Array:
    """The chain on x (M, K), w (K, N) and bias (N,) as this kernel computes it, an
    `out_dtype` array (a quantized output dequantized)."""

  @abc.abstractmethod
  def chain_reference(self, x: jax.Array, w: jax.Array, bias: jax.Array) -> jax.Array:
    """The same chain in pure jnp, float32 with a HIGHEST-precision product, on the operands
    as given (nothing quantized)."""


def check_operands(where: str, spec: EinsumSpec, a, b) -> None:
  """Raises naming `where` (a site or kernel) when the operands' shapes do not fit `spec` or
  an operand is not floating point (integer ids or masks multiplied by mistake)."""
  try:
    spec.shapes(a.shape, b.shape)
  except ValueError as e:
    raise ValueError(f"{where}: {e}; give operands shaped as the einsum says") from None
  for role, x in (("lhs", a), ("rhs", b)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{where} ({spec}): the {role} operand has dtype {x.dtype}; GEMM sites "
                      "and kernels take floating-point operands: cast it to float32 or "
                      "bfloat16 first")


def dot_einsum(spec: EinsumSpec, a: jax.Array, b: jax.Array, *, precision=None,
               preferred_element_type=jnp.float32) -> jax.Array:
  """`spec` as one lax.dot_general (operands passed as they are, FP8 included) + transpose."""
  out = lax.dot_general(a, b, spec.dimension_numbers(), precision=precision,
                        preferred_element_type=preferred_element_type)
  perm = spec.output_permutation()
  return out if perm == tuple(range(len(perm))) else jnp.transpose(out, perm)


def reference_einsum(spec: EinsumSpec, a: jax.Array, b: jax.Array) -> jax.Array:
  """Reference products: float32, precision HIGHEST."""
  return dot_einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
