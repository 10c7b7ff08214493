"""The Plan: JSON round trip, file errors that name the file, back-off records, and
`check_plan` listing every way a plan does not fit a model (tiny DLRM)."""
import json
import os
import tempfile

import chex
from absl.testing import absltest, parameterized

import report_builders as hm
from loka_jax import dispatch
from loka_jax.data.make import make_source
from loka_jax.data.spec import FeatureSpec
from loka_jax.dispatch import selection
from loka_jax.kernels import KernelChoice, KernelPlan
from loka_jax.models import get_config
from loka_jax.probe.eligibility import Criteria
from loka_jax.train import experiment

PASSES = hm.PASSES
BF16 = {p: "xla_bf16" for p in PASSES}


def selected_plan():
  passes = {"fwd": {"xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.3, 1.4))},
            "grad_lhs": {"xla_fp8_tensorwise": hm.entry(sqnr=22.0, speedup=(1.3, 1.4, 1.5))},
            "grad_rhs": {"xla_fp8_rowwise": hm.entry(sqnr=12.0, speedup=(1.3, 1.4, 1.5))}}
  return selection.select(hm.report({"top_mlp/dense_0": hm.site(passes),
                                     "top_mlp/dense_1": hm.site(passes)}), Criteria())


def write(text, name="plan.json"):
  path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_"), name)
  with open(path, "w") as f:
    f.write(text)
  return path


class PlanFileTest(chex.TestCase):

  def test_round_trip_and_kernel_plan(self):
    plan = selected_plan()
    path = os.path.join(tempfile.mkdtemp(), "sub", "plan.json")
    written = dispatch.save_plan(plan, path)
    again = dispatch.read_plan(path)
    self.assertEqual(again.to_dict(), plan.to_dict())
    self.assertEqual(written, plan.to_dict())
    kp = dispatch.load_plan(path)
    self.assertIsInstance(kp, KernelPlan)
    self.assertEqual(kp, dispatch.to_kernel_plan(plan))
    self.assertEqual(kp.choice_for("top_mlp/dense_1"),
                     KernelChoice("xla_fp8_rowwise", "xla_fp8_tensorwise", "xla_bf16"))
    self.assertEqual(kp.choice_for("anything/else"), KernelChoice.uniform("xla_bf16"))
    # what --precision=loka --plan=PATH runs
    self.assertEqual(experiment.load_plan(path), kp)
    # a serving plan (forwards only) loads for export but never for training
    serving = dispatch.Plan({**plan.to_dict(), "provenance": {
        **plan["provenance"], "objective": "serve"}})
    serve_path = os.path.join(os.path.dirname(path), "plan_serve.json")
    dispatch.save_plan(serving, serve_path)
    self.assertEqual(dispatch.load_plan(serve_path), kp)
    with self.assertRaisesRegex(experiment.PlanError, "plan_serve.json is a serving plan"):
      experiment.load_plan(serve_path)
    table = dispatch.choice_table(plan)
    self.assertIn("top_mlp/dense_0  fwd    xla_fp8_rowwise", table)
    self.assertIn("no eligible kernel", table)
    self.assertEqual(dispatch.kernel_counts(plan)["grad_lhs"], {"xla_fp8_tensorwise": 2})

  def test_hand_written_plan_with_rules_and_bare_kernel_names(self):
    path = write(json.dumps({
        "schema": "loka.plan/1",
        "sites": {"top_mlp/dense_2": {"fwd": "xla_fp8_rowwise", "grad_lhs": "xla_bf16",
                                      "grad_rhs": {"kernel": "xla_bf16", "reason": "mine"}}},
        "rules": [{"pattern": "top_mlp/.*", "passes": {p: "xla_fp8_tensorwise" for p in PASSES}},
                  {"pattern": "top_mlp/dense_1", "passes": BF16}],
        "default": None}))
    kp = dispatch.load_plan(path)
    self.assertEqual(kp.choice_for("top_mlp/dense_2").fwd, "xla_fp8_rowwise")
    self.assertEqual(kp.choice_for("top_mlp/dense_1"),  # first rule wins
                     KernelChoice.uniform("xla_fp8_tensorwise"))
    plan = dispatch.read_plan(path)
    self.assertIsNone(plan.choice_for("bottom_mlp/dense_0"))  # no default: uncovered
    self.assertEqual(plan["sites"]["top_mlp/dense_2"]["grad_rhs"]["reason"], "mine")

  @parameterized.named_parameters(
      ("missing", None, "cannot read the plan"),
      ("empty", "", "empty"),
      ("truncated", '{"schema": "loka.plan/1", "sites": {"a": {"fwd": ', "truncated or corrupt"),
      ("not_an_object", "[1, 2]", "a plan is a JSON object"),
      ("probe_report", '{"schema": "loka.probe/1", "sites": {}}', "schema 'loka.probe/1'"),
      ("no_schema", '{"sites": {}}', "not a plan"),
      ("newer", '{"schema": "loka.plan/2", "sites": {}}', "another version"),
      ("missing_pass", '{"schema": "loka.plan/1", "sites": {"a": {"fwd": "xla_bf16"}}}',
       r"missing pass\(es\) \['grad_lhs', 'grad_rhs'\]"),
      ("unknown_pass", '{"schema": "loka.plan/1", "sites": {"a": {"fwd": "x", "grad_lhs": "x",'
       ' "grad_rhs": "x", "bwd": "x"}}}', r"unknown pass\(es\) \['bwd'\]"),
      ("bad_regex", '{"schema": "loka.plan/1", "sites": {}, "rules": [{"pattern": "a(", '
       '"passes": {"fwd": "x", "grad_lhs": "x", "grad_rhs": "x"}}]}', "is not a regex"),
      ("bad_entry", '{"schema": "loka.plan/1", "sites": {"a": {"fwd": 3, "grad_lhs": "x", '
       '"grad_rhs": "x"}}}', "expected a kernel name"),
  )
  def test_bad_files_name_the_file_and_the_problem(self, text, pattern):
    path = (os.path.join(tempfile.mkdtemp(), "absent.json") if text is None else write(text))
    for loader in (dispatch.read_plan, dispatch.load_plan, experiment.load_plan):
      with self.assertRaises((dispatch.PlanFileError, experiment.PlanError)) as ctx:
        loader(path)
      self.assertIn(path, str(ctx.exception))
      self.assertRegex(str(ctx.exception), pattern)


class KernelDigestTest(chex.TestCase):

  def test_digest_follows_kernels_not_reasons_and_pins_a_resumed_run(self):
    plan = selected_plan()
    data = plan.to_dict()
    reworded = json.loads(json.dumps(data))
    reworded["sites"]["top_mlp/dense_0"]["fwd"]["reason"] = "hand-checked"
    reworded["provenance"]["created"] = "another day"
    self.assertEqual(dispatch.Plan(reworded).kernel_digest(), plan.kernel_digest())
    switched = json.loads(json.dumps(data))
    switched["sites"]["top_mlp/dense_0"]["fwd"]["kernel"] = "xla_bf16"
    self.assertNotEqual(dispatch.Plan(switched).kernel_digest(), plan.kernel_digest())
    # A run records what its plan runs, so resuming it under another plan is refused.
    path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_"), "plan.json")
    dispatch.save_plan(plan, path)
    info = experiment.RunSpec(precision="loka", plan=path).run_info()
    self.assertEqual(info["plan_kernels_sha256"], plan.kernel_digest())


class BackOffTest(chex.TestCase):

  def test_back_off_one_pass_records_the_step(self):
    plan = selected_plan()
    before = plan.to_dict()
    backed = dispatch.back_off(plan, "top_mlp/dense_0", "fwd", "held-out loss +0.05%")
    self.assertEqual(plan.to_dict(), before)  # the original is unchanged
    entry = backed["sites"]["top_mlp/dense_0"]
    self.assertEqual(entry["fwd"]["kernel"], "xla_bf16")
    self.assertEqual(entry["fwd"]["backed_off_from"], "xla_fp8_rowwise")
    self.assertEqual(entry["grad_lhs"]["kernel"], "xla_fp8_tensorwise")  # other passes stay
    self.assertEqual(backed["sites"]["top_mlp/dense_1"], plan["sites"]["top_mlp/dense_1"])
    (step,) = backed["validation"]
    self.assertEqual({k: step[k] for k in ("step", "site", "passes", "from", "to", "reason")},
                     {"step": "back_off", "site": "top_mlp/dense_0", "passes": ["fwd"],
                      "from": {"fwd": "xla_fp8_rowwise"}, "to": "xla_bf16",
                      "reason": "held-out loss +0.05%"})
    again = dispatch.back_off(backed, "top_mlp/dense_0", None, "speed", to="xla_fp32",
                              step="speed")
    self.assertEqual({p: e["kernel"] for p, e in again["sites"]["top_mlp/dense_0"].items()},
                     {p: "xla_fp32" for p in PASSES})
    self.assertEqual([s["step"] for s in again["validation"]], ["back_off", "speed"])
    self.assertEqual(dispatch.to_kernel_plan(again).choice_for("top_mlp/dense_0"),
                     KernelChoice.uniform("xla_fp32"))

  def test_back_off_of_a_fused_op_backs_off_every_pass_and_rule_sites_get_entries(self):
    plan = dispatch.Plan({"schema": "loka.plan/1", "sites": {
        "a": {p: "flax_fp8_delayed" for p in PASSES}},
        "rules": [{"pattern": "b.*", "passes": {p: "xla_fp8_rowwise" for p in PASSES}}],
        "default": None})
    backed = dispatch.back_off(plan, "a", "grad_rhs", "wgrad drifted")
    self.assertEqual({p: e["kernel"] for p, e in backed["sites"]["a"].items()}, BF16)
    self.assertEqual(backed["validation"][0]["passes"], list(PASSES))
    ruled = dispatch.back_off(plan, "b_1", "fwd", "slow")
    self.assertEqual({p: e["kernel"] for p, e in ruled["sites"]["b_1"].items()},
                     {"fwd": "xla_bf16", "grad_lhs": "xla_fp8_rowwise",
                      "grad_rhs": "xla_fp8_rowwise"})
    with self.assertRaisesRegex(ValueError, "not covered"):
      dispatch.back_off(plan, "c", "fwd", "x")
    with self.assertRaisesRegex(KeyError, "unknown kernel"):
      dispatch.back_off(plan, "a", "fwd", "x", to="xla_fp4")
    with self.assertRaisesRegex(ValueError, "unknown pass"):
      dispatch.back_off(plan, "a", "bwd", "x")
    noted = dispatch.add_validation(plan, {"step": "quality", "delta_logloss": 0.0001})
    self.assertEqual(noted["validation"][0]["delta_logloss"], 0.0001)


class CheckPlanTest(chex.TestCase):
  """Against the tiny DLRM: bottom_mlp/dense_{0,1}, top_mlp/dense_{0,1} are fused Mods layers
  (Dense -> ReLU), top_mlp/dense_2 a plain DenseSite, interaction/dot an act x act site."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    config = get_config("dlrm", "tiny")
    source = make_source("synthetic", features=FeatureSpec.from_dict(dict(config.features)),
                         seed=3)
    cls.batch = source.train_batch(0, 16)
    cls.model = dispatch.apply(config, KernelPlan.uniform("xla_bf16"))

  def check(self, data):
    return dispatch.check_plan(dispatch.Plan(data), self.model, None, self.batch)

  def problems(self, data):
    with self.assertRaises(dispatch.PlanMismatchError) as ctx:
      self.check(data)
    return ctx.exception.problems

  def test_a_fitting_plan_passes_and_returns_the_sites(self):
    fused = {"fwd": "pallas_fp8_rowwise_fused_relu", "grad_lhs": "pallas_fp8_rowwise",
             "grad_rhs": "pallas_fp8_rowwise"}
    products = self.check({"schema": "loka.plan/1", "sites": {
        "top_mlp/dense_0": fused, "interaction/dot": {p: "flax_fp8_delayed" for p in PASSES}},
        "rules": [{"pattern": "bottom_mlp/.*", "passes": {
            "fwd": "xla_fp8_rowwise", "grad_lhs": "xla_fp8_tensorwise", "grad_rhs": "xla_bf16"}}],
        "default": BF16})
    self.assertEqual(sorted(products), ["bottom_mlp/dense_0", "bottom_mlp/dense_1",
                                        "interaction/dot", "top_mlp/dense_0", "top_mlp/dense_1",
                                        "top_mlp/dense_2"])
    self.assertEqual(products["interaction/dot"].kind, "act_act")

  def test_every_problem_is_listed_in_one_error(self):
    problems = self.problems({"schema": "loka.plan/1", "sites": {
        "top_mlp/dense_9": BF16,                                              # unknown site
        "top_mlp/dense_2": {"fwd": "pallas_fp8_rowwise_fused_relu",           # plain site
                            "grad_lhs": "pallas_fp8_rowwise", "grad_rhs": "pallas_fp8_rowwise"},
        "top_mlp/dense_1": {"fwd": "pallas_fp8_rowwise_fused_blocknorm256_relu",  # epilogue
                            "grad_lhs": "pallas_fp8_rowwise", "grad_rhs": "pallas_fp8_rowwise"},
        "top_mlp/dense_0": {"fwd": "pallas_fp8_batched",                      # no batch index
                            "grad_lhs": "xla_fp8_mystery", "grad_rhs": "xla_bf16"},  # unknown
        "interaction/dot": BF16},
        "rules": [{"pattern": "tower/.*", "passes": BF16},                   # matches nothing
                  {"pattern": "top_mlp/dense_[01]", "passes": BF16}],        # decides nothing
        "default": None})                                                    # bottom uncovered
    text = "\n".join(problems)
    self.assertLen(problems, 8, text)
    expected = [
        r"unknown site\(s\) \['top_mlp/dense_9'\]",
        r"rule 0 'tower/\.\*' matches no site",
        r"rule 1 'top_mlp/dense_\[01\]' decides no site",
        r"uncovered site\(s\) \['bottom_mlp/dense_0', 'bottom_mlp/dense_1'\]",
        r"kernel 'xla_fp8_mystery' is not registered \(used by site top_mlp/dense_0 grad_lhs\)",
        r"site top_mlp/dense_0 .*: fwd: kernel pallas_fp8_batched: spec mk,kn->mn has no batch",
        r"site top_mlp/dense_2: pallas_fp8_rowwise_fused_relu fuses an epilogue .* fits only",
        r"site top_mlp/dense_1: pallas_fp8_rowwise_fused_blocknorm256_relu computes "
        r"BlockNorm\(256\) -> relu, the layer computes no norm -> relu; use "
        r"pallas_fp8_rowwise_fused_relu",
    ]
    for pattern in expected:
      self.assertRegex(text, pattern)

  def test_fused_op_mixed_with_per_pass_kernels(self):
    problems = self.problems({"schema": "loka.plan/1", "sites": {
        "interaction/dot": {"fwd": "flax_fp8_delayed", "grad_lhs": "xla_bf16",
                            "grad_rhs": "xla_bf16"}}, "default": BF16})
    self.assertLen(problems, 1)
    self.assertRegex(problems[0], r"site interaction/dot \(act_act, bnd,bmd->bnm.*fused-op "
                                  r"kernel \['flax_fp8_delayed'\] must be chosen for all three")

  def test_apply_with_a_batch_checks_the_plan(self):
    bad = {"schema": "loka.plan/1", "sites": {"nowhere": BF16}, "default": BF16}
    with self.assertRaisesRegex(dispatch.PlanMismatchError, r"unknown site\(s\) \['nowhere'\]"):
      dispatch.apply(self.model, bad, batch=self.batch)


if __name__ == "__main__":
  absltest.main()
