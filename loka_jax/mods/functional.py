"""Functional Mods: BlockNorm and Hard Swish (also the references fused kernels must match)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_BLOCK = 256
DEFAULT_EPS = 1e-6


def hard_swish(x: jax.Array) -> jax.Array:
  """x * relu6(x + 3) / 6: piecewise quadratic, no exponential to amplify outliers."""
  return x * jnp.clip(x + 3.0, 0.0, 6.0) / 6.0


def block_norm(x: jax.Array, block_size: int = DEFAULT_BLOCK,
               eps: float = DEFAULT_EPS) -> jax.Array:
  """Parameter-free RMSNorm over consecutive blocks of `block_size` features (last axis).

  Each block is divided by sqrt(mean(block^2) + eps); `eps` keeps an all-zero block zero with
  finite gradients. Widths not divisible by the block: the last, shorter block is normalized
  over its own width (so every feature is normalized and no padding leaks into the
  statistics). Statistics are computed in float32; the result has x's dtype.
  """
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  width = x.shape[-1]
  xf = x.astype(jnp.float32)
  full = (width // block_size) * block_size
  parts = []
  if full:
    head = xf[..., :full].reshape(x.shape[:-1] + (full // block_size, block_size))
    rms = jnp.sqrt(jnp.mean(head * head, axis=-1, keepdims=True) + eps)
    parts.append((head / rms).reshape(x.shape[:-1] + (full,)))
  if full < width:
    tail = xf[..., full:]
    rms = jnp.sqrt(jnp.mean(tail * tail, axis=-1, keepdims=True) + eps)
    parts.append(tail / rms)
  out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
  return out.astype(x.dtype)


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "swish": jax.nn.swish,
    "gelu": jax.nn.gelu,
    "hard_swish": hard_swish,
    "sigmoid": jax.nn.sigmoid,
    "identity": lambda x: x,
}


def activation(name: str):
  try:
    return ACTIVATIONS[name]
  except KeyError:
    raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}") from None
