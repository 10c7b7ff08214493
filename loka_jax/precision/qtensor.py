"""QTensor: FP8 data plus the scales that dequantize it, the only way FP8 crosses a Site."""
from __future__ import annotations

from typing import Tuple

import flax.struct
import jax
import jax.numpy as jnp

TENSORWISE = "tensorwise"
ROWWISE = "rowwise"
BLOCK_1x128 = "block_1x128"
BLOCK_128x128 = "block_128x128"
GRANULARITIES = (TENSORWISE, ROWWISE, BLOCK_1x128, BLOCK_128x128)
BLOCK = 128


@flax.struct.dataclass
class QTensor:
  """FP8 `data` with fp32 `scale`; `data * scale` (broadcast per granularity) dequantizes.

  `axis` holds the contracting axes of the product the tensor was quantized for: scales vary
  only along the other axes (tensorwise and rowwise) or in blocks along `axis` (blockwise).
  """
  data: jax.Array
  scale: jax.Array
  granularity: str = flax.struct.field(pytree_node=False, default=TENSORWISE)
  axis: Tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

  @property
  def shape(self):
    return self.data.shape

  @property
  def dtype(self):
    return self.data.dtype

  def expanded_scale(self) -> jax.Array:
    """The scale broadcast (or repeated per block) to `data`'s shape."""
    scale = self.scale
    if self.granularity in (BLOCK_1x128, BLOCK_128x128):
      for ax in range(self.data.ndim):
        if scale.shape[ax] != self.data.shape[ax] and scale.shape[ax] != 1:
          scale = jnp.repeat(scale, BLOCK, axis=ax)
          scale = jax.lax.slice_in_dim(scale, 0, self.data.shape[ax], axis=ax)
    return jnp.broadcast_to(scale, self.data.shape)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """data x scale in `dtype`: the value an FP8 kernel multiplies.

    The codes pass an optimization barrier first. In a program that quantizes and
    dequantizes, XLA:GPU otherwise removes the round trip through the 8-bit format (under
    its default excess precision a convert pair f32 -> e4m3 -> f32 is simplified away) and
    returns the unquantized value. Codes that are already a stored array or a kernel's
    output are unaffected."""
    codes = jax.lax.optimization_barrier(self.data)
    return (codes.astype(jnp.float32) * self.expanded_scale()).astype(dtype)

  def check_axis(self, contracting_axes, who: str) -> None:
    """Raises if this tensor's scales were laid out for a different product."""
    axes = tuple(sorted(a % self.data.ndim for a in contracting_axes))
    if self.granularity != TENSORWISE and axes != tuple(sorted(self.axis)):
      raise ValueError(
          f"{who}: QTensor quantized {self.granularity} for contracting axes {self.axis} "
          f"cannot feed a product contracting axes {axes}; requantize for this pass")
