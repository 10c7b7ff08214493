"""Closeness checks and the fused-dense gradient comparison shared by the kernel tests (the
CPU's interpret-mode ones and the GPU's compiled ones)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

RTOL = 1e-5


def rel_err(out, ref):
  """The largest absolute error relative to the largest |ref|."""
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def assert_close(test, out, ref, rtol=RTOL):
  """Same shape, every output finite (interpret mode leaves unwritten outputs NaN), and
  rel_err below rtol."""
  chex.assert_shape(out, ref.shape)
  test.assertTrue(bool(np.all(np.isfinite(np.asarray(out, np.float32)))),
                  "unwritten (NaN) or non-finite outputs")
  test.assertLess(rel_err(out, ref), rtol)


def fused_dense_against_reference(x, w, bias, cot, *, core, backward, quantizer, **kw):
  """(out, ref, grads, ref_grads): fused_dense on `core` and its unfused reference on the
  core's own `quantizer`, and the gradients of sum(out * cot) in (x, w, bias): the custom_vjp
  (dgrad and wgrad on `backward`) against jax.grad of the reference."""
  from kernels_pallas import fused

  def loss(fn, **extra):
    return lambda x, w, b: jnp.sum(fn(x, w, bias=b, **kw, **extra) * cot)

  return jax.jit(lambda x, w, bias: (
      fused.fused_dense(x, w, bias=bias, core=core, **kw),
      fused.fused_dense_reference(x, w, bias=bias, quantizer=quantizer, **kw),
      jax.grad(loss(fused.fused_dense, core=core, backward=backward),
               argnums=(0, 1, 2))(x, w, bias),
      jax.grad(loss(fused.fused_dense_reference, quantizer=quantizer),
               argnums=(0, 1, 2))(x, w, bias)))(x, w, bias)


def mosaic_shared_memory(fn, *args):
  """The shared memory in bytes that Mosaic GPU allocates for each kernel of fn(*args), as
  it sums it when lowering the kernel's launch for 'cuda' (no GPU needed)."""
  from unittest import mock
  from jax.experimental.mosaic.gpu import core as mosaic_core
  from kernels_pallas import mosaic_gemm
  # A private function of jax's Mosaic GPU: the one place it sums a kernel's buffers (an
  # AttributeError here after a jax upgrade means the sum moved).
  count, sizes = mosaic_core._smem_tree_size, []

  def record(tree):
    sizes.append(count(tree))
    return sizes[-1]

  with mock.patch.object(mosaic_core, "_smem_tree_size", record):
    mosaic_gemm.lowered_for_cuda(fn, *args)
  return sizes


def e4m3_steps(q, q_ref):
  """(fraction of codes that differ, the most e4m3 steps any code lies from its reference):
  an e4m3 code's low seven bits order its magnitude, so sign * those bits counts steps
  along the format's values (+0 and -0 are both step 0)."""
  def rank(codes):
    bits = np.asarray(codes).view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -1, 1) * (bits & 0x7F)
  steps = np.abs(rank(q) - rank(q_ref))
  return float(np.mean(steps > 0)), int(np.max(steps))


@functools.partial(jax.jit, static_argnames=("bt", "m", "n", "k"))
def mosaic_core_operands(key, bt, m, n, k):
  """The Mosaic GPU core's K-last e4m3 operands (bt, M, K) and (bt, N, K), per-row scales
  spread over two decades, and an (N,) bias."""
  keys = jax.random.split(key, 5)
  a = (jax.random.normal(keys[0], (bt, m, k)) * 4).astype(jnp.float8_e4m3fn)
  b = (jax.random.normal(keys[1], (bt, n, k)) * 4).astype(jnp.float8_e4m3fn)
  sa = jnp.exp(jax.random.uniform(keys[2], (bt, m), minval=-2.3, maxval=2.3))
  sb = jnp.exp(jax.random.uniform(keys[3], (bt, n), minval=-2.3, maxval=2.3))
  return a, b, sa, sb, jax.random.normal(keys[4], (n,))
