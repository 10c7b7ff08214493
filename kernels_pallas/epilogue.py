"""GEMM epilogues: scales, bias, BlockNorm, activation and next-layer quantization.

`Epilogue` is static (hashable) configuration. `apply_tile` runs inside a kernel on one
(bm, bn) accumulator tile; `reference` is the pure-jnp function it must match, built from
`loka_jax.mods.functional` (BlockNorm, Hard Swish) so fused and unfused paths agree.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from loka_jax.mods import functional

ACTIVATIONS = ("identity", "relu", "hard_swish")


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """What happens to the fp32 accumulator before it is stored.

  Attributes:
    bias: add a per-column fp32 bias.
    block_size: BlockNorm (RMS over consecutive feature blocks) when set; a power of two.
    eps: BlockNorm epsilon (functional.block_norm's default).
    activation: 'identity', 'relu' or 'hard_swish'.
    quantize_output: emit e4m3 data + one fp32 scale per row (a rowwise QTensor for the next
      layer) instead of out_dtype; the whole row must sit in one program.
    emit_pre: also store the pre-norm value (GEMM * scales + bias), the residual backward needs.
  """
  bias: bool = False
  block_size: Optional[int] = None
  eps: float = functional.DEFAULT_EPS
  activation: str = "identity"
  quantize_output: bool = False
  emit_pre: bool = False

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"epilogue activation {self.activation!r} not fused; use one of "
                       f"{ACTIVATIONS} (others: apply after the kernel)")
    if self.block_size is not None:
      bs = int(self.block_size)
      if bs < 16 or bs > 1024 or bs & (bs - 1):
        raise ValueError(f"fused BlockNorm block_size must be a power of two in [16, 1024] "
                         f"(a Triton tile is one block), got {self.block_size}")

  @property
  def is_plain(self) -> bool:
    return (not self.bias and self.block_size is None and self.activation == "identity"
            and not self.quantize_output and not self.emit_pre)

  @property
  def tag(self) -> str:
    """Short name for kernels, tuning keys and benchmark rows."""
    parts = []
    if self.bias:
      parts.append("bias")
    if self.block_size is not None:
      parts.append(f"bn{self.block_size}")
    if self.activation != "identity":
      parts.append(self.activation)
    if self.quantize_output:
      parts.append("q")
    if self.emit_pre:
      parts.append("pre")
    return "_".join(parts) or "plain"


def activate(y, name: str):
  """In-kernel activation; written so NaN propagates (Triton's max would drop it)."""
  if name == "relu":
    return jnp.where(y < 0, 0.0, y)
  if name == "hard_swish":
    return y * jnp.minimum(jnp.maximum(y + 3.0, 0.0), 6.0) / 6.0
  return y


def block_norm_tile(y, col0, n_total: int, eps: float):
  """RMS-normalizes each row of a tile that is exactly one feature block starting at col0.

  Columns past `n_total` must already be zero; the last, shorter block is normalized over
  its own width, like functional.block_norm.
  """
  width = y.shape[1]
  count = jnp.clip(n_total - col0, 1, width).astype(jnp.float32)
  ms = jnp.sum(y * y, axis=1) / count
  return y / jnp.sqrt(ms + eps)[:, None]


def reference(z: jax.Array, epilogue: Epilogue, bias: Optional[jax.Array] = None) -> jax.Array:
  """Pure-jnp epilogue in fp32 on an already-scaled product z (no output quantization)."""
  y = z.astype(jnp.float32)
  if epilogue.bias:
    y = y + bias.astype(jnp.float32)
  if epilogue.block_size is not None:
    y = functional.block_norm(y, epilogue.block_size, epilogue.eps)
  return functional.activation(epilogue.activation)(y)
