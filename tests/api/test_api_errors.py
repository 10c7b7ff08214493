"""What the public API refuses, each with a one-line ValueError (or TypeError) that names the
problem: models with nothing to probe, losses that are not scalars, batches that change
between observations, reports before any observation, validation on one batch."""

import chex
import jax
import jax.numpy as jnp
from absl.testing import absltest

import api_models as am
import loka_jax
from loka_jax.dispatch.loss_check import ValidationInputError
from loka_jax.probe.streaming import ProbeInputError


class ProbeInputTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = am.EncDec()
    cls.batches, cls.variables = am.regression_setup(cls.model, 3, seed=3)

  def assertOneLine(self, cm):
    self.assertIsInstance(cm.exception, ValueError)
    self.assertNotIn("\n", str(cm.exception))

  def probe(self, loss=am.mse, model=None, **kwargs):
    model = model or self.model
    return loka_jax.Probe(model, loss, apply_fn=am.x_of(model), samples=4, **kwargs)

  def test_a_model_without_a_matrix_product(self):
    model = am.NoProduct()
    variables = model.init(jax.random.PRNGKey(0), self.batches[0]["x"])
    with self.assertRaisesRegex(ProbeInputError,
                                "NoProduct computes no matrix product the probe can reach") as cm:
      self.probe(model=model).observe(variables, self.batches[0])
    self.assertOneLine(cm)
    with self.assertRaisesRegex(ProbeInputError, "no matrix product"):
      loka_jax.probe(model, variables, self.batches[:1], am.mse, apply_fn=am.x_of(model))

  def test_a_loss_that_is_not_a_scalar(self):
    per_example = lambda out, batch: (out.astype(jnp.float32) - batch["y"]) ** 2
    with self.assertRaisesRegex(ProbeInputError,
                                r"loss_fn returned an array of shape \(32,\).*one scalar") as cm:
      self.probe(per_example).observe(self.variables, self.batches[0])
    self.assertOneLine(cm)
    count = lambda out, batch: jnp.sum(out > 0)
    with self.assertRaisesRegex(ProbeInputError, "loss_fn returned int32.*floating-point") as cm:
      self.probe(count).observe(self.variables, self.batches[0])
    self.assertOneLine(cm)
    with self.assertRaisesRegex(ProbeInputError, "loss_fn must be callable") as cm:
      loka_jax.Probe(self.model, "mse")
    self.assertOneLine(cm)

  def test_batches_that_change_between_observations(self):
    probe = self.probe()
    probe.observe(self.variables, self.batches[0])
    probe.observe(self.variables, self.batches[1])
    grown = {**self.batches[2], "w": self.batches[2]["y"]}
    with self.assertRaisesRegex(ProbeInputError, r"^batch 2: .*tree structure") as cm:
      probe.observe(self.variables, grown)
    self.assertOneLine(cm)
    half = {"x": self.batches[2]["x"][:16], "y": self.batches[2]["y"][:16]}
    with self.assertRaisesRegex(
        ProbeInputError,
        r"^batch 2: .*leaf 0 is float32\[16, 16\], the first batch's float32\[32, 16\]") as cm:
      probe.observe(self.variables, half)
    self.assertOneLine(cm)
    retyped = {"x": self.batches[2]["x"].astype(jnp.bfloat16), "y": self.batches[2]["y"]}
    with self.assertRaisesRegex(ProbeInputError, r"^batch 2: .*leaf 0 is bfloat16\[32, 16\]"):
      probe.observe(self.variables, retyped)
    self.assertEqual(probe.observations, 2)   # refused batches are not counted
    with self.assertRaisesRegex(ProbeInputError, r"batch 1: "):
      loka_jax.probe(self.model, self.variables, [self.batches[0], half], am.mse,
                     apply_fn=am.x_of(self.model), samples=4)

  def test_report_before_any_observation(self):
    with self.assertRaisesRegex(ProbeInputError, "observed no batch.*observe") as cm:
      self.probe().report()
    self.assertOneLine(cm)
    with self.assertRaisesRegex(ProbeInputError, "observed no batch"):
      loka_jax.probe(self.model, self.variables, [], am.mse, apply_fn=am.x_of(self.model))

  def test_validate_needs_two_held_out_batches(self):
    plan = am.uniform_plan(["enc", "dec"], "xla_fp8_rowwise")
    fp8 = loka_jax.wrap(self.model, plan)
    with self.assertRaisesRegex(ValidationInputError,
                                "at least 2 held-out batches.*got 1") as cm:
      loka_jax.validate(fp8, plan, self.variables, self.batches[:1], am.mse,
                        apply_fn=am.x_of(self.model))
    self.assertOneLine(cm)
    with self.assertRaisesRegex(ValidationInputError, "got 0"):
      loka_jax.validate(fp8, plan, self.variables, iter([]), am.mse,
                        apply_fn=am.x_of(self.model))


class ReportNameTest(chex.TestCase):
  """Unrouted products are named by their Linen path whatever the report is called and
  whatever the top-level module's own name: the jaxpr's name stack starts at the module's
  Linen name (its class name when it has none), not at the report's name."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.batches = am.regression_batches(2, seed=4)

  def unrouted(self, model, **kwargs):
    variables = jax.jit(model.init)(jax.random.PRNGKey(4), self.batches[0]["x"])
    report = loka_jax.probe(model, variables, self.batches, am.mse, apply_fn=am.x_of(model),
                            samples=4, sites="^head$", **kwargs)
    return report["unrouted_products"]

  def expected(self):
    product = "dot_general [32, 16] x [16, 16]"
    return [f"{product} in the top-level module", f"{product} in inner", f"{product} in sub"]

  def test_a_report_name_does_not_change_the_unrouted_products(self):
    self.assertEqual(self.unrouted(am.WithUnrouted(), name="my_model"), self.expected())

  def test_a_named_top_level_module_does_not_change_the_unrouted_products(self):
    self.assertEqual(self.unrouted(am.WithUnrouted(name="net")), self.expected())


if __name__ == "__main__":
  absltest.main()
