"""Dispatch selects a fused-epilogue kernel where the whole chain is safe and faster, only at
a fused Mods layer with its epilogue, and the plan trains (interpret mode on the CPU) as the
unfused chain of the same kernels does."""
import copy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest

import report_builders as hm
from loka_jax.dispatch import selection
from loka_jax.kernels import KernelChoice, KernelPlan
from loka_jax.models import SiteConfig
from loka_jax.models import fused as fused_lib
from loka_jax.models.fused import Chain, FusedDenseNormAct
from loka_jax.models.site import DenseSite
from loka_jax.plan import check as plan_check
from loka_jax.precision import BF16, FP32
from loka_jax.probe.eligibility import Criteria

PASSES = hm.PASSES
RELU = "pallas_fp8_rowwise_fused_relu"
NORM_HSWISH = "pallas_fp8_rowwise_fused_blocknorm256_hard_swish"
SCOPE = {"time_scope": "grad_lhs+grad_rhs"}
ROWS, IN, WIDTH = 16, 24, 32


class Tower(nn.Module):
  """relu_layer: Dense -> ReLU (a relu chain); norm_layer: Dense -> BlockNorm(256) -> Hard
  Swish (another chain); head: a plain product."""
  config: SiteConfig

  @nn.compact
  def __call__(self, x):
    x = FusedDenseNormAct(WIDTH, config=self.config, block_size=None, activation="relu",
                          name="relu_layer")(x)
    x = FusedDenseNormAct(WIDTH, config=self.config, block_size=256,
                          activation="hard_swish", name="norm_layer")(x)
    return DenseSite(1, config=self.config, name="head")(x)


CHAINS = {"relu_layer": Chain(None, "relu"), "norm_layer": Chain(256, "hard_swish")}


def chain_entries(fwd_speed, bwd_speed, grad_sqnr=30.0):
  """A fused-epilogue kernel's entries: the forward against the bf16 chain's 150 us, the
  backward timed once for both gradients against its 300 us."""
  return {"fwd": hm.entry(speedup=fwd_speed, base_us=150.0),
          "grad_lhs": hm.entry(sqnr=grad_sqnr, speedup=bwd_speed, base_us=300.0, **SCOPE),
          "grad_rhs": hm.entry(sqnr=grad_sqnr, speedup=bwd_speed, base_us=300.0, **SCOPE)}


