"""FusedDenseNormAct: the fused form (one Pallas kernel, interpret mode on the CPU) against the
unfused form (the per-pass kernel it is made of, then BlockNorm and the activation), forward
and gradients, for every registered epilogue; epilogue and plan errors name the site; a plan
that fuses every fusable site of a model."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax.kernels import KernelChoice, KernelPlan
from loka_jax.models import SiteConfig, build_model, get_config, site_products
from loka_jax.models import fused as fused_lib
from loka_jax.models.fused import FusedDenseNormAct
from loka_jax.precision import FP32, QTensor, metrics
from loka_jax.models.tap import PROBE_GRAD_COLLECTION
from model_helpers import make_batch

SITE = "dense_0"
M_LEAD = (2, 8)      # 16 rows in leading dims
K = 40


def plan_for(fwd, grads):
  """The layer's site gets `fwd` forward and `grads` for dgrad and wgrad."""
  return KernelPlan(sites=((SITE, KernelChoice(fwd, grads, grads)),))


def apply_fn(plan, features, block_size, activation, quantize_output=False):
  """f(variables, x) running the layer as site `dense_0` with an fp32 policy."""
  module = FusedDenseNormAct(features, config=SiteConfig(FP32, plan), block_size=block_size,
                             activation=activation, quantize_output=quantize_output, name=SITE)
  return module.apply


def random_params(key, features, k=K, scale=0.3):
  k1, k2 = jax.random.split(key)
  return {"params": {"kernel": jax.random.normal(k1, (k, features)) / np.sqrt(k),
                     "bias": scale * jax.random.normal(k2, (features,))}}


def inputs(key, lead=M_LEAD, k=K):
  k1, k2 = jax.random.split(key)
  rows = jnp.exp(jax.random.normal(k2, lead + (1,)))          # rows of different scale
  return jax.random.normal(k1, lead + (k,)) * rows


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# The trainable registered epilogues: (block, activation, output width). 320 = a 256 block and
# a shorter 64 one. Both forms run dgrad and wgrad with xla_fp32 here, so the gradients check
# the epilogue's backward exactly (fused_dense's Pallas backward has its own tests).
TRAINABLE = (
    ("blocknorm256_hard_swish", 256, "hard_swish", 320),
    ("blocknorm256_relu", 256, "relu", 320),
    ("hard_swish", None, "hard_swish", 48),
    ("relu", None, "relu", 48),
)


