"""The bench's inference arms on the CPU: a plan without FP8 sites, the exported model LoKA
infers with, and the serving plan."""
import copy
import json
import os
import re
from unittest import mock

import chex
import numpy as np
from absl.testing import absltest

from bench_rows import tempdir
from experiments.bench import serving, suite, targets, variants
from experiments.bench.results import ResultsFile
from loka_jax.kernels.choice import KernelChoice, KernelPlan
from loka_jax.models.presets import site_products
from loka_jax.models.site import SiteConfig


class AllBf16PlanTest(absltest.TestCase):
  """A LoKA plan of bf16 at every site trains with bf16+Mods' own program, so a gap between
  the two arms' train steps is the timing's, not the plan's (Wukong `small`, H200: 0.986)."""

  def test_its_train_step_compiles_to_the_bf16_mods_program(self):
    target = suite.model_targets(["wukong"], ["tiny"], 64)[0]
    batch = target.source(0).train_batch(0, 64)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0)
    bench.set_baseline(target.build(SiteConfig.for_precision("bf16")))
    sites = site_products(target.build(SiteConfig.for_precision("bf16"), ("all",)), None, batch)
    plan = KernelPlan(sites=tuple((name, KernelChoice()) for name in sites))  # as a plan file
    arms = {v.name: bench.add(v.name, target.build(
                suite.speed.site_config(v, plan if v.name == "loka" else None), v.mods))
            for v in variants.parse_variants(["bf16_mods", "loka"])}

    def program(arm):  # without source locations (metadata and the tables they index)
      text = re.sub(r", metadata=\{[^}]*\}", "", arm.hlo["train"])
      return [line for line in text.splitlines() if not re.match(r"\d+ [\"{]", line)]

    self.assertGreater(len(program(arms["loka"])), 100)
    self.assertEqual(program(arms["bf16_mods"]), program(arms["loka"]))


