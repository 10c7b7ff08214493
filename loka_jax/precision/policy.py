"""Dtype policies: which dtype parameters are stored in, computed in and emitted in."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DtypePolicy:
  """Explicit dtypes for one layer or model (Flax naming: param_dtype, dtype)."""
  param_dtype: jnp.dtype = jnp.float32
  compute_dtype: jnp.dtype = jnp.bfloat16
  output_dtype: jnp.dtype = jnp.bfloat16

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      value = jnp.dtype(getattr(self, field))
      if not jnp.issubdtype(value, jnp.floating):
        raise ValueError(f"DtypePolicy.{field} must be a floating dtype, got {value}")
      if value.itemsize < 2:
        raise ValueError(
            f"DtypePolicy.{field}={value}: FP8 is a kernel's storage format, not a policy dtype;"
            " pick an FP8 kernel in the plan instead")
      object.__setattr__(self, field, value)

  @classmethod
  def named(cls, name: str) -> "DtypePolicy":
    """'fp32' (reference arm) or 'bf16' (mixed precision: fp32 params, bf16 compute)."""
    if name == "fp32":
      return cls(jnp.float32, jnp.float32, jnp.float32)
    if name == "bf16":
      return cls(jnp.float32, jnp.bfloat16, jnp.bfloat16)
    raise ValueError(f"unknown dtype policy {name!r}; use 'fp32' or 'bf16'")


FP32 = DtypePolicy.named("fp32")
BF16 = DtypePolicy.named("bf16")
