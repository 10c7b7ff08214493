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


SITE_SQNR_DB = 18.0
# The interaction einsums of the towers: Wukong's FMB (two widths) and DLRM's dot interaction.
BATCHED_SHAPES = [
    ("bnd,bdk->bnk", (4096, 16, 128), (4096, 128, 24)),
    ("bnd,bdk->bnk", (4096, 96, 128), (4096, 128, 96)),
    ("bfd,bgd->bfg", (1024, 27, 128), (1024, 27, 128)),
]


def check_batched_pass(kernel_name, spec_text, lhs, rhs, pass_name, rtol):
  """A batched kernel's pass on heavy-tailed operands: SQNR >= SITE_SQNR_DB against the fp32
  HIGHEST product of the originals, and within rtol of the product of its own dequantized
  operands."""
  from kernels_pallas import products
  from loka_jax import kernels
  from loka_jax.kernels import EinsumSpec, reference_einsum
  from loka_jax.precision import metrics
  k1, k2, k3 = jax.random.split(jax.random.key(len(spec_text) + lhs[1]), 3)
  x, y = heavy(k1, lhs), heavy(k2, rhs)
  site = EinsumSpec.parse(spec_text)
  g = heavy(k3, site.shapes(lhs, rhs))
  a, b = {"fwd": (x, y), "grad_lhs": (g, y), "grad_rhs": (x, g)}[pass_name]
  spec = site.for_pass(pass_name)
  kernel = kernels.get(kernel_name)
  out = jax.jit(lambda a, b: kernel.einsum(spec, a, b, pass_name=pass_name,
                                           out_dtype=jnp.float32))(a, b)
  assert float(metrics.sqnr_db(out, reference_einsum(spec, a, b))) >= SITE_SQNR_DB
  da, db = products.dequantized_operands(spec, a, b, mode="rowwise", pass_name=pass_name,
                                         quantize=kernel.quantizer)
  close(out, reference_einsum(spec, da, db), rtol=rtol)
