"""Fused-epilogue kernels as probe candidates (interpret mode on the CPU): where they are
candidates, their errors against a float64 numpy chain on fresh random inputs, and their
timings against the bf16 chain's from a timing table."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import loka_jax
from loka_jax.kernels import KernelPlan
from loka_jax.models import SiteConfig
from loka_jax.models.fused import FusedDenseNormAct
from loka_jax.models.site import DenseSite

from loka_jax.kernels import PASSES, registry
from loka_jax.models.fused import Chain
from loka_jax.precision import BF16, E4M3, ROWWISE, scaling
from loka_jax.probe import chain_timing, chains, evaluate, kernel_timing, timing_table
from loka_jax.probe.layout import site_layout

RELU = "pallas_fp8_rowwise_fused_relu"
M, K, N = 32, 48, 24


def _unsupported(chain, kernel=RELU, shapes=((M, K), (K, N))):
  layout = site_layout("mk,kn->mn", "act_weight", *shapes)
  return evaluate.unsupported_passes(layout, [registry.get(kernel)], chain)


def _sqnr_db(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return 10 * np.log10(np.sum(ref ** 2) / np.sum((out - ref) ** 2))


class WhereTest(absltest.TestCase):

  def test_only_a_chain_with_the_kernels_epilogue_admits_it(self):
    self.assertEqual(_unsupported(Chain(None, "relu", epsilon=1e-3, use_bias=False)),
                     {p: {} for p in PASSES})
    plain = _unsupported(None)
    self.assertRegex(plain["fwd"][RELU], "only at a fused Mods layer .* plain product")
    other = _unsupported(Chain(None, "hard_swish"))
    self.assertIn("computes no norm -> relu, this site's chain no norm -> hard_swish",
                  other["grad_rhs"][RELU])
    block = _unsupported(Chain(256, "relu"))
    self.assertIn("this site's chain BlockNorm(256) -> relu", block["fwd"][RELU])
    quant = "pallas_fp8_rowwise_fused_relu_quant"
    forward_only = _unsupported(Chain(None, "relu", quantize_output=True), quant)
    self.assertEqual(forward_only["fwd"], {})
    self.assertIn("forward only", forward_only["grad_lhs"][quant])


class ErrorsTest(absltest.TestCase):

  def test_errors_are_the_chains_against_float64_numpy(self):
    """Three fresh samples: the evaluator's SQNR of each pass is the one numpy computes
    between the fused kernel's own outputs (run here, outside the evaluator) and the chain in
    float64: relu(x W), and d x = (g * [pre > 0]) W^T, d W = x^T (g * [pre > 0]) at the
    kernel's pre-norm value `pre`, which is x W of the e4m3 rowwise operands."""
    keys = jax.random.split(jax.random.key(7), 4)
    rows = jnp.exp(jax.random.normal(keys[0], (3, M, 1)))
    x = jax.random.normal(keys[1], (3, M, K)) * rows
    w = jax.random.normal(keys[2], (3, K, N)) / np.sqrt(K)
    g = jax.random.normal(keys[3], (3, M, N))
    chain = Chain(None, "relu")
    evaluator = evaluate.chain_evaluator(RELU, PASSES, "mk,kn->mn", "bfloat16", chain)
    got = jax.device_get(evaluator(x, w, g, None))
    kernel = registry.get(RELU)

    def fused(a, b, dy):
      a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
      y, vjp = jax.vjp(lambda a, b: chains.run(kernel, a, b, chain, jnp.bfloat16), a, b)
      return (y, *vjp(dy.astype(y.dtype)), chains.pre_norm(kernel, a, b, chain))
    outs = jax.device_get(jax.jit(jax.vmap(fused))(x, w, g))
    for i in range(3):
      xs, ws, gs = (np.asarray(t[i], np.float64) for t in (x, w, g))
      pre = np.asarray(outs[3][i], np.float64)
      xq = scaling.quantize(x[i].astype(jnp.bfloat16), E4M3, ROWWISE, (1,)).dequantize()
      wq = scaling.quantize(w[i].astype(jnp.bfloat16), E4M3, ROWWISE, (0,)).dequantize()
      np.testing.assert_allclose(pre, np.asarray(xq, np.float64) @ np.asarray(wq, np.float64),
                                 rtol=1e-2, atol=1e-2 * np.std(pre))
      dz = gs * (pre > 0)
      refs = {"fwd": np.maximum(xs @ ws, 0), "grad_lhs": dz @ ws.T, "grad_rhs": xs.T @ dz}
      for j, p in enumerate(PASSES):
        want = _sqnr_db(outs[j][i], refs[p])
        self.assertAlmostEqual(float(got[p]["sqnr_db"][i]), want, delta=0.05, msg=p)
        self.assertGreater(want, 22.0, p)       # e4m3 rowwise, as the per-pass kernels
        self.assertTrue(bool(got[p]["finite"][i]))
      self.assertLess(float(got["fwd"]["underflow_a"][i]), 0.01)


