"""The Pallas kernels as registry entries (backends 'pallas_triton' and 'pallas_mosaic_gpu').

Per-pass kernels (mix freely with others per pass):
  pallas_fp8_rowwise    2-D (and flattened) specs; e4m3 operands, one scale per
                        non-contracting index. Gradients are e4m3 with rowwise scales, not
                        e5m2: a Triton dot takes one operand dtype, and per-row scales give
                        the gradient the range e5m2 would.
  pallas_fp8_blockwise  2-D specs; 1x128 blocks along the contraction for activations and
                        gradients, 128x128 blocks for the rhs of fwd / grad_lhs (the weight),
                        fp32 promotion of every K block's partial product.
  pallas_fp8_batched    batched specs ('bnd,bdk->bnk', DLRM's 'bfd,bgd->bfg', their passes);
                        rowwise e4m3, batch entries on the grid.
Fused-op kernels (own all three passes):
  pallas_fp8_delayed, pallas_fp8_delayed_grad_lhs, pallas_fp8_delayed_fwd
                        Flax's delayed-scaling recipe (e4m3 / e5m2, amax history 1024) with
                        one Pallas pass per operand for the amax, the cast and the transposed
                        copy, and XLA's FP8 dots; FP8 in every pass, in fwd + grad_lhs, or in
                        the forward alone (kernels_pallas.delayed_op).
Fused epilogue kernels (`pallas_fp8_rowwise_fused_<epilogue>`) compute act(norm(x W + b)),
not a site's plain product: Mods layers call them through kernels_pallas.fused.fused_dense.
Mosaic GPU kernels (Hopper only: FP8 wgmma fed by TMA, `kernels_pallas.mosaic_gemm`):
  pallas_mosaic_fp8_rowwise, pallas_mosaic_fp8_blockwise, pallas_mosaic_fp8_batched
                        the products above on the Mosaic GPU core; Dispatch keeps whichever
                        backend is faster per site and pass. The rowwise and batched ones
                        let the tensor cores accumulate the whole K; the blockwise one, and
  pallas_mosaic_fp8_rowwise_precise
                        the rowwise product, sum each 128-wide K step's product in fp32.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from kernels_pallas import delayed_op, epilogue, fused, gemm, mosaic_gemm, products
from kernels_pallas import quantize as quantize_lib
from loka_jax.kernels import registry
from loka_jax.kernels.base import FUSED_OP, ChainKernel, Kernel, reference_einsum
from loka_jax.kernels.spec import ACT_WEIGHT, EinsumSpec
from loka_jax.precision import QTensor

BACKEND = "pallas_triton"
MOSAIC_BACKEND = "pallas_mosaic_gpu"
_DENSE = EinsumSpec.parse("mk,kn->mn")


def device_reason() -> Optional[str]:
  """Why this device cannot run the kernels (FP8 casts need sm_89+); None on CPU/OK GPUs."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return None  # interpret mode
  if dev.platform != "gpu":
    return f"Pallas Triton kernels need an NVIDIA GPU, got {dev.platform}"
  cc = getattr(dev, "compute_capability", None)
  try:
    major, minor = (int(p) for p in str(cc).split(".")[:2])
  except ValueError:
    return None
  if (major, minor) < (8, 9):
    return f"FP8 casts in Triton need compute capability >= 8.9, device has {cc}"
  return None


