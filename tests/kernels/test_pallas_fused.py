"""fused_dense (interpret mode) against its unfused reference, its custom_vjp against
jax.grad of the reference, the kernels inside DenseSite plans, and the tuning cache."""
import functools
import json
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import chex

from kernels_pallas import fused, tuning
from kernels_pallas import gemm as gemm_lib
from kernels_pallas import quantize as kq
from loka_jax import timing
from loka_jax.models import ActSite, DenseSite, SiteConfig
from loka_jax.precision import E4M3, QTensor, metrics, scaling


# Jitted, as are the products below: op by op, each eager step compiles a small program of
# its own, which on the CPU cost more than the interpret-mode kernels themselves.
@functools.partial(jax.jit, static_argnames=("m", "k", "n"))
def _inputs(seed, m=48, k=200, n=96):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (m, k)) * jnp.exp(jax.random.normal(keys[3], (m, 1)))
  w = jax.random.normal(keys[1], (k, n)) / np.sqrt(k)
  bias = jax.random.normal(keys[2], (n,))
  return x, w, bias


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


class FusedDenseTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("blocknorm_hard_swish", dict(block_size=32, activation="hard_swish")),
      ("bias_relu", dict(activation="relu", use_bias=True)),
      ("bias_blocknorm64_identity", dict(block_size=64, use_bias=True)),
  )
  def test_matches_reference(self, options):
    options = dict(options)
    x, w, bias = _inputs(1)
    bias = bias if options.pop("use_bias", False) else None
    out, ref = jax.jit(lambda x, w, bias: (
        fused.fused_dense(x, w, bias=bias, out_dtype=jnp.float32, **options),
        fused.fused_dense_reference(x, w, bias=bias, out_dtype=jnp.float32,
                                    quantizer=kq.quantize, **options)))(x, w, bias)
    chex.assert_shape(out, (48, 96))
    self.assertTrue(bool(jnp.all(jnp.isfinite(out))))
    self.assertLess(_rel_err(out, ref), 1e-5)

  def test_quantized_chain(self):
    """Layer 1 emits a rowwise e4m3 QTensor that layer 2 consumes without a quantize pass."""
    x, w1, b1 = _inputs(2, k=136, n=96)
    w2 = jax.random.normal(jax.random.key(3), (96, 40)) / np.sqrt(96)
    kw = dict(block_size=32, activation="hard_swish")
    h, h_ref = jax.jit(lambda x, w1, b1: (
        fused.fused_dense(x, w1, bias=b1, quantize_output=True, **kw),
        fused.fused_dense_reference(x, w1, bias=b1, quantize_output=True,
                                    quantizer=kq.quantize, **kw)))(x, w1, b1)
    self.assertIsInstance(h, QTensor)
    self.assertEqual((h.granularity, h.axis, h.data.dtype), ("rowwise", (1,), E4M3.dtype))
    np.testing.assert_allclose(np.asarray(h.scale), np.asarray(h_ref.scale), rtol=1e-5)
    same = jnp.mean(h.data.astype(jnp.float32) == h_ref.data.astype(jnp.float32))
    self.assertGreater(float(same), 0.99)  # codes differ only on rounding boundaries
    out, ref = jax.jit(lambda h, w2: (
        fused.fused_dense(h, w2, activation="relu", out_dtype=jnp.float32),
        fused.fused_dense_reference(h, w2, activation="relu", out_dtype=jnp.float32,
                                    quantizer=kq.quantize)))(h, w2)
    self.assertLess(_rel_err(out, ref), 1e-5)
    with self.assertRaisesRegex(ValueError, "forward-only"):
      jax.grad(lambda x: jnp.sum(fused.fused_dense(x, w1, quantize_output=True).scale))(x)

  def test_leading_dims_and_bf16(self):
    x, w, bias = _inputs(4, m=2 * 24, k=72, n=64)
    x = x.reshape((2, 24, 72)).astype(jnp.bfloat16)
    out, ref = jax.jit(lambda x, w, bias: (
        fused.fused_dense(x, w, bias=bias, block_size=32, activation="hard_swish"),
        fused.fused_dense_reference(x, w, bias=bias, block_size=32, activation="hard_swish",
                                    out_dtype=jnp.float32, quantizer=kq.quantize)))(x, w, bias)
    chex.assert_shape(out, (2, 24, 64))
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertLess(_rel_err(out, ref), 1e-2)  # bf16 output rounding

  @parameterized.named_parameters(("fp32_backward", "xla_fp32", 1e-5, None),
                                  ("pallas_fp8_backward", "pallas_fp8_rowwise", None, 25.0))
  def test_gradients(self, backward, rtol, min_sqnr):
    x, w, bias = _inputs(5)
    cot = jax.random.normal(jax.random.key(6), (48, 96))
    kw = dict(block_size=32, activation="hard_swish", out_dtype=jnp.float32)

    def loss(fn, **extra):
      return lambda x, w, b: jnp.sum(fn(x, w, bias=b, **kw, **extra) * cot)

    got, want = jax.jit(lambda x, w, bias: (
        jax.grad(loss(fused.fused_dense, backward=backward), argnums=(0, 1, 2))(x, w, bias),
        jax.grad(loss(fused.fused_dense_reference, quantizer=kq.quantize),
                 argnums=(0, 1, 2))(x, w, bias)))(x, w, bias)
    for name, g, r in zip(("dx", "dw", "dbias"), got, want):
      chex.assert_shape(g, r.shape)
      self.assertTrue(bool(jnp.all(jnp.isfinite(g))), name)
      if rtol is not None or name == "dbias":  # dbias never goes through an FP8 product
        self.assertLess(_rel_err(g, r), rtol or 1e-5, name)
      else:
        self.assertGreater(float(metrics.sqnr_db(g, r)), min_sqnr, name)

  def test_bad_inputs_raise(self):
    x, w, bias = _inputs(7)
    with self.assertRaisesRegex(ValueError, "weight must be"):
      fused.fused_dense(x, w.T)
    with self.assertRaisesRegex(ValueError, "bias must be"):
      fused.fused_dense(x, w, bias=bias[:5])
    q = scaling.quantize(x, E4M3, "block_1x128", (1,))
    with self.assertRaisesRegex(ValueError, "rowwise"):
      fused.fused_dense(q, w)