class FusedAgreesWithUnfusedTest(chex.TestCase):

  @parameterized.named_parameters(*TRAINABLE)
  def test_forward_and_gradients(self, block, activation, features):
    kernel = fused_lib.fused_kernel_name(block, activation)
    self.assertIsNotNone(kernel)
    fused_plan = plan_for(kernel, "xla_fp32")
    unfused_plan = plan_for(fused_lib.FUSED_EQUIVALENT, "xla_fp32")
    params = random_params(jax.random.key(1), features)
    x = inputs(jax.random.key(2))
    cot = jax.random.normal(jax.random.key(3), M_LEAD + (features,))
    results = {}
    for form, plan in (("fused", fused_plan), ("unfused", unfused_plan)):
      f = apply_fn(plan, features, block, activation)
      loss = lambda p, x: jnp.sum(f(p, x) * cot)
      out, (g_params, g_x) = jax.jit(
          lambda p, x: (f(p, x), jax.grad(loss, argnums=(0, 1))(p, x)))(params, x)
      chex.assert_shape(out, M_LEAD + (features,))
      chex.assert_tree_all_finite((out, g_params, g_x))
      results[form] = (out, g_params["params"], g_x)
    (out_f, gp_f, gx_f), (out_u, gp_u, gx_u) = results["fused"], results["unfused"]
    self.assertLess(rel_err(out_f, out_u), 1e-5)
    if block is not None:  # the norm really ran: every block of the output is O(1)
      self.assertLess(float(jnp.max(jnp.abs(out_f))), 8.0)
    for name, g, r in (("dbias", gp_f["bias"], gp_u["bias"]), ("dx", gx_f, gx_u),
                       ("dkernel", gp_f["kernel"], gp_u["kernel"])):
      self.assertGreater(float(jnp.max(jnp.abs(g))), 0.0, name)
      self.assertLess(rel_err(g, r), 1e-4, name)

  def test_backward_kernel_of_a_plan(self):
    kernel = "pallas_fp8_rowwise_fused_relu"
    self.assertEqual(fused_lib.backward_kernel(KernelChoice.uniform(kernel), SITE),
                     "pallas_fp8_rowwise")                    # fused for all passes
    self.assertEqual(fused_lib.backward_kernel(KernelChoice(kernel, "xla_fp8_rowwise",
                                                            "xla_fp8_rowwise"), SITE),
                     "xla_fp8_rowwise")

  def test_quantized_chain(self):
    """blocknorm256_hard_swish_quant emits a QTensor that relu_quant consumes: fused
    end to end versus the unfused forms (library quantization, dequantized input)."""
    first = (256, "hard_swish", 320)
    second = (None, "relu", 48)
    p1 = random_params(jax.random.key(4), 320)
    p2 = random_params(jax.random.key(5), 48, k=320)
    x = inputs(jax.random.key(7))
    outs = {}
    for form in ("fused", "unfused"):
      steps = []
      for block, act, feats in (first, second):
        kernel = fused_lib.fused_kernel_name(block, act, quantize_output=True)
        plan = plan_for(kernel if form == "fused" else fused_lib.FUSED_EQUIVALENT,
                        kernel if form == "fused" else "xla_fp32")
        steps.append(apply_fn(plan, feats, block, act, quantize_output=True))
      h = jax.jit(steps[0])(p1, x)
      y = jax.jit(steps[1])(p2, h)
      outs[form] = (h, y)
    for h, y in outs.values():
      for q in (h, y):
        self.assertIsInstance(q, QTensor)
        self.assertEqual((q.granularity, q.data.dtype), ("rowwise", jnp.float8_e4m3fn))
    (h_f, y_f), (h_u, y_u) = outs["fused"], outs["unfused"]
    chex.assert_shape(h_f.data, M_LEAD + (320,))
    chex.assert_shape(y_f.data, M_LEAD + (48,))
    np.testing.assert_allclose(np.asarray(h_f.scale), np.asarray(h_u.scale), rtol=1e-4)
    same = float(jnp.mean(h_f.data.astype(jnp.float32) == h_u.data.astype(jnp.float32)))
    self.assertGreater(same, 0.98)          # e4m3 codes differ only at rounding boundaries
    self.assertGreater(float(metrics.sqnr_db(y_f.dequantize(), y_u.dequantize())), 25.0)


class PlanErrorsTest(chex.TestCase):

  def init(self, plan, block, activation, quantize_output=False, features=32):
    f = apply_fn(plan, features, block, activation, quantize_output)
    x = inputs(jax.random.key(0))
    params = random_params(jax.random.key(1), features)
    return jax.eval_shape(f, params, x)

  def test_block_mismatch_names_the_site(self):
    kernel = "pallas_fp8_rowwise_fused_blocknorm256_hard_swish"
    with self.assertRaisesRegex(ValueError, rf"site {SITE}: fused kernel {kernel} computes "
                                r"BlockNorm\(256\) -> hard_swish, but the layer computes "
                                r"BlockNorm\(16\) -> hard_swish; no registered fused kernel"):
      self.init(plan_for(kernel, kernel), 16, "hard_swish")

  def test_activation_and_quantization_mismatch_suggest_the_right_kernel(self):
    kernel = "pallas_fp8_rowwise_fused_blocknorm256_relu"
    with self.assertRaisesRegex(ValueError, f"site {SITE}.*use "
                                "pallas_fp8_rowwise_fused_blocknorm256_hard_swish for this site"):
      self.init(plan_for(kernel, kernel), 256, "hard_swish")
    with self.assertRaisesRegex(ValueError, "e4m3 rowwise output.*use "
                                "pallas_fp8_rowwise_fused_relu for this site"):
      self.init(plan_for("pallas_fp8_rowwise_fused_relu_quant", "xla_fp32"), None, "relu")
    with self.assertRaisesRegex(ValueError, "swish.*give this site a per-pass kernel"):
      self.init(plan_for("pallas_fp8_rowwise_fused_relu", "xla_fp32"), None, "swish")

  def test_backward_must_be_one_per_pass_kernel(self):
    kernel = "pallas_fp8_rowwise_fused_relu"
    plan = KernelPlan(sites=((SITE, KernelChoice(kernel, "xla_fp32", "xla_bf16")),))
    with self.assertRaisesRegex(ValueError, rf"site {SITE}: .*grad_lhs='xla_fp32', "
                                "grad_rhs='xla_bf16'"):
      self.init(plan, None, "relu")
    plan = plan_for(kernel, "flax_fp8_delayed")
    with self.assertRaisesRegex(ValueError, rf"site {SITE}: .*needs a per-pass kernel"):
      self.init(plan, None, "relu")
    plan = plan_for(kernel, "pallas_fp8_batched")   # cannot run a 2-D dense product
    with self.assertRaisesRegex(ValueError, rf"site {SITE}: backward kernel"):
      self.init(plan, None, "relu")

  def test_plain_sites_refuse_fused_kernels(self):
    kernel = "pallas_fp8_rowwise_fused_relu"
    plan = KernelPlan(sites=(("top_mlp/dense_2", KernelChoice.uniform(kernel)),))
    module = build_model(get_config("dlrm", "tiny"), get_config("dlrm", "tiny").features,
                         SiteConfig(FP32, plan))
    batch = make_batch(module.features, size=4)
    with self.assertRaisesRegex(ValueError, "site top_mlp/dense_2.*Mods layer"):
      jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)


