"""Operands and closeness checks shared by the GPU kernel tests."""
import jax
import jax.numpy as jnp
import numpy as np


def heavy(key, shape, dtype=jnp.bfloat16):
  """Normal values with one log-normal scale per row: rows spread over about a decade."""
  k1, k2 = jax.random.split(key)
  scale = jnp.exp(0.5 * jax.random.normal(k2, shape[:-1] + (1,)))
  return (jax.random.normal(k1, shape) * scale).astype(dtype)


def close(out, ref, rtol):
  """All finite, and the largest error within rtol of the largest |ref|."""
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(out)), "non-finite outputs"
  err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
  assert err < rtol, f"max error {err:.3g} relative to max |ref| (limit {rtol})"


def operands(pass_name, m, k, n, seed):
  """A dense site's operands of one pass: x (M, K) and w (K, N) in bf16, the output
  gradient g (M, N) small, as a loss's is."""
  keys = jax.random.split(jax.random.key(seed), 3)
  x, w = heavy(keys[0], (m, k)), (jax.random.normal(keys[1], (k, n)) / np.sqrt(k))
  g = heavy(keys[2], (m, n)) * 1e-4
  return {"fwd": (x, w.astype(jnp.bfloat16)), "grad_lhs": (g, w.astype(jnp.bfloat16)),
          "grad_rhs": (x, g)}[pass_name]