class SiteIntegrationTest(absltest.TestCase):

  def test_dense_site_trains_with_pallas_plan(self):
    config = SiteConfig.for_precision("fp8_all", kernel="pallas_fp8_rowwise")
    site = DenseSite(features=96, config=config, name="mlp_0")
    x, _, _ = _inputs(8, m=40, k=72)
    params = jax.jit(site.init)(jax.random.key(0), x)
    out = jax.jit(site.apply)(params, x)
    chex.assert_shape(out, (40, 96))
    w = params["params"]["kernel"]
    xq = scaling.quantize(x.astype(jnp.bfloat16), E4M3, "rowwise", (1,)).dequantize()
    wq = scaling.quantize(w.astype(jnp.bfloat16), E4M3, "rowwise", (0,)).dequantize()
    ref = jnp.dot(xq, wq, precision=jax.lax.Precision.HIGHEST)
    self.assertLess(_rel_err(out, ref), 1e-2)  # bf16 output
    grads, exact = jax.jit(lambda params: (
        jax.grad(lambda p: jnp.sum(site.apply(p, x).astype(jnp.float32) ** 2))(params),
        jax.grad(lambda p: jnp.sum((x @ p["params"]["kernel"] + p["params"]["bias"]) ** 2))(
            jax.tree_util.tree_map(lambda v: v.astype(jnp.float32), params))))(params)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(exact)):
      self.assertTrue(bool(jnp.all(jnp.isfinite(g))))
      self.assertGreater(float(metrics.sqnr_db(g, r)), 18.0)

  def test_act_site_batched_and_plan_errors(self):
    site = ActSite(spec="bnd,bdk->bnk",
                   config=SiteConfig.for_precision("fp8_all", kernel="pallas_fp8_batched"),
                   name="fmb")
    k1, k2 = jax.random.split(jax.random.key(9))
    a, b = jax.random.normal(k1, (2, 16, 40)), jax.random.normal(k2, (2, 40, 24))
    out = site.apply({}, a, b)
    ref = jnp.einsum("bnd,bdk->bnk", a, b)
    self.assertGreater(float(metrics.sqnr_db(out, ref)), 25.0)
    wrong = DenseSite(features=8, name="dense",
                      config=SiteConfig.for_precision("fp8_all", kernel="pallas_fp8_batched"))
    with self.assertRaisesRegex(ValueError, "no batch index"):
      wrong.init(jax.random.key(0), jnp.ones((4, 8)))


