"""Products the plan cannot reach are reported, not skipped; `select` takes criteria fields as
keyword arguments; a plan made for another model is refused by `wrap`'s apply and by
`validate`."""
import chex
import jax
from absl.testing import absltest

import api_models as am
import loka_jax
from loka_jax.plan.file import PlanMismatchError

PRODUCT = "dot_general [32, 16] x [16, 16]"


class UnroutedTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = am.WithUnrouted()
    cls.batches, cls.variables = am.regression_setup(cls.model, 2, seed=1)
    cls.report = loka_jax.probe(cls.model, cls.variables, cls.batches, am.mse,
                                apply_fn=am.x_of(cls.model), samples=4)
    cls.plan = loka_jax.select(cls.report, min_speedup=None)

  def test_products_outside_the_sites_are_listed_with_their_module_path(self):
    self.assertEqual(self.report["unrouted_products"], [
        f"{PRODUCT} in the top-level module",   # h @ self.param(...)
        f"{PRODUCT} in inner",                  # jnp.dot in a submodule
        f"{PRODUCT} in sub",                    # a subclass of nn.Dense
    ])

  def test_the_sites_are_still_probed(self):
    self.assertEqual(list(self.report["sites"]), ["in", "head"])
    self.assertEqual(self.report["sites"]["in"]["shapes"],
                     {"lhs": [32, 16], "rhs": [16, 16], "out": [32, 16]})
    self.assertEqual(self.report["sites"]["head"]["shapes"],
                     {"lhs": [32, 16], "rhs": [16, 1], "out": [32, 1]})
    for name in ("in", "head"):
      self.assertEqual(self.report["sites"][name]["stats"]["observations"], 2)
    self.assertEqual(sorted(self.plan["sites"]), ["head", "in"])

  def test_unrouted_products_stay_in_the_models_precision(self):
    fp8 = loka_jax.wrap(self.model, self.plan)
    on_fp8 = [s for s, e in self.plan["sites"].items() if e["fwd"]["kernel"] in am.FP8_KERNELS]
    text = jax.jit(fp8.apply).lower(self.variables, self.batches[0]["x"]).as_text()
    self.assertEqual(am.fp8_dots(text), len(on_fp8))
    # the Dense subclass keeps its own parameters under its own path
    chex.assert_trees_all_equal(jax.jit(fp8.init)(jax.random.PRNGKey(1), self.batches[0]["x"]),
                                self.variables)
    chex.assert_tree_all_finite(jax.jit(fp8.apply)(self.variables, self.batches[0]["x"]))

  def test_select_takes_criteria_fields_as_keywords(self):
    strict = loka_jax.select(self.report, min_speedup=None, min_sqnr_fwd_db=200.0)
    self.assertEqual(strict["provenance"]["budget"]["default"]["min_sqnr_fwd_db"], 200.0)
    for name, entry in strict["sites"].items():
      self.assertEqual(entry["fwd"]["kernel"], "xla_bf16", name)   # no kernel reaches 200 dB
    # the default speed bar on a CPU (timings estimated, FP8 slower at these shapes): no FP8
    default = loka_jax.select(self.report)
    for name, entry in default["sites"].items():
      self.assertEqual({p: entry[p]["kernel"] for p in am.PASSES},
                       {p: "xla_bf16" for p in am.PASSES}, name)

  def test_select_refuses_an_unknown_criterion(self):
    with self.assertRaisesRegex(TypeError, r"unknown criteria \['no_such_field'\]") as cm:
      loka_jax.select(self.report, no_such_field=1)
    self.assertNotIn("\n", str(cm.exception))

  def test_a_plan_for_another_model_is_refused(self):
    other = am.EncDec()
    batches, variables = am.regression_setup(other, 2, seed=2)
    wrapped = loka_jax.wrap(other, self.plan)   # wrapping alone checks nothing
    for apply in (wrapped.apply, jax.jit(wrapped.apply)):
      with self.assertRaisesRegex(
          PlanMismatchError,
          r"another model than this EncDec.*names 2 site\(s\) the model does not call: "
          r"head, in; the model's sites are dec, enc"
      ) as cm:
        apply(variables, batches[0]["x"])
      self.assertNotIn("\n", str(cm.exception))
    with self.assertRaisesRegex(PlanMismatchError,
                                r"names 2 site\(s\) the model does not call: head, in") as cm:
      loka_jax.validate(wrapped, self.plan, variables, batches, am.mse, apply_fn=am.x_of(other))
    self.assertNotIn("\n", str(cm.exception))
    # a plan naming some of the model's own sites is fine (the rest take its default)
    own = loka_jax.wrap(other, am.uniform_plan(["enc"], "xla_fp8_rowwise"))
    out = own.apply(variables, batches[0]["x"])
    self.assertEqual(out.shape, (am.BATCH,))
    self.assertEqual(am.fp8_dots(jax.jit(own.apply).lower(variables, batches[0]["x"])
                                 .as_text()), 1)


if __name__ == "__main__":
  absltest.main()
