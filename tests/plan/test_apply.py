"""One-call use: `apply` bakes a plan into loka_jax models; `wrap` routes a plain Flax DLRM's
nn.Dense / nn.Einsum layers through GEMM sites (same parameters, the plan's kernels)."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import loka_jax
from loka_jax import dispatch
from loka_jax.data.make import make_source
from loka_jax.data.spec import FeatureSpec
from loka_jax.kernels import KernelChoice, KernelPlan
from loka_jax.models import SiteConfig, get_config
from loka_jax.precision import BF16, FP32

ROUTED = ["bottom/dense_0", "bottom/dense_1", "tokens", "top/dense_0", "top/dense_1"]


class PlainDLRM(nn.Module):
  """A DLRM written with plain Flax layers only: bottom MLP, embedding bags, a token
  projection (nn.Einsum), pairwise dot interaction, top MLP."""
  vocab: int = 100
  dim: int = 16

  @nn.compact
  def __call__(self, batch):
    x = Bottom(self.dim, name="bottom")(batch["dense"])
    bags = nn.Embed(self.vocab, self.dim, name="tables")(batch["ids"]).sum(axis=2)  # [B, F, d]
    tokens = jnp.concatenate([x[:, None, :], bags], axis=1)
    tokens = nn.Einsum((self.dim, self.dim), "bfd,de->bfe", name="tokens")(tokens)
    pairs = jnp.einsum("bfd,bgd->bfg", tokens, tokens)
    upper = jnp.triu_indices(tokens.shape[1], k=1)
    z = jnp.concatenate([x, pairs[:, upper[0], upper[1]]], axis=1)
    return Top(name="top")(z)[:, 0]


class Bottom(nn.Module):
  dim: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, name="dense_0")(x))
    return nn.relu(nn.Dense(self.dim, name="dense_1")(x))


class Top(nn.Module):

  @nn.compact
  def __call__(self, z):
    return nn.Dense(1, name="dense_1")(nn.relu(nn.Dense(64, name="dense_0")(z)))


def fp8_dots(module_text: str, fmt: str = "f8E4M3FN") -> int:
  """dot_generals whose operands are FP8 in lowered StableHLO."""
  return sum(1 for line in module_text.splitlines() if "dot_general" in line and fmt in line)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class WrapTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(7)
    cls.batch = {"dense": (rng.standard_normal((32, 6)) * 2.0).astype(np.float32),
                 "ids": rng.integers(0, 100, (32, 4, 3)).astype(np.int32)}
    cls.model = PlainDLRM()
    cls.variables = jax.jit(cls.model.init)(jax.random.PRNGKey(7), cls.batch)
    cls.plain = jax.jit(cls.model.apply)(cls.variables, cls.batch)

  def grads(self, apply):
    """Jitted gradient of a loss of the model's output w.r.t. its variables."""
    return jax.jit(jax.grad(lambda v: jnp.mean(apply(v, self.batch) ** 2)))

  def test_same_parameters_and_fp32_plan_gives_the_plain_output(self):
    wrapped = loka_jax.wrap(self.model, KernelPlan.uniform("xla_fp32"), policy=None)
    variables = jax.jit(wrapped.init)(jax.random.PRNGKey(7), self.batch)
    chex.assert_trees_all_equal(variables, self.variables)
    out = jax.jit(wrapped.apply)(self.variables, self.batch)
    chex.assert_trees_all_close(out, self.plain, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(self.grads(wrapped.apply)(self.variables),
                                self.grads(self.model.apply)(self.variables),
                                rtol=1e-4, atol=1e-6)

  def test_fp8_plan_runs_the_chosen_kernels_with_fp8_sized_error(self):
    fp8 = loka_jax.wrap(self.model, KernelPlan.uniform("xla_fp8_rowwise"), policy=None)
    out = jax.jit(fp8.apply)(self.variables, self.batch)
    err = rel_err(out, self.plain)
    self.assertGreater(err, 1e-4)   # really quantized
    self.assertLess(err, 0.15)      # e4m3 rowwise on 5 layers: a few percent
    train = self.grads(fp8.apply)
    grads = train(self.variables)
    plain_grads = self.grads(self.model.apply)(self.variables)
    self.assertLess(rel_err(grads["params"]["top"]["dense_0"]["kernel"],
                            plain_grads["params"]["top"]["dense_0"]["kernel"]), 0.3)
    chex.assert_tree_all_finite(grads)
    # forward: one e4m3 product per routed layer; backward: e5m2 gradients appear
    text = jax.jit(fp8.apply).lower(self.variables, self.batch).as_text()
    self.assertEqual(fp8_dots(text), len(ROUTED))
    self.assertGreater(fp8_dots(train.lower(self.variables).as_text(), "f8E5M2"), 0)

  def test_sites_are_named_by_path_and_take_the_plans_choice(self):
    plan = KernelPlan(sites=(("tokens", KernelChoice("xla_fp8_tensorwise", "xla_bf16",
                                                     "xla_bf16")),),
                      rules=((r"top/.*", KernelChoice.uniform("xla_fp8_rowwise")),),
                      default=KernelChoice.uniform("xla_bf16"))
    wrapped = dispatch.wrap(self.model, plan, policy=None)
    text = jax.jit(wrapped.apply).lower(self.variables, self.batch).as_text()
    self.assertEqual(fp8_dots(text), 3)  # tokens, top/dense_0, top/dense_1
    products = dispatch.check_plan(plan, wrapped, self.variables, self.batch)
    self.assertEqual(sorted(products), ROUTED)
    self.assertEqual(products["tokens"].spec, "bfd,de->bfe")
    with self.assertRaisesRegex(dispatch.PlanMismatchError, r"unknown site\(s\) \['top/dense_2'"):
      dispatch.check_plan(KernelPlan(sites=(("top/dense_2", KernelChoice()),)), wrapped,
                          self.variables, self.batch)
    # apply() swaps the plan of a wrapped model
    swapped = dispatch.apply(wrapped, KernelPlan.uniform("xla_fp32"))
    chex.assert_trees_all_close(swapped.apply(self.variables, self.batch), self.plain,
                                rtol=1e-5, atol=1e-6)

  def test_explicit_policy_and_unsupported_einsum(self):
    wrapped = dispatch.wrap(self.model, KernelPlan.uniform("xla_bf16"), policy=BF16)
    inner = jax.jit(lambda v, x: dispatch.wrap(Top(), KernelPlan.uniform("xla_bf16"),
                                               policy=BF16).apply(v, x))
    top_vars = {"params": self.variables["params"]["top"]}
    self.assertEqual(inner(top_vars, jnp.ones((4, 26))).dtype, jnp.bfloat16)
    out = jax.jit(wrapped.apply)(self.variables, self.batch)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertLess(rel_err(out.astype(jnp.float32), self.plain), 0.05)

    class Ellipsis(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Einsum((4, 2), "...d,de->...e", name="proj")(x)

    with self.assertRaisesRegex(ValueError, r"nn.Einsum at proj: .*no '\.\.\.'"):
      dispatch.wrap(Ellipsis(), KernelPlan()).init(jax.random.PRNGKey(0), jnp.ones((3, 4)))
    with self.assertRaisesRegex(TypeError, "flax.linen Module"):
      dispatch.wrap(lambda x: x, KernelPlan())


class ApplyTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = get_config("dlrm", "tiny")
    source = make_source("synthetic", features=FeatureSpec.from_dict(dict(cls.config.features)),
                         seed=5)
    cls.batch = source.train_batch(0, 16)

  def test_apply_to_a_config_a_module_and_a_site_config(self):
    plan = dispatch.Plan({"schema": "loka.plan/1", "sites": {
        "bottom_mlp/dense_0": {"fwd": "xla_fp8_rowwise", "grad_lhs": "xla_bf16",
                               "grad_rhs": "xla_fp8_tensorwise"},
        "top_mlp/dense_2": {"fwd": "xla_fp8_tensorwise", "grad_lhs": "xla_bf16",
                            "grad_rhs": "xla_bf16"}},
        "default": {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}})
    kernel_plan = dispatch.to_kernel_plan(plan)
    model = loka_jax.apply(self.config, plan)
    self.assertEqual(model.opts.site, SiteConfig(BF16, kernel_plan))
    variables = jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b), self.batch)
    text = jax.jit(model.apply).lower(variables, self.batch).as_text()
    self.assertEqual(fp8_dots(text), 2)
    # a built module: every SiteConfig is swapped, the policy kept unless given
    bf16_everywhere = dispatch.apply(model, KernelPlan.uniform("xla_bf16"))
    self.assertEqual(bf16_everywhere.opts.site.plan, KernelPlan.uniform("xla_bf16"))
    self.assertEqual(fp8_dots(jax.jit(bf16_everywhere.apply).lower(variables, self.batch)
                              .as_text()), 0)
    self.assertEqual(model.opts.site.plan, kernel_plan)  # the original is untouched
    fp32 = dispatch.apply(model, plan, policy=FP32)
    self.assertEqual(fp32.opts.site, SiteConfig(FP32, kernel_plan))
    self.assertEqual(dispatch.apply(SiteConfig(), plan), SiteConfig(BF16, kernel_plan))
    with self.assertRaisesRegex(TypeError, "wrap"):
      dispatch.apply(PlainDLRM(), plan)
    with self.assertRaisesRegex(TypeError, "expected a preset config"):
      dispatch.apply(42, plan)


if __name__ == "__main__":
  absltest.main()