class TuningCacheTest(absltest.TestCase):

  def test_record_lookup_and_cpu_guard(self):
    with tempfile.TemporaryDirectory() as tmp:
      old = os.environ.get(tuning.ENV_DIR)
      os.environ[tuning.ENV_DIR] = tmp
      tuning.clear_memory()
      try:
        self.assertIsNone(tuning.cached("pallas_fp8_rowwise", "key"))
        cfg = tuning.TileConfig(64, 128, 128, 1, 8, 4, 1)
        tuning.record("pallas_fp8_rowwise", "key", cfg, 12.5)
        tuning.clear_memory()  # read back from disk
        self.assertEqual(tuning.cached("pallas_fp8_rowwise", "key"), cfg)
        with open(tuning.cache_path()) as f:
          data = json.load(f)
        self.assertEqual(data["schema"], tuning.SCHEMA)
        self.assertTrue(tuning.cache_path().endswith("cpu.json"))
        default = tuning.TileConfig()
        self.assertEqual(tuning.choose("other", "key", default, [cfg]), default)
        with self.assertRaisesRegex(RuntimeError, "GPU"):
          tuning.tune("pallas_fp8_rowwise", "key", [cfg], lambda c: (jnp.sin, (jnp.ones(4),)))
      finally:
        if old is None:
          os.environ.pop(tuning.ENV_DIR, None)
        else:
          os.environ[tuning.ENV_DIR] = old
        tuning.clear_memory()

  def test_shipped_table_backs_the_user_cache(self):
    """A device kind's shipped winners apply when the user's cache has no entry, and the
    user's own tuning overrides them."""
    with open(tuning.shipped_path("NVIDIA_H200")) as f:
      shipped = json.load(f)
    self.assertEqual(shipped["schema"], tuning.SCHEMA)
    kernel, entries = next(iter(sorted(shipped["entries"].items())))
    key, entry = next(iter(sorted(entries.items())))
    with tempfile.TemporaryDirectory() as tmp, \
        mock.patch.object(tuning._compat, "device_kind", lambda: "NVIDIA_H200"), \
        mock.patch.dict(os.environ, {tuning.ENV_DIR: tmp}):
      tuning.clear_memory()
      try:
        self.assertEqual(tuning.cached(kernel, key), tuning.TileConfig.from_dict(entry["config"]))
        self.assertIsNone(tuning.cached(kernel, "no such shape"))
        default = tuning.TileConfig()
        self.assertEqual(tuning.choose(kernel, key, default, []),
                         tuning.TileConfig.from_dict(entry["config"]))
        with mock.patch.dict(os.environ, {"LOKA_PALLAS_FP8_IMPRECISE_ACC": "128"}):
          self.assertEqual(tuning.choose(kernel, key, default, []), default)
        mine = tuning.TileConfig(16, 32, 32, 1, 2, 2, 1)
        tuning.record(kernel, key, mine, 1.0)
        tuning.clear_memory()
        self.assertEqual(tuning.cached(kernel, key), mine)
      finally:
        tuning.clear_memory()

  def test_time_call_runs_a_kernel_in_one_jitted_loop(self):
    """The tuner's timing path: a GEMM candidate as (fn, args), run `inner` times in one jitted
    loop (here interpreted on the CPU), gives a positive per-call time."""
    key = jax.random.key(7)
    a = jax.random.normal(key, (1, 48, 80)).astype(E4M3.dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (1, 80, 64)).astype(E4M3.dtype)
    sa = jnp.full((1, 48), 0.5, jnp.float32)
    sb = jnp.full((1, 64), 0.25, jnp.float32)
    cfg = tuning.TileConfig(32, 64, 64, 1, 4, 2, 1)
    fn = functools.partial(gemm_lib.gemm, config=cfg)
    t = tuning.time_call(fn, (a, b, sa, sb), repeats=2, inner=3)
    self.assertGreater(t, 0.0)
    looped = jax.block_until_ready(timing.repeat_in_loop(fn, 3)(a, b, sa, sb))
    np.testing.assert_allclose(np.asarray(looped, np.float32),
                               np.asarray(fn(a, b, sa, sb), np.float32), rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