def tower_report(candidates):
  """A report of the Tower: every site's per-pass xla_fp8_rowwise (1.2x pessimistic: 50 us
  saved over the site's three 100 us passes) plus `candidates` {site: {kernel: entries}}."""
  sites = {}
  for name, (lhs, rhs) in {"relu_layer": ((ROWS, IN), (IN, WIDTH)),
                           "norm_layer": ((ROWS, WIDTH), (WIDTH, WIDTH)),
                           "head": ((ROWS, WIDTH), (WIDTH, 1))}.items():
    passes = {p: {"xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.3, 1.4))} for p in PASSES}
    for kernel, entries in candidates.get(name, {}).items():
      for p in PASSES:
        passes[p][kernel] = copy.deepcopy(entries[p])
    sites[name] = hm.site(passes, lhs=lhs, rhs=rhs)
    if name in CHAINS:
      sites[name]["chain"] = {"block_size": CHAINS[name].block_size,
                              "activation": CHAINS[name].activation,
                              "quantize_output": False, "epsilon": 1e-6, "use_bias": True}
  return hm.report(sites)


def kernels_of(plan, site):
  return {p: plan["sites"][site][p]["kernel"] for p in PASSES}


FAST = chain_entries((1.5, 1.6, 1.7), (1.3, 1.4, 1.5))   # saves 50 + 69.2 us of 450


class SelectTest(absltest.TestCase):

  def test_the_chain_is_chosen_where_safe_and_faster_and_only_for_its_own_epilogue(self):
    # The relu kernel looks safe and fast at both chains; only relu_layer's is a relu chain.
    plan = selection.select(tower_report({"relu_layer": {RELU: FAST},
                                          "norm_layer": {RELU: FAST},
                                          "head": {RELU: FAST}}), Criteria())
    self.assertEqual(kernels_of(plan, "relu_layer"), {p: RELU for p in PASSES})
    reason = plan["sites"]["relu_layer"]["fwd"]["reason"]
    self.assertIn("fused chain safe in every pass and faster", reason)
    self.assertIn("the chain 330.8 us vs bf16's 450.0 us (1.36x", reason)
    self.assertIn("saving 119.2 us where the site's other choice saves 50.0 us", reason)
    self.assertEqual(set(kernels_of(plan, "norm_layer").values()), {"xla_fp8_rowwise"})
    self.assertNotIn(RELU, kernels_of(plan, "head").values())
    # norm_layer's own epilogue is chosen there.
    plan = selection.select(tower_report({"norm_layer": {NORM_HSWISH: FAST}}), Criteria())
    self.assertEqual(kernels_of(plan, "norm_layer"), {p: NORM_HSWISH for p in PASSES})

  def test_a_chain_that_saves_less_or_is_unsafe_or_slow_is_not_chosen(self):
    cases = {"saves 25.5 us < 50": chain_entries((1.06, 1.1, 1.15), (1.06, 1.1, 1.15)),
             "gradients at 15 dB": chain_entries((3.0, 3.1, 3.2), (3.0, 3.1, 3.2), 15.0),
             "under the speed bar": chain_entries((1.0, 1.2, 1.4), (1.0, 1.2, 1.4))}
    for why, entries in cases.items():
      plan = selection.select(tower_report({"relu_layer": {RELU: entries}}), Criteria())
      self.assertEqual(set(kernels_of(plan, "relu_layer").values()), {"xla_fp8_rowwise"}, why)
    # Serving plans leave fused-epilogue kernels out: the export runs its own product.
    plan = selection.select(tower_report({"relu_layer": {RELU: FAST}}), Criteria(),
                            objective="serve")
    self.assertEqual(plan["sites"]["relu_layer"]["fwd"]["kernel"], "xla_fp8_rowwise")


class TrainTest(absltest.TestCase):

  def test_the_selected_plan_trains_fused_as_the_unfused_chain_does(self):
    """The plan's relu_layer runs as one Pallas kernel (its pallas_call in the step's jaxpr)
    and matches the unfused chain of the kernels it is made of (pallas_fp8_rowwise in every
    pass) over 3 SGD steps and on held-out data, with an fp32 compute policy: losses and
    parameters within 1e-4 (the two forms compute the same numbers; under a bf16 policy the
    bias gradient differs in its last bits, summed in float32 by the fused backward and in
    bf16 by XLA, and FP8 rounding of later operands spreads that to ~2% in 3 steps)."""
    plan = selection.select(tower_report({"relu_layer": {RELU: FAST}}), Criteria())
    fused_plan = plan.kernel_plan()
    self.assertEqual(fused_plan.choice_for("relu_layer"), KernelChoice.uniform(RELU))
    unfused_plan = KernelPlan(    # the same plan, relu_layer's chain unfused
        sites=(("relu_layer", KernelChoice.uniform(fused_lib.FUSED_EQUIVALENT)),)
        + fused_plan.sites, rules=fused_plan.rules, default=fused_plan.default)
    keys = jax.random.split(jax.random.key(3), 4)
    x, x_held = (jax.random.normal(k, (ROWS, IN)) for k in keys[:2])
    y, y_held = (jax.random.normal(k, (ROWS, 1)) for k in keys[2:])
    baseline = Tower(SiteConfig(BF16, KernelPlan.uniform("xla_bf16")))
    params = baseline.init(jax.random.key(0), x)
    products = plan_check.model_sites(baseline, params, x)
    self.assertEqual(plan_check.plan_problems(fused_plan, *products), [])

    def run(kernel_plan):
      model = Tower(SiteConfig(FP32, kernel_plan))
      loss = lambda p, a, b: jnp.mean((model.apply(p, a).astype(jnp.float32) - b) ** 2)
      opt = optax.sgd(0.1)

      @jax.jit
      def step(p, s):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value
      p, s, losses = params, opt.init(params), []
      for _ in range(3):
        p, s, value = step(p, s)
        losses.append(float(value))
      jaxpr = str(jax.make_jaxpr(jax.grad(loss))(p, x, y))
      return losses, float(jax.jit(loss)(p, x_held, y_held)), p, jaxpr

    fused, unfused = run(fused_plan), run(unfused_plan)
    self.assertIn("pallas_fp8_rowwise_fused", fused[3])
    self.assertNotIn("pallas_fp8_rowwise_fused", unfused[3])
    np.testing.assert_allclose(fused[0], unfused[0], rtol=1e-4)
    self.assertLess(fused[0][-1], fused[0][0])                     # it trains
    np.testing.assert_allclose(fused[1], unfused[1], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(fused[2]), jax.tree.leaves(unfused[2])):
      self.assertLess(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)), 1e-4)


if __name__ == "__main__":
  absltest.main()