@dataclasses.dataclass(frozen=True)
class PallasFp8(Kernel):
  """A per-pass Pallas FP8 product (mode 'rowwise' or 'blockwise')."""
  mode: str = "rowwise"
  batched: bool = False
  # 2: long-K products with small outputs (weight gradients) split K (`gemm.split_k_for`).
  revision: int = 2

  def device_reason(self) -> Optional[str]:
    """Why this device cannot run the kernel (None: it can)."""
    return device_reason()

  @property
  def quantizer(self):
    """The quantize its operands go through: their dequantized values are its reference."""
    return quantize_lib.quantize

  def unsupported_reason(self, spec, pass_name, kind, lhs_shape, rhs_shape):
    reason = super().unsupported_reason(spec, pass_name, kind, lhs_shape, rhs_shape)
    if reason:
      return reason
    reason = products.unsupported(spec, batched=self.batched) or self.device_reason()
    return f"kernel {self.name}: {reason}" if reason else None

  def einsum(self, spec, a, b, *, pass_name, out_dtype):
    reason = products.unsupported(spec, batched=self.batched) or self.device_reason()
    if reason:
      raise ValueError(f"kernel {self.name}, {pass_name}: {reason}")
    return self.product(spec, a, b, pass_name=pass_name, out_dtype=out_dtype)

  def product(self, spec, a, b, *, pass_name, out_dtype):
    """The pass's product on a spec and device the kernel supports."""
    if self.mode == "blockwise":
      return products.blockwise_einsum(spec, a, b, pass_name=pass_name, out_dtype=out_dtype,
                                       kernel_name=self.name)
    return products.rowwise_einsum(spec, a, b, out_dtype=out_dtype, kernel_name=self.name)


def mosaic_device_reason() -> Optional[str]:
  """Why this device cannot run the Mosaic GPU kernels (FP8 wgmma is Hopper's, sm_90);
  None on the CPU (interpret mode) and on Hopper GPUs."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return None
  if dev.platform != "gpu":
    return f"Pallas Mosaic GPU kernels need an NVIDIA GPU, got {dev.platform}"
  cc = str(getattr(dev, "compute_capability", ""))
  if cc and not cc.startswith("9."):
    return f"FP8 wgmma needs a Hopper GPU (compute capability 9.x), device has {cc}"
  return None


@dataclasses.dataclass(frozen=True)
class PallasMosaicFp8(PallasFp8):
  """A per-pass FP8 product on the Mosaic GPU core (TMA + FP8 wgmma), mode 'rowwise' or
  'blockwise'. `precise`: each K step's product is summed in fp32 registers rather than at
  the tensor cores' own accumulation precision (blockwise products always are)."""
  revision: int = 1
  precise: bool = False

  def device_reason(self) -> Optional[str]:
    return mosaic_device_reason()

  @property
  def quantizer(self):
    return mosaic_gemm.QUANTIZE

  def product(self, spec, a, b, *, pass_name, out_dtype):
    if self.mode == "blockwise":
      return mosaic_gemm.blockwise_einsum(spec, a, b, pass_name=pass_name,
                                          out_dtype=out_dtype, kernel_name=self.name)
    return mosaic_gemm.rowwise_einsum(spec, a, b, out_dtype=out_dtype, kernel_name=self.name,
                                      precise=self.precise)


@dataclasses.dataclass(frozen=True)
class PallasDelayed(Kernel):
  """Delayed-scaling FP8 as one fused op, quantized in one Pallas pass per operand."""
  amax_history_length: int = 1024
  mode: str = delayed_op.ALL

  def quantizes(self, pass_name: str) -> bool:
    quantized = {delayed_op.ALL: ("fwd", "grad_lhs", "grad_rhs"),
                 delayed_op.GRAD_LHS: ("fwd", "grad_lhs"), delayed_op.FWD: ("fwd",)}
    return super().quantizes(pass_name) and pass_name in quantized[self.mode]

  def pass_numerics(self, pass_name: str) -> str:
    # The modes differ in which transposed copies the quantize also writes, not in the codes
    # a pass multiplies: every forward is one dot of the same row-major e4m3 x and w^T, every
    # quantized grad_lhs one of the same e5m2 g and e4m3 w, and an unquantized gradient is
    # the plain product's (`delayed_op._plain_grads`). So the three ops share those names, as
    # Flax's do (`FlaxDelayed.pass_numerics`), and validation does not rank them by the
    # probe's sampled estimates of one computation.
    return self.delayed_pass_numerics("pallas_delayed", self.amax_history_length, pass_name)

  def make_module(self, name: str):
    return delayed_op.PallasDelayedEinsum(amax_history_length=self.amax_history_length,
                                          mode=self.mode, name=name)

  def unsupported_reason(self, spec, pass_name, kind, lhs_shape, rhs_shape):
    reason = super().unsupported_reason(spec, pass_name, kind, lhs_shape, rhs_shape)
    if reason:
      return reason
    reason = delayed_op.dense_spec_reason(spec, pass_name) or device_reason()
    return f"kernel {self.name}: {reason}" if reason else None