class ExportedInferenceTest(chex.TestCase):
  """The LoKA arm's inference runs the exported model (e4m3 weights, static scales) on the
  parameters the arms train, and the row says how its sites were exported."""

  def test_loka_infers_with_the_exported_model(self):
    import jax
    from plan_builders import make_plan, probe_stats
    from loka_jax import dispatch
    from loka_jax.dispatch import export as export_lib
    target = suite.model_targets(["dlrm"], ["tiny"], 64)[0]
    source = target.source(3)
    batch = source.train_batch(0, 64)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0)
    bf16 = target.build(SiteConfig.for_precision("bf16"))
    bench.set_baseline(bf16)
    report = probe_stats(bf16, {"params": bench.holder["shared"].params}, source)
    plan = make_plan(report["sites"])
    planned = target.build(SiteConfig.for_precision("loka", plan=plan.kernel_plan()))
    arm = bench.add("loka", planned)
    arm.train()  # the exported weights are the ones the arms have trained
    served, fields = serving.serve_exported(bench, arm, planned, plan, report)
    self.assertTrue(fields["export"])
    self.assertEqual(fields["export_modes"], {"fp8": len(report["sites"]) - 1, "high": 1})
    self.assertGreater(fields["export_saved_fraction"], 0.0)
    expected = export_lib.export(planned, bench.holder["shared"].params, plan, report,
                                 batch=batch).apply(batch)
    np.testing.assert_allclose(np.asarray(served.infer()), np.asarray(expected), rtol=1e-5,
                               atol=1e-5)
    # The plan's model as it trains, compiled (run op by op it takes seconds).
    unexported_model = dispatch.apply(target.config(), plan)
    unexported = np.asarray(jax.jit(lambda params: unexported_model.apply(
        {"params": params}, batch, train=False))(bench.holder["shared"].params), np.float32)
    self.assertFalse(np.allclose(np.asarray(served.infer()), unexported, atol=0.0))


  def test_served_bf16_mods_infers_from_bf16_weights_stored_once(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    done = suite.run_target(target, variants.parse_variants(["bf16_mods_served"]), results,
                            settings=suite.SpeedSettings(repeats=3, probe=False),
                            deadline=float("inf"), device="cpu", log=lambda _: None)
    self.assertTrue(done)
    rows = {r["variant"]: r for r in map(json.loads, open(os.path.join(out, "bench.jsonl")))}
    served = rows["bf16_mods_served"]
    self.assertNotIn("error", served, served.get("traceback"))
    self.assertTrue(served["export"])
    sites = len(site_products(target.build(SiteConfig.for_precision("bf16"), ("all",)), None,
                              target.source(0).train_batch(0, 32)))
    self.assertEqual(served["export_modes"], {"high": sites})
    # float32 parameters stored as bf16: about half of the site weights' bytes are saved.
    self.assertGreater(served["export_saved_fraction"], 0.3)
    self.assertEqual(served["mods"], ["all"])


class ServingPlanBenchTest(chex.TestCase):
  """`serving.plan`: LoKA trains with its training plan and serves the export of a serving
  plan selected from the same report; the row names both, and its export modes (not the
  training kernels) decide whether it is the served bf16+Mods program."""

  # Per target: the probe's statistics of its bf16 model with LoKA's Mods at initialization,
  # which every test's report holds; a statistics pass compiles per site, so it runs once.
  _site_stats = {}

  def _stats(self, target):
    import jax
    from plan_builders import probe_stats
    if target.name not in self._site_stats:
      source = target.source(0)
      bf16 = target.build(SiteConfig.for_precision("bf16"), variants.VARIANTS["loka"].mods)
      batch = source.train_batch(0, target.batch())
      variables = jax.jit(lambda b: bf16.init(jax.random.PRNGKey(0), b, train=False))(batch)
      type(self)._site_stats[target.name] = probe_stats(bf16, variables, source)["sites"]
    return copy.deepcopy(self._site_stats[target.name])

  def _plans(self, target, fwd_speed=(1.06, 1.08, 1.13)):
    import report_builders as hm
    from loka_jax import dispatch
    from experiments.bench import planning
    from loka_jax.probe.eligibility import Criteria
    from loka_jax.probe.report import save_report
    stats = self._stats(target)
    # Per site: the delayed-scaling forward pays alone (1.08x), not over a training step
    # (its backward at 0.92x), and per-pass FP8 is slow everywhere.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    bwd = dict(speedup=(0.9, 0.92, 0.94), base_us=200.0, **scope)
    fused = {"fwd": hm.entry(sqnr=37.6, speedup=fwd_speed),
             "grad_lhs": hm.entry(sqnr=55.0, **bwd), "grad_rhs": hm.entry(sqnr=55.0, **bwd)}
    slow = hm.entry(speedup=(0.8, 0.85, 0.9))
    report = hm.report({n: {**hm.site({p: {"xla_fp8_tensorwise": slow,
                                           "flax_fp8_delayed_fwd": fused[p]}
                                       for p in hm.PASSES}), "stats": st["stats"]}
                        for n, st in stats.items()}, model=target.model, preset=target.preset)
    plans = os.path.join(tempdir(self), "plans")
    os.makedirs(planning.plan_dir(plans, target.model, target.preset))
    save_report(report, planning.report_path(plans, target.model, target.preset))
    dispatch.save_plan(dispatch.select(report, Criteria()),
                       planning.plan_path(plans, target.model, target.preset))
    return plans, len(stats)

  def _loka_row(self, target, plans, serve_plan, serve_promotion=None, gate=False,
                budget=2e-4):
    # The gate is off where a test times the serving decision: on a 512-example eval set
    # e4m3 serving moves log loss by more than the 0.02% budget (+-0.09% standard error).
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    settings = suite.SpeedSettings(repeats=3, probe=False, plans_dir=plans, head_to_head=(),
                                   serve_plan=serve_plan, serve_promotion=serve_promotion,
                                   serve_quality_gate=gate, serve_quality_budget=budget,
                                   probe_steps=10)
    self.assertTrue(suite.run_target(target, variants.parse_variants(["loka"]), results,
                                     settings=settings, deadline=float("inf"), device="cpu",
                                     log=lambda _: None))
    row = {r["variant"]: r for r in results.rows()}["loka"]
    self.assertNotIn("error", row, row.get("traceback"))
    return row

  def test_loka_serves_the_serving_plans_export(self):
    from loka_jax import dispatch
    from experiments.bench import planning
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target)
    trained_only = self._loka_row(target, plans, serve_plan=False)
    self.assertEqual(trained_only["kernels"], ["xla_bf16"])
    self.assertEqual(trained_only["export_modes"], {"high": sites})
    self.assertTrue(targets.exports_every_site_high(trained_only))
    row = self._loka_row(target, plans, serve_plan=True)
    self.assertEqual(row["kernels"], ["xla_bf16"])          # it still trains in bf16
    self.assertEqual(row["serve_kernels"], ["flax_fp8_delayed_fwd"])
    self.assertEqual(row["export_modes"], {"fp8": sites})
    self.assertFalse(targets.exports_every_site_high(row))
    self.assertTrue(targets.same_program_as_bf16_mods(row))
    serving = dispatch.read_plan(row["serve_plan"])
    self.assertEqual(serving["provenance"]["objective"], "serve")
    self.assertEqual(row["serve_plan"], os.path.join(
        planning.plan_dir(plans, target.model, target.preset), "plan_serve.json"))
    # every forward is FP8 already: nothing to propose
    self.assertEqual(row["serve_promotion"]["sites"], 0)
    self.assertIn("no site served in xla_bf16", row["serve_promotion"]["skipped"])

  def test_a_forward_held_out_validation_backed_off_is_not_served_in_fp8(self):
    from loka_jax import dispatch
    from experiments.bench import planning
    target = suite.tower_targets(["32x16x2"])[0]
    for fwd_speed, where in (((1.06, 1.08, 1.13), "selected"), ((0.98, 1.03, 1.07), "proposal")):
      plans, _ = self._plans(target, fwd_speed=fwd_speed)
      path = planning.plan_path(plans, target.model, target.preset)
      trained = dispatch.read_plan(path)
      held, other = sorted(trained["sites"])[:2]
      dispatch.save_plan(dispatch.back_off(trained, held, None, "held-out +0.05%",
                                           step="quality_held_out"), path)
      selected, proposal, promoted = planning.select_serving(plans, target.model,
                                                             target.preset)
      served = {"selected": selected, "proposal": proposal}[where]
      self.assertEqual(served["sites"][other]["fwd"]["kernel"], "flax_fp8_delayed_fwd", where)
      for plan in (selected, proposal):
        self.assertEqual({p: e["kernel"] for p, e in plan["sites"][held].items()},
                         {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}, where)
      self.assertNotIn(held, promoted)
      self.assertEqual(bool(promoted), where == "proposal")
      record = [r for r in selected["validation"] if r.get("step") == "serve_selection"]
      if where == "selected":
        self.assertEqual([r["site"] for r in record], [held])
        self.assertIn("held-out +0.05%", record[0]["reason"])

  def _clip_scales(self, plans, target):
    """The report's activation amax 1000x too small: every FP8 export saturates."""
    from experiments.bench import planning
    from loka_jax.probe.report import save_report
    report = planning.load_report(plans, target.model, target.preset)
    for site in report["sites"].values():
      for operand in site["stats"].values():
        if isinstance(operand, dict) and "max" in (operand.get("amax") or {}):
          operand["amax"]["max"] = float(operand["amax"]["max"]) / 1000.0
    save_report(report, planning.report_path(plans, target.model, target.preset))

  def test_the_quality_gate_serves_no_export_outside_the_budget(self):
    from experiments.bench import served_check, serving_gate
    target = suite.tower_targets(["32x16x2"])[0]
    # The selected serving plan is FP8 everywhere, its scales clipped: outside the budget.
    # The training plan (bf16 everywhere) is served instead, which the gate scored within.
    plans, sites = self._plans(target)
    self._clip_scales(plans, target)
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True, gate=True)
    scores = serving_gate.load(plans, target.model, target.preset)
    self.assertEqual(sorted(scores), ["bf16_mods_served", "selected", "training"])
    self.assertFalse(scores["selected"]["within_budget"])
    self.assertTrue(scores["training"]["within_budget"])
    self.assertEqual(row["export_modes"], {"high": sites})
    record = self._promotion_record(row)
    self.assertIn("the selected serving plan is not served", record["quality_fallback"])
    self.assertIn("training plan", record["quality_fallback"])
    self.assertFalse(record["quality"]["selected"]["within_budget"])
    # The row carries the score of what it served, the training plan's export: the report
    # judges its inference verdicts by it (`served_check`).
    self.assertEqual(record["served"], "training")
    self.assertEqual(row["serve_promotion"]["quality"], record["quality"]["training"])
    self.assertEqual(row["serve_promotion"]["quality"]["rel_logloss_change"],
                     scores["training"]["vs_served_bf16_mods"]["rel_logloss_change"])
    self.assertTrue(served_check.for_row(row, {})["within_budget"])
    # The proposal (FP8 at every site the selected bf16 plan leaves) is outside it too: it
    # is neither timed nor served.
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    self._clip_scales(plans, target)
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True, gate=True)
    record = self._promotion_record(row)
    self.assertTrue(record["skipped"])
    self.assertIn("the proposal is not served", record["reason"])
    self.assertNotIn("infer", record)
    self.assertEqual(row["export_modes"], {"high": sites})
    # A later run reads the saved scores: the probe's state is not restored again.
    with mock.patch("loka_jax.dispatch.pipeline.context_for_run",
                    side_effect=AssertionError("scored again")):
      self.assertEqual(serving_gate.score(plans, target.model, target.preset, None),
                       serving_gate.load(plans, target.model, target.preset))

  def test_a_proposal_outside_the_budget_is_trimmed_to_its_most_accurate_forwards(self):
    from loka_jax import dispatch
    from experiments.bench import planning, serving_gate
    from loka_jax.probe.report import save_report
    target = suite.tower_targets(["32x16x2"])[0]
    # Selection serves bf16 everywhere; the proposal adds the delayed forward at every site.
    # One site reads least accurate in the report, and its export saturates (its activation
    # amax 1000x too small): the whole proposal is outside the budget, the rest within.
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    report = planning.load_report(plans, target.model, target.preset)
    bad = sorted(report["sites"])[0]
    for kernel, entry in report["sites"][bad]["passes"]["fwd"].items():
      if kernel != "xla_bf16":
        entry["sqnr_db"] = [26.0, 26.5, 27.0]
    for operand in report["sites"][bad]["stats"].values():
      if isinstance(operand, dict) and "max" in (operand.get("amax") or {}):
        operand["amax"]["max"] = float(operand["amax"]["max"]) / 1000.0
    save_report(report, planning.report_path(plans, target.model, target.preset))
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True, gate=True,
                         budget=0.02)
    scores = serving_gate.load(plans, target.model, target.preset)
    self.assertFalse(scores["proposal"]["within_budget"])
    self.assertTrue(scores["selected"]["within_budget"])
    trimmed = scores[serving_gate.TRIMMED]
    self.assertTrue(trimmed["within_budget"])
    self.assertEqual(sorted(trimmed["sites"]), sorted(set(report["sites"]) - {bad}))
    self.assertEqual(trimmed["export_modes"], {"fp8": sites - 1, "high": 1})
    saved = json.load(open(serving_gate.quality_path(plans, target.model, target.preset)))
    self.assertEqual(saved["trim"]["ranked"][-1], bad)          # least accurate last
    self.assertLessEqual(len(saved["trim"]["tried"]), serving_gate.TRIM_SCORINGS)
    # The bench timed the trimmed proposal in the whole one's place, and serves whichever
    # of it and the selected plan the timing kept, never the whole proposal.
    record = self._promotion_record(row)
    self.assertEqual(record["trimmed"]["kept"], trimmed["sites"])
    self.assertIn("the whole proposal is not served", record["trimmed"]["why"])
    self.assertIn("infer", record)
    served = dispatch.read_plan(row["serve_plan"])
    self.assertEqual(served["sites"][bad]["fwd"]["kernel"], "xla_bf16")
    self.assertEqual(record["served"], serving_gate.TRIMMED if record["promoted"] else "selected")
    self.assertEqual(row["serve_promotion"]["quality"], record["quality"][record["served"]])

  def test_with_every_candidate_outside_the_budget_every_forward_is_served_bf16(self):
    from experiments.bench import planning, serving_gate
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target)
    selected, _, _ = planning.select_serving(plans, target.model, target.preset)
    change = {"rel_logloss_change": 0.01, "se": 0.001}
    outside = {"within_budget": False, "budget": 2e-4, "vs_served_bf16_mods": change}
    served, candidate, why = serving.within_quality(
        selected, {"selected": outside, "training": outside},
        planning.plan_path(plans, target.model, target.preset))
    self.assertIn("every forward in bf16", why)
    self.assertEqual(candidate, serving_gate.ALL_BF16)
    self.assertEqual({c["fwd"]["kernel"] for c in served["sites"].values()}, {"xla_bf16"})
    self.assertLen([r for r in served["validation"] if r["step"] == "serve_quality"], sites)
    kept, candidate, why = serving.within_quality(
        selected, {"selected": {**outside, "within_budget": True}}, "unused")
    self.assertIs(kept, selected)
    self.assertEqual(candidate, "selected")
    self.assertIsNone(why)

  def test_a_corrupt_scores_file_is_refused_by_name(self):
    from experiments.bench import serving_gate
    plans = tempdir(self)
    path = serving_gate.quality_path(plans, "tower", "32x16x2")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
      f.write('{"served": {"selected": {"logloss": 0.5}}}')
    with self.assertRaisesRegex(ValueError, "serve_quality.json: no served-quality scores"):
      serving_gate.load(plans, "tower", "32x16x2")
    with open(path, "w") as f:
      f.write('{"served": ')
    with self.assertRaisesRegex(ValueError, "truncated or corrupt"):
      serving_gate.load(plans, "tower", "32x16x2")

  def _promotion_record(self, row):
    from loka_jax import dispatch
    records = [r for r in dispatch.read_plan(row["serve_plan"])["validation"]
               if r["step"] == "serve_promotion"]
    self.assertLen(records, 1)
    return records[0]

  def test_the_serving_proposal_is_timed_against_the_selected_plan_and_the_faster_kept(self):
    # The delayed forward reads 1.03x alone (under the 1.05x bar): selection serves bf16,
    # the proposal serves every site in FP8, and the two exports are timed (forced on: a
    # CPU's timing decides nothing about a GPU, only that the decision is carried out).
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True)
    record = self._promotion_record(row)
    self.assertLen(record["sites"], sites)
    lo, hi = record["infer"]["speedup_ci"]
    self.assertLessEqual(lo, record["infer"]["speedup"])
    self.assertLessEqual(record["infer"]["speedup"], hi)
    self.assertEqual(record["promoted"], lo > 1.0)
    self.assertEqual(row["serve_promotion"], {"sites": sites, "promoted": record["promoted"],
                                              "speedup": record["infer"]["speedup"],
                                              "speedup_ci": record["infer"]["speedup_ci"]})
    # the row serves what was kept, and a later run reads the decision instead of timing again
    self.assertEqual(row["export_modes"],
                     {"fp8": sites} if record["promoted"] else {"high": sites})
    again = self._loka_row(target, plans, serve_plan=True, serve_promotion=True)
    self.assertEqual(self._promotion_record(again), record)
    self.assertEqual(again["export_modes"], row["export_modes"])

  def test_a_proposal_that_fails_to_export_leaves_the_selected_plan_served(self):
    from loka_jax.dispatch import export as export_lib
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    real_export = export_lib.export

    def export_or_fail(model, params, plan, report, **kw):
      if any(plan["sites"][n]["fwd"]["kernel"] != "xla_bf16" for n in plan["sites"]):
        raise export_lib.ExportError("site mlp/dense_0: cannot store its weight")
      return real_export(model, params, plan, report, **kw)

    with mock.patch.object(export_lib, "export", side_effect=export_or_fail):
      row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True)
    record = self._promotion_record(row)
    self.assertTrue(record["skipped"])
    self.assertIn("the proposal failed: ExportError: site mlp/dense_0", record["reason"])
    self.assertEqual(row["export_modes"], {"high": sites})
    self.assertEqual(row["serve_promotion"]["sites"], sites)

  def test_off_a_gpu_the_serving_promotion_is_skipped_unless_forced(self):
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    row = self._loka_row(target, plans, serve_plan=True)
    record = self._promotion_record(row)
    self.assertTrue(record["skipped"])
    self.assertIn("not on a GPU", record["reason"])
    self.assertEqual(row["export_modes"], {"high": sites})
    self.assertEqual(row["serve_kernels"], ["xla_bf16"])


if __name__ == "__main__":
  absltest.main()