class ProbeFallbackTest(chex.TestCase):

  def test_probe_gradients_see_the_fused_sites_product(self):
    kernel = fused_lib.fused_kernel_name(None, "relu")
    f = apply_fn(plan_for(kernel, "xla_fp32"), 48, None, "relu")
    params = random_params(jax.random.key(8), 48)
    x = inputs(jax.random.key(9))
    out = jax.jit(f)(params, x)
    probed, state = jax.jit(lambda p, x: f(p, x, mutable=[PROBE_GRAD_COLLECTION]))(params, x)
    self.assertLess(rel_err(probed, out), 1e-5)       # the same numbers, unfused
    perturbation = state[PROBE_GRAD_COLLECTION]["out"]
    chex.assert_shape(perturbation, (16, 48))          # the product, before bias and norm
    cot = jax.random.normal(jax.random.key(10), out.shape)
    grads = jax.grad(lambda pert: jnp.sum(f({**params, PROBE_GRAD_COLLECTION: {"out": pert}},
                                            x) * cot))(perturbation)
    # d loss / d product = cot * relu'(z): zero where the unit is off, cot where it is on.
    on = np.asarray(out.reshape(16, 48) > 0)
    np.testing.assert_allclose(np.asarray(grads)[on], np.asarray(cot.reshape(16, 48))[on],
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grads)[~on], 0.0)


class ModelPlanTest(chex.TestCase):

  def test_fused_plan_covers_every_activated_mlp_layer(self):
    config = get_config("dlrm", "tiny")          # relu MLPs without norm: fused relu kernels
    base = KernelPlan.uniform("xla_fp8_tensorwise")
    module = build_model(config, config.features, SiteConfig(FP32, base))
    batch = make_batch(module.features, size=4)
    plan, chosen = fused_lib.fused_plan(module, batch, base)
    self.assertEqual(chosen, {s: "pallas_fp8_rowwise_fused_relu" for s in (
        "bottom_mlp/dense_0", "bottom_mlp/dense_1", "top_mlp/dense_0", "top_mlp/dense_1")})
    self.assertEqual(plan.choice_for("top_mlp/dense_2"), base.default)
    fused_model = build_model(config, config.features, SiteConfig(FP32, plan))
    names = list(site_products(fused_model, None, batch))
    self.assertEqual(names, list(site_products(module, None, batch)))   # names unchanged
    logits = jax.eval_shape(fused_model.init, jax.random.PRNGKey(0), batch)
    self.assertIn("params", logits)

  def test_tiny_blocknorm_has_no_fused_kernel(self):
    config = get_config("wukong", "tiny")
    config.mods.blocknorm = config.mods.hard_swish = True     # block 16: no registered kernel
    base = KernelPlan.uniform("xla_bf16")
    module = build_model(config, config.features, SiteConfig(FP32, base))
    plan, chosen = fused_lib.fused_plan(module, make_batch(module.features, size=4), base)
    self.assertEqual(chosen, {})
    self.assertEqual(plan, base)
    config.mods.block_size = 256                               # a one-block BlockNorm of 32
    module = build_model(config, config.features, SiteConfig(FP32, base))
    _, chosen = fused_lib.fused_plan(module, make_batch(module.features, size=4), base)
    self.assertIn("layer_0/fmb/mlp/dense_0", chosen)
    self.assertEqual(set(chosen.values()), {"pallas_fp8_rowwise_fused_blocknorm256_hard_swish"})


if __name__ == "__main__":
  absltest.main()
