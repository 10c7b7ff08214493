"""`loka_jax.validate`: held-out loss of the plan against the same model in bf16, backing off
FP8 forwards until the plan is non-inferior.

The model's input has one channel a million times larger than the others, which its first
layer ignores (a zero kernel row): in bf16 the outlier costs nothing, but one FP8 scale per
tensor (or per row) spends e4m3's range on it and flushes every other channel to zero, so the
plan with 'enc' on FP8 loses the signal the targets depend on.
"""
import re

import chex
import jax
import numpy as np
from absl.testing import absltest

import api_models as am
import loka_jax
from loka_jax.kernels import KernelPlan

OUTLIER = 1e6
STEP = "held_out_loss"


def rounds(plan):
  return [r for r in plan["validation"] if "round" in r]


def back_offs(plan):
  return [r for r in plan["validation"] if "site" in r]


class ValidateTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = am.EncDec()
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((am.BATCH, am.IN)).astype(np.float32) for _ in range(5)]
    for x in xs:
      x[:, 0] = OUTLIER
    variables = jax.jit(cls.model.init)(jax.random.PRNGKey(6), xs[0])
    variables = jax.tree.map(lambda a: np.array(a), variables)
    variables["params"]["enc"]["kernel"][0] = 0.0   # the outlier channel carries nothing
    cls.variables = variables
    cls.variables_before = am.host_copy(variables)
    # targets the model fits up to noise of std 0.1: a bf16 loss near 0.01
    cls.batches = [{"x": x, "y": (np.asarray(cls.model.apply(variables, x))
                                  + 0.1 * rng.standard_normal(am.BATCH)).astype(np.float32)}
                   for x in xs]
    cls.held_out = cls.batches[2:]
    cls.report = loka_jax.probe(cls.model, cls.variables, cls.batches[:2], am.mse,
                                apply_fn=am.x_of(cls.model), samples=4)
    cls.bad = am.uniform_plan(["enc", "dec"], "xla_fp8_tensorwise")

  def held_out_losses(self, plan):
    """Per held-out batch, the loss of the model under `plan` (computed here, not by validate)."""
    wrapped = loka_jax.wrap(self.model, plan)
    loss = jax.jit(lambda v, b: am.mse(wrapped.apply(v, b["x"]), b))
    return np.array([float(loss(self.variables, b)) for b in self.held_out])

  def validate(self, plan, **kwargs):
    return loka_jax.validate(loka_jax.wrap(self.model, plan), plan, self.variables,
                             self.held_out, am.mse, apply_fn=am.x_of(self.model), **kwargs)

  def check_first_round(self, checked):
    base = self.held_out_losses(KernelPlan.uniform("xla_bf16"))
    bad = self.held_out_losses(self.bad)
    first = rounds(checked)[0]
    self.assertEqual(first["step"], STEP)
    self.assertEqual(first["round"], 0)
    self.assertEqual(first["batches"], len(self.held_out))
    self.assertEqual(first["fp8_forward_sites"], 2)
    np.testing.assert_allclose(first["loss_bf16"], base.mean(), rtol=1e-5)
    np.testing.assert_allclose(first["loss"], bad.mean(), rtol=1e-5)
    self.assertGreater(first["loss"], 10 * first["loss_bf16"])   # the outlier breaks FP8
    np.testing.assert_allclose(first["rel_loss_change"], np.mean((bad - base) / base),
                               rtol=1e-5)
    self.assertEqual(first["verdict"], "missed")
    self.assertFalse(first["passed"])

  def check_backed_off(self, checked):
    """Each back-off: its record, and the site's forward on bf16 with `backed_off_from`."""
    offs = back_offs(checked)
    self.assertNotEmpty(offs)
    self.assertEqual(offs[0]["site"], "enc")   # the site the outlier breaks goes first
    for record in offs:
      self.assertEqual(record["step"], STEP)
      self.assertEqual(record["passes"], ["fwd"])
      self.assertEqual(record["from"], {"fwd": "xla_fp8_tensorwise"})
      self.assertEqual(record["to"], "xla_bf16")
      entry = checked["sites"][record["site"]]
      self.assertEqual(entry["fwd"]["kernel"], "xla_bf16")
      self.assertEqual(entry["fwd"]["backed_off_from"], "xla_fp8_tensorwise")
      self.assertIn("backed off from xla_fp8_tensorwise", entry["fwd"]["reason"])
      # only forwards are backed off: a held-out loss does not see the gradients
      self.assertEqual(entry["grad_lhs"]["kernel"], "xla_fp8_tensorwise")
      self.assertEqual(entry["grad_rhs"]["kernel"], "xla_fp8_tensorwise")
    # one round after each round that backed off, the last one final
    self.assertLen(rounds(checked), len({r["round"] for r in rounds(checked)}))
    final = checked["validation"][-1]
    self.assertIn("round", final)
    if not final["passed"]:
      self.assertIn("note", final)
    # the last round's loss is that of the plan it returns
    np.testing.assert_allclose(final["loss"], self.held_out_losses(checked).mean(), rtol=1e-5)
    return offs

  def test_a_bad_plan_is_backed_off_by_the_reports_ranking(self):
    checked = self.validate(self.bad, report=self.report)
    self.check_first_round(checked)
    offs = self.check_backed_off(checked)
    self.assertIn("forward SQNR", offs[0]["reason"])
    self.assertIn("least accurate in the probe report", offs[0]["reason"])
    final = checked["validation"][-1]
    # two sites, eight rounds: it passes at the latest when every forward is back on bf16,
    # where the held-out loss is bf16's
    self.assertTrue(final["passed"])
    self.assertEqual(final["verdict"], "met")
    if all(e["fwd"]["kernel"] == "xla_bf16" for e in checked["sites"].values()):
      self.assertEqual(final["rel_loss_change"], 0.0)
    self.assertEqual(am.uniform_plan(["enc", "dec"], "xla_fp8_tensorwise"), self.bad)  # as given

  def test_without_a_report_each_site_is_measured_alone(self):
    checked = self.validate(self.bad, report=None)
    self.check_first_round(checked)
    offs = self.check_backed_off(checked)
    match = re.search(r"this site alone moves held-out loss ([+-][0-9.]+)%", offs[0]["reason"])
    self.assertIsNotNone(match, offs[0]["reason"])
    base = self.held_out_losses(KernelPlan.uniform("xla_bf16"))
    alone = self.held_out_losses(am.uniform_plan(["enc"], "xla_fp8_tensorwise"))
    np.testing.assert_allclose(float(match.group(1)), 100 * np.mean((alone - base) / base),
                               rtol=1e-4)

  def test_a_plan_that_cannot_pass_in_its_rounds_says_why(self):
    checked = self.validate(self.bad, report=self.report, max_rounds=0)
    self.assertLen(checked["validation"], 1)
    final = checked["validation"][0]
    self.assertEqual(final["verdict"], "missed")
    self.assertFalse(final["passed"])
    self.assertEqual(final["note"], "stopped after 0 back-off rounds")
    self.assertEqual(checked["sites"]["enc"]["fwd"]["kernel"], "xla_fp8_tensorwise")

  def test_an_all_bf16_plan_is_not_applicable(self):
    plan = am.uniform_plan(["enc", "dec"], "xla_bf16")
    checked = self.validate(plan, report=self.report)
    self.assertLen(checked["validation"], 1)
    record = checked["validation"][0]
    self.assertEqual(record["step"], STEP)
    self.assertEqual(record["verdict"], "not applicable")
    self.assertTrue(record["passed"])
    self.assertEqual(record["fp8_forward_sites"], 0)
    self.assertEqual(record["loss"], record["loss_bf16"])
    self.assertEqual({s: {p: e[p]["kernel"] for p in am.PASSES}
                      for s, e in checked["sites"].items()}, plan["sites"])

  def test_probing_and_validating_leave_the_variables_alone(self):
    chex.assert_trees_all_equal(self.variables, self.variables_before)   # probed in setUpClass
    self.validate(self.bad, report=self.report, max_rounds=1)
    chex.assert_trees_all_equal(self.variables, self.variables_before)
    self.assertTrue(np.all(self.variables["params"]["enc"]["kernel"][0] == 0.0))


  def test_a_jitted_apply_fn_is_refused(self):
    # A jitted function keeps the trace it was first made with, without the plan's routing:
    # every plan would then read as bf16. Refused, in validate and in the probe alike.
    for call in (lambda f: loka_jax.validate(loka_jax.wrap(self.model, self.bad), self.bad,
                                             self.variables, self.held_out, am.mse,
                                             apply_fn=f, report=self.report),
                 lambda f: loka_jax.probe(self.model, self.variables, self.held_out, am.mse,
                                          apply_fn=f, samples=4)):
      with self.assertRaisesRegex(ValueError, r"apply_fn is jitted .*pass the plain function"):
        call(jax.jit(am.x_of(self.model)))


if __name__ == "__main__":
  absltest.main()
