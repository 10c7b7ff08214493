"""Mods as Flax layers: BlockNorm and a norm selector that models use everywhere."""
from __future__ import annotations

import flax.linen as nn

from loka_jax.mods import functional
from loka_jax.precision import BF16, DtypePolicy

NORMS = ("layernorm", "blocknorm", "rmsnorm", "none")


class BlockNorm(nn.Module):
  """Parameter-free RMSNorm over fixed feature blocks; `use_gain` adds a learnable gain.

  Each block of `block_size` consecutive features (last axis) is divided by
  sqrt(mean(block^2) + epsilon), statistics in float32:
  - epsilon (default 1e-6) bounds the scale of an all-zero block (it stays zero) and keeps
    the gradient finite; it is a fixed attribute, never learned;
  - a width not divisible by `block_size` ends with one shorter block, normalized over its own
    width (no padding enters its mean); a width below `block_size` is one block (RMSNorm);
  - `use_gain` multiplies by a learnable per-feature gain `scale` (ones at init) after the
    normalization, like RMSNorm's; LoKA's BlockNorm has none, and the fused kernels none.
  The block size is a module attribute, not a parameter: training and inference build the
  model from the same config, so they normalize over the same blocks by construction.
  """
  block_size: int = functional.DEFAULT_BLOCK
  epsilon: float = functional.DEFAULT_EPS
  use_gain: bool = False
  policy: DtypePolicy = BF16

  @nn.compact
  def __call__(self, x):
    y = functional.block_norm(x.astype(self.policy.compute_dtype), self.block_size, self.epsilon)
    if self.use_gain:
      gain = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],),
                        self.policy.param_dtype)
      y = y * gain.astype(y.dtype)
    return y


class Norm(nn.Module):
  """The model-wide normalization choice: 'layernorm' (default), 'blocknorm' (the Mod),
  'rmsnorm' (one block spanning all features) or 'none'."""
  kind: str = "layernorm"
  block_size: int = functional.DEFAULT_BLOCK
  policy: DtypePolicy = BF16

  @nn.compact
  def __call__(self, x):
    if self.kind == "layernorm":
      return nn.LayerNorm(dtype=self.policy.compute_dtype, param_dtype=self.policy.param_dtype,
                          name="layernorm")(x)
    if self.kind == "blocknorm":
      return BlockNorm(self.block_size, policy=self.policy, name="blocknorm")(x)
    if self.kind == "rmsnorm":
      return BlockNorm(x.shape[-1], policy=self.policy, name="rmsnorm")(x)
    if self.kind == "none":
      return x.astype(self.policy.compute_dtype)
    raise ValueError(f"unknown norm {self.kind!r}; use one of {NORMS}")
