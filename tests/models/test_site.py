"""GEMM sites: names, dtypes, parameters, plan lookup per site."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import kernels
from loka_jax.kernels import KernelChoice, KernelPlan
from loka_jax.models import ActSite, DenseSite, EinsumSite, SiteConfig
from loka_jax.precision import metrics
from loka_jax.models import tap as hooks


class TwoLayers(nn.Module):
  config: SiteConfig

  @nn.compact
  def __call__(self, x):
    h = DenseSite(24, config=self.config, name="first")(x)
    h = EinsumSite("bd,de->be", (24, 8), bias_axes="e", config=self.config, name="second")(h)
    return ActSite("be,ce->bc", config=self.config, name="gram")(h, h)


def _x(seed=0, shape=(16, 40)):
  return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _site_outputs(config, params, x):
  _, state = TwoLayers(config).apply(params, x, mutable=[hooks.PROBE_COLLECTION])
  return {name: v["lhs"][0] for name, v in state[hooks.PROBE_COLLECTION].items()}


class SiteTest(parameterized.TestCase):

  def test_parameter_names_match_flax_and_sites_sow_their_names(self):
    model = TwoLayers(SiteConfig())
    params = model.init(jax.random.PRNGKey(0), _x())
    chex.assert_trees_all_equal_shapes(
        params["params"], {"first": {"kernel": jnp.zeros((40, 24)), "bias": jnp.zeros((24,))},
                           "second": {"kernel": jnp.zeros((24, 8)), "bias": jnp.zeros((8,))}})
    _, state = model.apply(params, _x(), mutable=[hooks.PROBE_COLLECTION])
    self.assertEqual(sorted(state[hooks.PROBE_COLLECTION]), ["first", "gram", "second"])

  @parameterized.parameters("fp32", "bf16", "fp8_all")
  def test_output_dtype_follows_the_policy(self, precision):
    config = SiteConfig.for_precision(precision)
    model = TwoLayers(config)
    params = model.init(jax.random.PRNGKey(0), _x())
    out = model.apply(params, _x())
    chex.assert_type(out, config.policy.output_dtype)
    chex.assert_shape(out, (16, 16))
    self.assertEqual(params["params"]["first"]["kernel"].dtype, jnp.float32)

  def test_plan_picks_kernels_per_site(self):
    # 'second' exact entry, 'gram' by rule, 'first' by default: only 'second' is FP8, so only
    # the output of 'second' (the input of 'gram') carries FP8-sized error.
    exact = SiteConfig.for_precision("fp32")
    plan = KernelPlan(sites=(("second", KernelChoice.uniform("xla_fp8_tensorwise")),),
                      rules=(("gr.*", KernelChoice.uniform("xla_fp32")),),
                      default=KernelChoice.uniform("xla_fp32"))
    mixed = SiteConfig(exact.policy, plan)
    x = _x(1)
    params = TwoLayers(exact).init(jax.random.PRNGKey(0), x)
    ref = _site_outputs(exact, params, x)
    got = _site_outputs(mixed, params, x)
    self.assertGreater(float(metrics.sqnr_db(got["second"], ref["second"])),
                       100.0)  # input of 'second'
    fp8_err = float(metrics.sqnr_db(got["gram"], ref["gram"]))  # output of 'second'
    self.assertLess(fp8_err, 45.0)
    self.assertGreater(fp8_err, 18.0)

  def test_for_precision_arms_and_errors(self):
    self.assertEqual(SiteConfig.for_precision("bf16").plan.default.fwd, "xla_bf16")
    self.assertEqual(SiteConfig.for_precision("fp8_all", kernel="xla_fp8_rowwise").plan.default,
                     KernelChoice.uniform("xla_fp8_rowwise"))
    with self.assertRaisesRegex(KeyError, "unknown kernel"):
      SiteConfig.for_precision("fp8_all", kernel="no_such_kernel")
    with self.assertRaisesRegex(ValueError, "needs a plan"):
      SiteConfig.for_precision("loka")
    with self.assertRaisesRegex(ValueError, "unknown precision"):
      SiteConfig.for_precision("int8")

  def test_shape_mismatch_names_the_site(self):
    with self.assertRaisesRegex(ValueError, "index 'e' has size 8 in lhs but 5"):
      ActSite("be,ce->bc").init(jax.random.PRNGKey(0), jnp.ones((2, 8)), jnp.ones((3, 5)))

  def test_flax_delayed_site_keeps_state_in_fp8_meta(self):
    config = SiteConfig.for_precision("fp8_all", kernel="flax_fp8_delayed")
    model = DenseSite(8, config=config)
    variables = model.init(jax.random.PRNGKey(0), _x())
    self.assertIn(kernels.FP8_META, variables)
    self.assertIn("kernel_amax_history", variables[kernels.FP8_META]["fp8_op"])

  def test_plain_dense_equivalence_in_fp32(self):
    x = _x(2)
    site = DenseSite(12, config=SiteConfig.for_precision("fp32"))
    params = site.init(jax.random.PRNGKey(0), x)
    want = nn.Dense(12, precision=jax.lax.Precision.HIGHEST).apply(params, x)
    np.testing.assert_allclose(np.asarray(site.apply(params, x)), np.asarray(want), rtol=1e-5,
                               atol=1e-5)


if __name__ == "__main__":
  absltest.main()