@dataclasses.dataclass(frozen=True)
class PallasFusedEpilogue(ChainKernel):
  """GEMM + bias + BlockNorm + activation (+ output quantization) as one kernel.

  `core`: the GEMM kernel underneath (fused.TRITON or fused.MOSAIC_GPU). `equivalent`: the
  per-pass kernel that quantizes its operands as this kernel's forward does (e4m3 rowwise):
  what its backward runs for dgrad and wgrad when a plan names it in every pass."""
  block_size: Optional[int] = None
  activation: str = "identity"
  quantize_output: bool = False
  core: str = fused.TRITON
  equivalent: str = "pallas_fp8_rowwise"

  def unsupported_reason(self, spec, pass_name, kind, lhs_shape, rhs_shape):
    return (f"kernel {self.name} fuses BlockNorm/activation into the GEMM, so it is not a "
            "site's plain product; call kernels_pallas.fused.fused_dense from a Mods layer "
            "(or kernel.apply)")

  def apply(self, x, w, bias=None, *, out_dtype=None, backward=None):
    """fused_dense with this kernel's epilogue and core (backward: `equivalent` unless
    named)."""
    kwargs = {} if out_dtype is None else {"out_dtype": out_dtype}
    return fused.fused_dense(x, w, bias=bias, block_size=self.block_size,
                             activation=self.activation, quantize_output=self.quantize_output,
                             backward=backward or self.equivalent, core=self.core, **kwargs)

  @property
  def has_backward(self) -> bool:
    return not self.quantize_output  # a QTensor output carries no float gradient

  def chain_unsupported_reason(self, m, k, n):
    if self.core == fused.MOSAIC_GPU:
      reason = mosaic_gemm.unsupported_epilogue(epilogue.Epilogue(
          block_size=self.block_size, activation=self.activation,
          quantize_output=self.quantize_output), n)
      if reason:
        return f"kernel {self.name}: {reason}"
    elif self.quantize_output and n > gemm.MAX_FULL_ROW:
      return (f"kernel {self.name}: output quantization holds whole rows in one program; "
              f"N={n} exceeds {gemm.MAX_FULL_ROW}")
    reason = mosaic_device_reason() if self.core == fused.MOSAIC_GPU else device_reason()
    return f"kernel {self.name}: {reason}" if reason else None

  def chain(self, x, w, bias, *, out_dtype):
    out = self.apply(x, w, bias, out_dtype=out_dtype)
    return out.dequantize(out_dtype) if isinstance(out, QTensor) else out

  def chain_reference(self, x, w, bias):
    z = reference_einsum(_DENSE, x, w)
    ep = epilogue.Epilogue(bias=bias is not None, block_size=self.block_size,
                           activation=self.activation)
    return epilogue.reference(z, ep, None if bias is None else bias.astype(jnp.float32))


def fused_name(block_size, activation, quantize_output, core=fused.TRITON) -> str:
  parts = []
  if block_size is not None:
    parts.append(f"blocknorm{block_size}")
  parts.append(activation)
  if quantize_output:
    parts.append("quant")
  prefix = "pallas_mosaic_fp8_rowwise_fused_" if core == fused.MOSAIC_GPU else (
      "pallas_fp8_rowwise_fused_")
  return prefix + "_".join(parts)


