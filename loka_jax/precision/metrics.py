"""Error metrics of a product against its reference, all in float32.

All metrics are computed in float32 on the host-visible arrays; non-finite results are
capped (SQNR at 200 dB) or turned into None plus an error string by `to_json_safe`.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import jax
import jax.numpy as jnp

SQNR_CAP_DB = 200.0
MERE_FLOOR = 1e-3  # MERE's denominator floor as a fraction of rms(ref) (paper parity)


def sqnr_db(out: jax.Array, ref: jax.Array) -> jax.Array:
  """10 log10(|ref|^2 / |out - ref|^2), capped at SQNR_CAP_DB (exact results)."""
  out = out.astype(jnp.float32)
  ref = ref.astype(jnp.float32)
  signal = jnp.sum(ref * ref)
  noise = jnp.sum((out - ref) ** 2)
  value = 10.0 * jnp.log10(signal / noise)
  value = jnp.where(noise == 0, SQNR_CAP_DB, value)
  return jnp.minimum(value, SQNR_CAP_DB)


def rel_fro(out: jax.Array, ref: jax.Array) -> jax.Array:
  out = out.astype(jnp.float32)
  ref = ref.astype(jnp.float32)
  return jnp.linalg.norm((out - ref).ravel()) / jnp.linalg.norm(ref.ravel())


def _relative_errors(out, ref):
  out = out.astype(jnp.float32)
  ref = ref.astype(jnp.float32)
  rms = jnp.sqrt(jnp.mean(ref * ref))
  return jnp.abs(out - ref) / (jnp.abs(ref) + MERE_FLOOR * rms)


def mere(out: jax.Array, ref: jax.Array) -> jax.Array:
  """Mean element-wise relative error: mean |out - ref| / (|ref| + 1e-3 rms(ref))."""
  return jnp.mean(_relative_errors(out, ref))


def median_rel(out: jax.Array, ref: jax.Array) -> jax.Array:
  return jnp.median(_relative_errors(out, ref))


def product_errors(out: jax.Array, ref: jax.Array) -> Dict[str, jax.Array]:
  """Every output metric at once (jit/vmap friendly)."""
  return {"sqnr_db": sqnr_db(out, ref), "rel_fro": rel_fro(out, ref), "mere": mere(out, ref),
          "median_rel": median_rel(out, ref)}


def to_json_safe(value) -> Optional[float]:
  """A float for JSON, or None for NaN (the caller adds an `error` string)."""
  value = float(value)
  if math.isnan(value):
    return None
  if math.isinf(value):
    return SQNR_CAP_DB if value > 0 else -SQNR_CAP_DB
  return value