class TimingTest(absltest.TestCase):

  def test_speedups_are_over_the_bf16_chain_filed_beside_the_kernel(self):
    layout = site_layout("mk,kn->mn", "act_weight", (M, K), (K, N))
    problems = {p: kernel_timing.pass_problem(layout, p) for p in PASSES}
    base = chain_timing.baseline_name(RELU)
    times = {RELU: {"fwd": 8.0, "grad_lhs": 20.0, "grad_rhs": 20.0},
             base: {"fwd": 10.0, "grad_lhs": 30.0, "grad_rhs": 30.0},
             "xla_bf16": {"fwd": 4.0, "grad_lhs": 5.0, "grad_rhs": 5.0}}
    entries = [{"kernel": k, "pass": p, "spec": problems[p][0], "lhs_shape": list(problems[p][1]),
                "rhs_shape": list(problems[p][2]), "dtype": "bfloat16", "median_us": us,
                "ci_us": [us, us], "backend": "test"}
               for k, per in times.items() for p, us in per.items()]
    table = timing_table.merge_entries(timing_table.empty_table("card"), entries)
    got = chain_timing.table_timings(layout, [registry.get("xla_bf16"), registry.get(RELU)],
                                     "bfloat16", table, unsupported={})
    self.assertEqual(got["fwd"][RELU]["speedup"], [1.25, 1.25, 1.25])   # 10 / 8, not 4 / 8
    self.assertEqual(got["grad_lhs"][RELU]["speedup"], [1.5, 1.5, 1.5])  # 30 / 20
    self.assertEqual(got["grad_rhs"][RELU]["time_scope"], "grad_lhs+grad_rhs")
    self.assertEqual(got["fwd"]["xla_bf16"]["time_us"], [4.0, 4.0, 4.0])


class Tower(nn.Module):
  """Dense -> ReLU as a fused Mods layer, then a plain head."""

  @nn.compact
  def __call__(self, x):
    config = SiteConfig(BF16, KernelPlan.uniform("xla_bf16"))
    x = FusedDenseNormAct(WIDE, config=config, block_size=None, activation="relu",
                          name="chain")(x)
    return DenseSite(1, config=config, name="head")(x)


WIDE = 32


class ProbeTest(absltest.TestCase):

  def test_the_probe_finds_the_chain_and_judges_the_kernel_there_only(self):
    model = Tower()
    keys = jax.random.split(jax.random.key(1), 2)
    batches = [{"x": jax.random.normal(k, (16, 24)), "y": jnp.ones((16, 1))} for k in keys]
    variables = jax.jit(model.init)(jax.random.key(0), batches[0]["x"])
    loss = lambda out, batch: jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)
    report = loka_jax.probe(model, variables, batches, loss, apply_fn=lambda v, b: model.apply(
        v, b["x"]), kernels=("xla_bf16", RELU, "pallas_fp8_rowwise_fused_hard_swish"),
                            samples=4, policy=None)
    chain = report["sites"]["chain"]
    self.assertEqual(chain["chain"], {"block_size": None, "activation": "relu",
                                      "quantize_output": False, "epsilon": 1e-6,
                                      "use_bias": True})
    for p in PASSES:
      entry = chain["passes"][p][RELU]
      self.assertGreater(entry["sqnr_db"][0], 20.0, p)
      self.assertIn("lhs" if p != "grad_lhs" else "grad", entry["operands"])
      self.assertIn("this site's chain no norm -> relu",
                    chain["passes"][p]["pallas_fp8_rowwise_fused_hard_swish"]["error"])
      self.assertIn("plain product", report["sites"]["head"]["passes"][p][RELU]["error"])
    self.assertNotIn("chain", report["sites"]["head"])


if __name__ == "__main__":
  absltest.main()