def register_all() -> None:
  registry.register(PallasFp8(
      name="pallas_fp8_rowwise", backend=BACKEND, mode="rowwise",
      description="Pallas Triton FP8: e4m3 rowwise (grads e4m3 rowwise), fused quantize, "
                  "precise accumulation"))
  registry.register(PallasFp8(
      name="pallas_fp8_blockwise", backend=BACKEND, mode="blockwise",
      description="Pallas Triton FP8: 1x128 activations/grads, 128x128 weights, fp32 "
                  "promotion per K block"))
  registry.register(PallasFp8(
      name="pallas_fp8_batched", backend=BACKEND, mode="rowwise", batched=True,
      description="Pallas Triton FP8 batched (interaction shapes): rowwise e4m3, batch on "
                  "the grid"))
  registry.register(PallasMosaicFp8(
      name="pallas_mosaic_fp8_rowwise", backend=MOSAIC_BACKEND, mode="rowwise",
      description="Pallas Mosaic GPU FP8 (Hopper): e4m3 rowwise (grads e4m3 rowwise), TMA-fed "
                  "FP8 wgmma, fp32 accumulator"))
  registry.register(PallasMosaicFp8(
      name="pallas_mosaic_fp8_rowwise_precise", backend=MOSAIC_BACKEND, mode="rowwise",
      precise=True,
      description="Pallas Mosaic GPU FP8 (Hopper): e4m3 rowwise, each 128-wide K step's "
                  "wgmma product summed in fp32 registers"))
  registry.register(PallasMosaicFp8(
      name="pallas_mosaic_fp8_blockwise", backend=MOSAIC_BACKEND, mode="blockwise",
      description="Pallas Mosaic GPU FP8 (Hopper): 1x128 activations/grads, 128x128 weights, "
                  "each K block's wgmma product scaled and summed in fp32 registers"))
  registry.register(PallasMosaicFp8(
      name="pallas_mosaic_fp8_batched", backend=MOSAIC_BACKEND, mode="rowwise", batched=True,
      description="Pallas Mosaic GPU FP8 batched (interaction shapes): rowwise e4m3, batch "
                  "on the grid"))
  for mode, suffix, what in ((delayed_op.ALL, "", "FP8 in every pass"),
                            (delayed_op.GRAD_LHS, "_grad_lhs",
                             "FP8 fwd and grad_lhs, grad_rhs in the compute dtype"),
                            (delayed_op.FWD, "_fwd",
                             "FP8 fwd, both gradients in the compute dtype")):
    registry.register(PallasDelayed(
        name=f"pallas_fp8_delayed{suffix}", backend=BACKEND, sort=FUSED_OP, stateful=True,
        kinds=frozenset({ACT_WEIGHT}), mode=mode,
        description=f"delayed scaling (amax history 1024), e4m3 / e5m2; amax, cast and "
                    f"transposed copy in one Pallas pass per operand, XLA FP8 dots; {what}"))
  for block_size in (None, 256):
    for activation in ("relu", "hard_swish"):
      for quant in (False, True):
        registry.register(PallasFusedEpilogue(
            name=fused_name(block_size, activation, quant), backend=BACKEND, sort=FUSED_OP,
            passes=frozenset(), block_size=block_size, activation=activation,
            quantize_output=quant,
            description=(f"Pallas FP8 GEMM + bias"
                         f"{'' if block_size is None else f' + BlockNorm({block_size})'}"
                         f" + {activation}{' + rowwise e4m3 output' if quant else ''}; "
                         "via fused_dense")))
        registry.register(PallasFusedEpilogue(
            name=fused_name(block_size, activation, quant, fused.MOSAIC_GPU),
            backend=MOSAIC_BACKEND, sort=FUSED_OP, passes=frozenset(), block_size=block_size,
            activation=activation, quantize_output=quant, core=fused.MOSAIC_GPU,
            equivalent="pallas_mosaic_fp8_rowwise",
            description=(f"Pallas Mosaic GPU FP8 GEMM (Hopper wgmma) + bias"
                         f"{'' if block_size is None else f' + BlockNorm({block_size})'}"
                         f" + {activation}"
                         f"{' + rowwise e4m3 output (N <= 256)' if quant else ''}; via "
                         "fused_dense"
                         f"{'' if quant else ', backward on pallas_mosaic_fp8_rowwise'}")))
