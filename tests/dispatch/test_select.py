"""Dispatch selection on hand-made ProbeReports: eligibility boundaries, ties, fallbacks,
per-pass independence, per-site budgets, fused ops and every timing source."""
import copy
import os
import shutil
import tempfile

import chex
import numpy as np
from absl.testing import absltest, parameterized

import report_builders as hm
from loka_jax.dispatch import pipeline, selection
from loka_jax.probe import timing_table
from loka_jax.plan.file import Plan
from loka_jax.probe import eligibility
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.report import save_report

PASSES = hm.PASSES


def kernels_of(plan, site):
  return {p: plan["sites"][site][p]["kernel"] for p in PASSES}


def empty_dir():
  return tempfile.mkdtemp(prefix="loka_no_tables_")


class SelectTest(chex.TestCase):

  def test_fastest_eligible_kernel_wins_each_pass_independently(self):
    passes = {
        # fwd: tensorwise is faster but fails the forward bar (24 < 25 dB): rowwise wins
        "fwd": {"xla_fp8_rowwise": hm.entry(sqnr=27.0, speedup=(1.2, 1.3, 1.4)),
                "xla_fp8_tensorwise": hm.entry(sqnr=24.0, speedup=(1.5, 1.6, 1.7))},
        # dgrad: the same 24 dB passes the gradient bar (20 dB): tensorwise wins
        "grad_lhs": {"xla_fp8_rowwise": hm.entry(sqnr=27.0, speedup=(1.2, 1.3, 1.4)),
                     "xla_fp8_tensorwise": hm.entry(sqnr=24.0, speedup=(1.5, 1.6, 1.7))},
        # wgrad: both accurate, neither fast enough: bf16
        "grad_rhs": {"xla_fp8_rowwise": hm.entry(sqnr=27.0, speedup=(0.8, 0.9, 1.0)),
                     "xla_fp8_tensorwise": hm.entry(sqnr=24.0, speedup=(1.0, 1.04, 1.1))}}
    plan = selection.select(hm.report({"tower/dense_0": hm.site(passes)}), Criteria())
    self.assertEqual(kernels_of(plan, "tower/dense_0"),
                     {"fwd": "xla_fp8_rowwise", "grad_lhs": "xla_fp8_tensorwise",
                      "grad_rhs": "xla_bf16"})
    fwd = plan["sites"]["tower/dense_0"]["fwd"]
    self.assertEqual(fwd["reason"], "fastest eligible: 1.30x [1.20, 1.40], 27.0 dB")
    wgrad = plan["sites"]["tower/dense_0"]["grad_rhs"]["reason"]
    self.assertIn("no eligible kernel: best xla_fp8_tensorwise 1.04x [1.00, 1.10]", wgrad)
    self.assertIn("speedup 1.00x <= 1.05x", wgrad)
    self.assertEqual(plan["provenance"]["timing_source"]["kind"], "report")
    self.assertEqual(plan["default"], {p: "xla_bf16" for p in PASSES})

  @parameterized.parameters(
      # (field, value, eligible): the bar itself passes SQNR and underflow, fails speed
      ("sqnr", 25.0, True), ("sqnr", 24.99, False),
      ("underflow", 0.01, True), ("underflow", 0.0101, False),
      ("speedup", 1.05, False), ("speedup", 1.0501, True))
  def test_budget_boundaries(self, field, value, eligible):
    kwargs = {"sqnr": 30.0, "underflow": 0.001, "speedup": (1.3, 1.4, 1.5)}
    if field == "speedup":
      kwargs["speedup"] = (value, value + 0.1, value + 0.2)
    else:
      kwargs[field] = value
    plan = selection.select(hm.report({"s": hm.site({"fwd": {
        "xla_fp8_rowwise": hm.entry(**kwargs)}})}), Criteria())
    self.assertEqual(plan["sites"]["s"]["fwd"]["kernel"],
                     "xla_fp8_rowwise" if eligible else "xla_bf16")

  @parameterized.parameters((0.2, False), (0.1999, True))
  def test_mere_metric_boundary_and_paper_parity(self, mere_hi, eligible):
    # 10 dB would fail every SQNR bar: under metric='mere' only MERE counts
    e = hm.entry(sqnr=10.0, mere=mere_hi)
    rep = hm.report({"s": hm.site({"fwd": {"xla_fp8_rowwise": e}})})
    self.assertEqual(selection.select(rep, Criteria())["sites"]["s"]["fwd"]["kernel"], "xla_bf16")
    chosen = selection.select(rep, Criteria(metric="mere"))["sites"]["s"]["fwd"]
    self.assertEqual(chosen["kernel"], "xla_fp8_rowwise" if eligible else "xla_bf16")
    if eligible:
      self.assertIn(f"MERE {mere_hi:.3g}", chosen["reason"])

  def test_ties_are_broken_by_median_speed_then_accuracy_then_name(self):
    same = (1.2, 1.3, 1.4)
    cases = [
        # equal pessimistic speedup: the higher median wins
        ({"xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.3, 1.4)),
          "xla_fp8_tensorwise": hm.entry(speedup=(1.2, 1.35, 1.4))}, "xla_fp8_tensorwise"),
        # equal speed: more SQNR headroom wins
        ({"xla_fp8_rowwise": hm.entry(sqnr=31.0, speedup=same),
          "xla_fp8_tensorwise": hm.entry(sqnr=29.0, speedup=same)}, "xla_fp8_rowwise"),
        # all equal: alphabetical
        ({"xla_fp8_tensorwise": hm.entry(speedup=same),
          "xla_fp8_rowwise": hm.entry(speedup=same)}, "xla_fp8_rowwise"),
    ]
    for kernels, winner in cases:
      for order in (list(kernels), list(reversed(kernels))):
        passes = {"fwd": {k: kernels[k] for k in order}}
        plan = selection.select(hm.report({"s": hm.site(passes)}), Criteria())
        self.assertEqual(plan["sites"]["s"]["fwd"]["kernel"], winner, (kernels, order))

  def test_nothing_eligible_falls_back_to_bf16_naming_the_best_candidate(self):
    passes = {"fwd": {"xla_fp8_rowwise": hm.entry(sqnr=18.0, speedup=(1.3, 1.4, 1.5)),
                      "xla_fp8_tensorwise": hm.entry(sqnr=26.0, underflow=0.2,
                                                     speedup=(1.3, 1.4, 1.5))},
              "grad_lhs": {}}
    chosen = selection.select(hm.report({"s": hm.site(passes)}), Criteria())["sites"]["s"]
    self.assertEqual(chosen["fwd"]["kernel"], "xla_bf16")
    self.assertRegex(chosen["fwd"]["reason"], r"^no eligible kernel: best xla_fp8_")
    self.assertRegex(chosen["fwd"]["reason"], r"SQNR 18.0 dB < 25 dB|underflow 20.0% > 1%")
    self.assertEqual(chosen["grad_lhs"]["kernel"], "xla_bf16")
    self.assertIn("no FP8 candidate", chosen["grad_lhs"]["reason"])
    self.assertEqual(chosen["grad_rhs"], {"kernel": "xla_bf16",
                                          "reason": "pass grad_rhs not evaluated in the report"})

  def test_per_site_budgets_regex_first_match_wins(self):
    kernels = hm.same_passes({"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=(1.3, 1.4, 1.5))})
    rep = hm.report({name: hm.site(kernels) for name in
                     ("bottom/dense_0", "top/dense_0", "top/dense_1")})
    plan = selection.select(rep, Criteria(), budget_per_site=[
        ("top/dense_1", {"min_sqnr_fwd_db": 20.0}),   # first: looser, shadows the next one
        ("top/.*", Criteria(min_sqnr_fwd_db=30.0, min_sqnr_grad_db=30.0))])
    self.assertEqual(set(kernels_of(plan, "bottom/dense_0").values()), {"xla_fp8_rowwise"})
    self.assertEqual(set(kernels_of(plan, "top/dense_0").values()), {"xla_bf16"})
    self.assertEqual(set(kernels_of(plan, "top/dense_1").values()), {"xla_fp8_rowwise"})
    self.assertEqual([b["pattern"] for b in plan["provenance"]["budget"]["per_site"]],
                     ["top/dense_1", "top/.*"])
    with self.assertRaisesRegex(ValueError, "unknown field"):
      selection.select(rep, Criteria(), budget_per_site={"top/.*": {"min_sqnr": 3}})
    with self.assertRaisesRegex(ValueError, "not a regex"):
      selection.select(rep, Criteria(), budget_per_site={"top/(": {}})

  def test_fused_op_is_chosen_for_all_passes_or_none(self):
    per_pass = {"xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.3, 1.4))}
    scope = {"time_scope": "grad_lhs+grad_rhs"}

    def fused(fwd_speed, bwd_speed, grad_sqnr=30.0):
      # the fused backward is timed once for both gradient passes (vs 2 x 100 us of bf16)
      return {"fwd": hm.entry(speedup=fwd_speed),
              "grad_lhs": hm.entry(sqnr=grad_sqnr, speedup=bwd_speed, base_us=200.0, **scope),
              "grad_rhs": hm.entry(sqnr=grad_sqnr, speedup=bwd_speed, base_us=200.0, **scope)}

    def pick(fused_entries):
      passes = {p: {**copy.deepcopy(per_pass), "flax_fp8_delayed": fused_entries[p]}
                for p in PASSES}
      plan = selection.select(hm.report({"s": hm.site(passes)}), Criteria())
      return kernels_of(plan, "s"), plan

    chosen, plan = pick(fused((1.9, 2.0, 2.1), (1.6, 1.7, 1.8)))
    self.assertEqual(set(chosen.values()), {"flax_fp8_delayed"})
    self.assertIn("fused op safe in every pass and faster", plan["sites"]["s"]["fwd"]["reason"])
    # eligible everywhere but slower as a whole than the per-pass choice: per-pass stays
    chosen, _ = pick(fused((1.06, 1.1, 1.15), (1.06, 1.1, 1.15)))
    self.assertEqual(set(chosen.values()), {"xla_fp8_rowwise"})
    # much faster but one pass inaccurate: never chosen, not even for the good passes
    chosen, _ = pick(fused((3.0, 3.1, 3.2), (3.0, 3.1, 3.2), grad_sqnr=15.0))
    self.assertEqual(set(chosen.values()), {"xla_fp8_rowwise"})


  def test_the_plan_estimate_counts_a_fused_backward_once(self):
    # The fused op's backward is timed once (117.6 us at the median, vs 2 x 100 us of bf16)
    # and filed under both gradient passes: the GEMM-only estimate counts it once, against
    # the baseline's one-call backward where the entry holds it.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    bwd = dict(speedup=(1.6, 1.7, 1.8), base_us=200.0, **scope)
    for baseline_us, bf16_us in ((None, 300.0), ([178.0, 180.0, 182.0], 280.0)):
      extra = {"baseline_us": baseline_us} if baseline_us else {}
      passes = {"fwd": {"flax_fp8_delayed": hm.entry(speedup=(1.9, 2.0, 2.1))},
                "grad_lhs": {"flax_fp8_delayed": hm.entry(**bwd, **extra)},
                "grad_rhs": {"flax_fp8_delayed": hm.entry(**bwd, **extra)}}
      rep = hm.report({"s": hm.site(passes)})
      plan = selection.select(rep, Criteria())
      self.assertEqual(set(kernels_of(plan, "s").values()), {"flax_fp8_delayed"})
      got = pipeline.plan_speedup_estimate(plan, rep)
      self.assertEqual(got["source"], "measured")
      self.assertAlmostEqual(got["bf16_us"], bf16_us)
      self.assertAlmostEqual(got["plan_us"], 100.0 / 2.0 + 200.0 / 1.7)

  def test_the_flop_model_halves_only_the_passes_a_kernel_quantizes(self):
    # Untimed, the estimate falls back to FLOPs at 2x for FP8. The forward-only op names
    # itself in all three passes but runs its gradients in bf16: 100 + 100 + 50 of 300.
    untimed = {"flax_fp8_delayed_fwd": hm.entry(speedup=None),
               "flax_fp8_delayed": hm.entry(speedup=None)}
    rep = hm.report({"s": {**hm.site(hm.same_passes(untimed)), "flops": 100.0}})
    for kernel, want in (("flax_fp8_delayed_fwd", 300.0 / 250.0),
                         ("flax_fp8_delayed", 2.0)):
      plan = Plan({"schema": "loka.plan/1", "sites": {},
                   "default": {p: kernel for p in PASSES}})
      got = pipeline.plan_speedup_estimate(plan, rep)
      self.assertEqual(got["source"], "flop model", kernel)
      self.assertAlmostEqual(got["speedup"], want, msg=kernel)

  def test_a_fused_op_is_judged_fast_on_the_whole_site(self):
    # The delayed-scaling forward with bf16 gradients: a fast forward, its backward (timed
    # once for both gradients against bf16's 2 x 100 us) at bf16 speed. No per-pass FP8
    # kernel is fast here, so the per-pass choice is bf16 everywhere.
    scope = {"time_scope": "grad_lhs+grad_rhs"}

    def fwd_only(fwd_speed, grad_sqnr=55.0):
      bwd = dict(speedup=(0.99, 1.0, 1.01), base_us=200.0, **scope)
      return {"fwd": hm.entry(speedup=fwd_speed),
              "grad_lhs": hm.entry(sqnr=grad_sqnr, **bwd),
              "grad_rhs": hm.entry(sqnr=grad_sqnr, **bwd)}

    def report(entries, passes=PASSES):
      return hm.report({"s": hm.site(
          {p: {"xla_fp8_rowwise": hm.entry(speedup=(0.8, 0.9, 1.0)),
               "flax_fp8_delayed_fwd": entries[p]} for p in passes})})

    def verdicts(rep):
      info = selection.kernels_info(rep)
      return eligibility.assess_site({**rep, "kernels": info}, "s", Criteria())

    # Site speedup, pessimistic: (100 + 200) / (100 / 1.4 + 200 / 0.99) = 1.097 > 1.05.
    rep = report(fwd_only((1.4, 1.45, 1.5)))
    self.assertAlmostEqual(eligibility.fused_site_speedup(rep["sites"]["s"]["passes"],
                                                          "flax_fp8_delayed_fwd"),
                           300 / (100 / 1.4 + 200 / 0.99), places=6)
    chosen = kernels_of(selection.select(rep, Criteria()), "s")
    self.assertEqual(set(chosen.values()), {"flax_fp8_delayed_fwd"})
    self.assertTrue(all(v["flax_fp8_delayed_fwd"].eligible for v in verdicts(rep).values()))
    # (100 + 200) / (100 / 1.1 + 200 / 0.99) = 1.024: the forward alone does not pay.
    rep = report(fwd_only((1.1, 1.15, 1.2)))
    self.assertEqual(set(kernels_of(selection.select(rep, Criteria()), "s").values()),
                     {"xla_bf16"})
    for v in verdicts(rep).values():
      self.assertFalse(v["flax_fp8_delayed_fwd"].eligible)
      self.assertIn("fused op: site speedup 1.02x <= 1.05x", v["flax_fp8_delayed_fwd"].reasons)
    # An inaccurate gradient rules the op out in every pass, however fast the site.
    v = verdicts(report(fwd_only((3.0, 3.1, 3.2), grad_sqnr=12.0)))
    self.assertTrue(v["fwd"]["flax_fp8_delayed_fwd"].safe)
    self.assertIn("fused op: not every pass is safe", v["fwd"]["flax_fp8_delayed_fwd"].reasons)
    self.assertFalse(any(v[p]["flax_fp8_delayed_fwd"].eligible for p in PASSES))
    # A pass the report lacks: never eligible, and the verdict names it.
    v = verdicts(report(fwd_only((3.0, 3.1, 3.2)), passes=("fwd", "grad_lhs")))
    self.assertFalse(v["fwd"]["flax_fp8_delayed_fwd"].eligible)
    self.assertIn("fused op: grad_rhs not evaluated", v["fwd"]["flax_fp8_delayed_fwd"].reasons)

  def test_fp8_grad_lhs_alone_wins_where_the_weight_gradient_fails(self):
    # The largest tower's dense_2 (its probe report on an H200): full delayed scaling
    # fails grad_rhs (11 dB < 20 dB), the delayed forward keeps both gradients in bf16 at bf16
    # speed, and delayed scaling in the forward and grad_lhs only is safe in every pass and
    # faster over the site; it must be chosen for all three passes.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    fwd = hm.entry(sqnr=41.6, speedup=(1.40, 1.42, 1.45))

    def fused(grad_lhs_sqnr, grad_rhs_sqnr, bwd_speedup):
      bwd = dict(speedup=bwd_speedup, base_us=200.0, **scope)
      return {"fwd": fwd, "grad_lhs": hm.entry(sqnr=grad_lhs_sqnr, **bwd),
              "grad_rhs": hm.entry(sqnr=grad_rhs_sqnr, **bwd)}

    ops = {"flax_fp8_delayed": fused(25.6, 10.8, (1.40, 1.45, 1.5)),
           "flax_fp8_delayed_fwd": fused(51.5, 55.6, (0.99, 1.0, 1.01)),
           "flax_fp8_delayed_grad_lhs": fused(25.6, 55.6, (1.20, 1.25, 1.3))}
    rep = hm.report({"s": hm.site({p: {k: v[p] for k, v in ops.items()} for p in PASSES})})
    chosen = kernels_of(selection.select(rep, Criteria()), "s")
    self.assertEqual(set(chosen.values()), {"flax_fp8_delayed_grad_lhs"})
    info = selection.kernels_info(rep)
    v = eligibility.assess_site({**rep, "kernels": info}, "s", Criteria())
    self.assertFalse(v["fwd"]["flax_fp8_delayed"].eligible)
    self.assertTrue(all(v[p]["flax_fp8_delayed_grad_lhs"].eligible for p in PASSES))

  def test_per_pass_bf16_gradients_are_timed_as_the_fused_ops_backward_was(self):
    # A fast FP8 forward per pass with bf16 gradients, against the delayed forward with its
    # backward timed as one call. Summing bf16's two gradient passes timed apart (2 x 101 us
    # at worst) makes the per-pass choice look slower than bf16's backward timed as one call
    # (182 us at worst), which the fused op's timing carries as `baseline_us`.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    per_pass = {"fwd": {"xla_fp8_rowwise": hm.entry(speedup=(2.9, 3.0, 3.1))},
                "grad_lhs": {"xla_fp8_rowwise": hm.entry(speedup=(0.8, 0.9, 1.0))},
                "grad_rhs": {"xla_fp8_rowwise": hm.entry(speedup=(0.8, 0.9, 1.0))}}

    def pick(**one_call):
      bwd = hm.entry(speedup=(1.05, 1.1, 1.15), base_us=180.0, **scope, **one_call)
      fused = {"fwd": hm.entry(speedup=(1.9, 2.0, 2.1)), "grad_lhs": bwd, "grad_rhs": bwd}
      passes = {p: {**copy.deepcopy(per_pass[p]), "flax_fp8_delayed_fwd": fused[p]}
                for p in PASSES}
      return selection.select(hm.report({"s": hm.site(passes)}), Criteria())

    # Site times at the upper ends: fused 100 / 1.9 + 180 / 1.05 = 224.0 us; per pass
    # 100 / 2.9 + 2 x 101 = 236.5 us apart, or 100 / 2.9 + 182 = 216.5 us as one call.
    apart = pick()
    self.assertEqual(set(kernels_of(apart, "s").values()), {"flax_fp8_delayed_fwd"})
    self.assertIn("vs 236.5 us per-pass", apart["sites"]["s"]["fwd"]["reason"])
    one_call = pick(baseline_us=[178.0, 180.0, 182.0])
    self.assertEqual(kernels_of(one_call, "s"), {"fwd": "xla_fp8_rowwise",
                                                 "grad_lhs": "xla_bf16", "grad_rhs": "xla_bf16"})


class ServingPlanTest(chex.TestCase):
  """`objective="serve"`: forwards judged on the forward alone (the 8192x2048x8 tower's case:
  the delayed-scaling forward pays 1.08x alone, not over a training step)."""

  def _report(self, fwd_speed=(1.06, 1.08, 1.13), fwd_sqnr=37.6, per_pass_fwd=(0.84, 0.85, 0.86)):
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    bwd = dict(speedup=(0.9, 0.92, 0.94), base_us=200.0, **scope)
    ops = {"flax_fp8_delayed_fwd": {"fwd": hm.entry(sqnr=fwd_sqnr, speedup=fwd_speed),
                                    "grad_lhs": hm.entry(sqnr=55.0, **bwd),
                                    "grad_rhs": hm.entry(sqnr=55.0, **bwd)}}
    per_pass = {"fwd": hm.entry(speedup=per_pass_fwd),
                "grad_lhs": hm.entry(speedup=(0.97, 0.99, 1.02)),
                "grad_rhs": hm.entry(speedup=(0.62, 0.63, 0.69))}
    return hm.report({"s": hm.site({p: {"xla_fp8_tensorwise": per_pass[p],
                                        **{k: v[p] for k, v in ops.items()}}
                                    for p in PASSES})})

  def test_a_forward_that_pays_alone_is_served_though_training_keeps_bf16(self):
    rep = self._report()
    train = selection.select(rep, Criteria())
    self.assertEqual(set(kernels_of(train, "s").values()), {"xla_bf16"})
    serve = selection.select(rep, Criteria(), objective="serve")
    self.assertEqual(serve["provenance"]["objective"], "serve")
    self.assertEqual(train["provenance"]["objective"], "train")
    # a fused op runs every pass or none, so its name stands for the backward it never runs
    self.assertEqual(set(kernels_of(serve, "s").values()), {"flax_fp8_delayed_fwd"})
    self.assertIn("fastest eligible forward (serving)", serve["sites"]["s"]["fwd"]["reason"])
    self.assertIn("inference runs no backward", serve["sites"]["s"]["grad_rhs"]["reason"])
    from loka_jax.plan.file import to_kernel_plan
    self.assertEqual(to_kernel_plan(serve).choice_for("s").fwd, "flax_fp8_delayed_fwd")

  def test_of_ops_sharing_one_forward_the_one_with_bf16_gradients_is_named(self):
    # The three delayed ops run the same forward: one measurement, SQNR differing only by
    # sampling. Named for every pass, the op with bf16 gradients reads as what it serves.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    bwd = dict(speedup=(0.9, 0.92, 0.94), base_us=200.0, **scope)

    def op(fwd_sqnr, grad_lhs_sqnr, grad_rhs_sqnr):
      return {"fwd": hm.entry(sqnr=fwd_sqnr, speedup=(1.06, 1.08, 1.13)),
              "grad_lhs": hm.entry(sqnr=grad_lhs_sqnr, **bwd),
              "grad_rhs": hm.entry(sqnr=grad_rhs_sqnr, **bwd)}
    ops = {"flax_fp8_delayed": op(38.0, 25.0, 11.0),
           "flax_fp8_delayed_grad_lhs": op(37.8, 25.0, 55.0),
           "flax_fp8_delayed_fwd": op(37.6, 52.0, 55.0)}
    rep = hm.report({"s": hm.site({p: {k: v[p] for k, v in ops.items()} for p in PASSES})})
    serve = selection.select(rep, Criteria(), objective="serve")
    self.assertEqual(set(kernels_of(serve, "s").values()), {"flax_fp8_delayed_fwd"})
    # with a faster forward of its own, full delayed scaling would still win
    ops["flax_fp8_delayed"]["fwd"] = hm.entry(sqnr=38.0, speedup=(1.2, 1.25, 1.3))
    rep = hm.report({"s": hm.site({p: {k: v[p] for k, v in ops.items()} for p in PASSES})})
    serve = selection.select(rep, Criteria(), objective="serve")
    self.assertEqual(set(kernels_of(serve, "s").values()), {"flax_fp8_delayed"})

  def test_a_per_pass_forward_leaves_the_gradients_in_bf16(self):
    serve = selection.select(self._report(fwd_speed=(1.0, 1.01, 1.02),
                                          per_pass_fwd=(1.2, 1.25, 1.3)),
                             Criteria(), objective="serve")
    self.assertEqual(kernels_of(serve, "s"), {"fwd": "xla_fp8_tensorwise",
                                              "grad_lhs": "xla_bf16", "grad_rhs": "xla_bf16"})

  @parameterized.parameters(
      dict(fwd_speed=(1.04, 1.08, 1.13), fwd_sqnr=37.6, why="1.04x <= 1.05x"),
      dict(fwd_speed=(1.2, 1.3, 1.4), fwd_sqnr=20.0, why="SQNR 20.0 dB < 25 dB"))
  def test_a_slow_or_inaccurate_forward_is_not_served(self, fwd_speed, fwd_sqnr, why):
    serve = selection.select(self._report(fwd_speed=fwd_speed, fwd_sqnr=fwd_sqnr),
                             Criteria(), objective="serve")
    self.assertEqual(set(kernels_of(serve, "s").values()), {"xla_bf16"})
    self.assertIn("no eligible kernel", serve["sites"]["s"]["fwd"]["reason"])
    if "SQNR" not in why:
      self.assertIn(why, serve["sites"]["s"]["fwd"]["reason"])

  def test_an_unknown_objective_is_refused(self):
    with self.assertRaisesRegex(ValueError, "objective must be one of"):
      selection.select(self._report(), Criteria(), objective="infer")


class ServingProposalTest(chex.TestCase):
  """`serving_proposal`: sites served in bf16 whose forward is safe on accuracy alone, and
  that the export serves as a static-scale e4m3 dot, get that forward; nothing else moves."""

  def _report(self):
    def fwd_only(kernel, sqnr, speed):
      return {"fwd": {kernel: hm.entry(sqnr=sqnr, speedup=speed)},
              "grad_lhs": {}, "grad_rhs": {}}
    return hm.report({
        "alone_too_slow": hm.site(fwd_only("xla_fp8_tensorwise", 37.6, (0.98, 1.03, 1.07))),
        "rowwise_slow": hm.site(fwd_only("xla_fp8_rowwise", 40.0, (0.7, 0.75, 0.8))),
        "already_fast": hm.site(fwd_only("xla_fp8_tensorwise", 37.6, (1.06, 1.08, 1.13))),
        "inaccurate": hm.site(fwd_only("xla_fp8_tensorwise", 20.0, (1.2, 1.3, 1.4))),
        "block_scaled": hm.site(fwd_only("pallas_fp8_blockwise", 40.0, (0.9, 0.95, 1.0)))})

  def test_only_safe_static_scale_forwards_of_bf16_sites_are_proposed(self):
    rep = self._report()
    selected = selection.select(rep, Criteria(), objective="serve")
    proposal, changed = selection.serving_proposal(rep, selected, Criteria())
    self.assertEqual(sorted(changed), ["alone_too_slow", "rowwise_slow"])
    fwd = {n: proposal["sites"][n]["fwd"]["kernel"] for n in proposal["sites"]}
    self.assertEqual(fwd, {"alone_too_slow": "xla_fp8_tensorwise",
                           "rowwise_slow": "xla_fp8_rowwise",
                           "already_fast": "xla_fp8_tensorwise",
                           "inaccurate": "xla_bf16", "block_scaled": "xla_bf16"})
    self.assertEqual(proposal["sites"]["already_fast"], selected["sites"]["already_fast"])
    entry = proposal["sites"]["alone_too_slow"]["fwd"]
    self.assertEqual(entry["promoted_from"], "xla_bf16")
    self.assertIn("serving promotion from xla_bf16", entry["reason"])
    self.assertIn("accuracy only", entry["reason"])
    # the gradients a serving plan never runs stay where selection put them
    self.assertEqual(proposal["sites"]["alone_too_slow"]["grad_rhs"]["kernel"], "xla_bf16")
    self.assertEqual(proposal["provenance"], selected["provenance"])
    self.assertEqual(selected["sites"]["alone_too_slow"]["fwd"]["kernel"], "xla_bf16")

  def test_a_plan_with_nothing_left_to_promote_is_returned_as_is(self):
    rep = hm.report({"s": hm.site(hm.same_passes({"xla_fp8_tensorwise": hm.entry(
        sqnr=20.0, speedup=(0.8, 0.85, 0.9))}))})
    selected = selection.select(rep, Criteria(), objective="serve")
    proposal, changed = selection.serving_proposal(rep, selected, Criteria())
    self.assertEqual(changed, [])
    self.assertEqual(proposal.to_dict(), selected.to_dict())


class UnresolvedSpeedTest(chex.TestCase):
  """Speedups no timing resolves are not taken, even from reports measured before the probe
  judged them: an outer product's, and a chained call's under a kernel's own cost."""

  def test_an_outer_products_speedup_is_not_taken(self):
    # One output column: grad_lhs is [4096,1] . [1,256], a sum over K = 1 that XLA fuses.
    passes = hm.same_passes({"xla_fp8_rowwise": hm.entry(speedup=(6.8, 17.0, 23.9))})
    plan = selection.select(hm.report({"head/out": hm.site(passes, lhs=(4096, 256),
                                                           rhs=(256, 1))}), Criteria())
    self.assertEqual(kernels_of(plan, "head/out"),
                     {"fwd": "xla_fp8_rowwise", "grad_lhs": "xla_bf16",
                      "grad_rhs": "xla_fp8_rowwise"})
    self.assertIn("best xla_fp8_rowwise speed unresolved: an outer product (K = 1)",
                  plan["sites"]["head/out"]["grad_lhs"]["reason"])

  def test_a_chained_time_under_a_kernels_own_cost_is_not_taken(self):
    under = hm.entry(speedup=(2.5, 3.0, 3.5), base_us=1.5)        # 0.5 us a call
    over = hm.entry(speedup=(2.5, 3.0, 3.5), base_us=6.0)         # 2.0 us a call
    passes = {"fwd": {"xla_fp8_rowwise": under}, "grad_lhs": {"xla_fp8_rowwise": over},
              "grad_rhs": {"xla_fp8_rowwise": copy.deepcopy(over)}}
    plan = selection.select(hm.report({"s": hm.site(passes)}), Criteria())
    self.assertEqual(kernels_of(plan, "s"), {"fwd": "xla_bf16", "grad_lhs": "xla_fp8_rowwise",
                                             "grad_rhs": "xla_fp8_rowwise"})
    self.assertIn("the kernel timed 0.50 us a call", plan["sites"]["s"]["fwd"]["reason"])


class FusedTableTimingTest(chex.TestCase):

  def test_a_fused_backward_is_compared_with_baselines_of_its_own_run(self):
    # Run 1 timed bf16 and the fused delayed-scaling op at m=512 (estimated for m=256): its
    # backward (8 us, both gradients) against bf16's 10 + 10 us is 2.5x. Run 2 timed bf16
    # alone at m=300 for grad_rhs, nearer to m=256 and 4x slower: a baseline looked up on
    # its own would pair that run with the fused op's.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    run1 = hm.dense_table(hm.H100, 512, 64, 32, {
        "xla_bf16": {"fwd": 10.0, "grad_lhs": 10.0, "grad_rhs": 10.0},
        "flax_fp8_delayed": {"fwd": 5.0, "grad_lhs": 8.0, "grad_rhs": 8.0}})
    run1["entries"] = [{**e, **scope} if e["kernel"] == "flax_fp8_delayed" and e["pass"] != "fwd"
                       else e for e in run1["entries"]]
    run2 = hm.table_entry("xla_bf16", "grad_rhs", "mk,mn->kn", (300, 64), (300, 32), 40.0)
    table = timing_table.merge_entries(run1, [run2])
    rep = hm.report({"s": hm.site(hm.same_passes({"flax_fp8_delayed": hm.entry()}))})
    source = selection.TimingSource("table", {"kind": "table"}, table=table)
    site, _ = selection.effective_site(rep, "s", source)
    for p in ("grad_lhs", "grad_rhs"):
      entry = site["passes"][p]["flax_fp8_delayed"]
      self.assertEqual(entry["timing"], "estimated")
      np.testing.assert_allclose(entry["speedup"], [2.5, 2.5, 2.5], rtol=1e-6)
    np.testing.assert_allclose(site["passes"]["fwd"]["flax_fp8_delayed"]["speedup"][1], 2.0,
                               rtol=1e-6)


class TimingSourceTest(chex.TestCase):

  def _report(self, timing_valid):
    kernels = {"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=(1.3, 1.4, 1.5))}
    return hm.report({"s": hm.site(hm.same_passes(kernels), lhs=(256, 64), rhs=(64, 32))},
                     timing_valid=timing_valid, device="cpu" if not timing_valid else hm.H100)

  def _table_dir(self, m):
    directory = tempfile.mkdtemp(prefix="loka_tables_")
    table = hm.dense_table(hm.H100, m, 64, 32, {
        "xla_bf16": {"fwd": 10.0, "grad_lhs": 10.0, "grad_rhs": 10.0},
        # fwd 1.43x (eligible), dgrad 0.83x (too slow), wgrad not measured
        "xla_fp8_rowwise": {"fwd": 7.0, "grad_lhs": 12.0}})
    timing_table.save_table(table, timing_table.table_path(hm.H100, directory))
    return directory

  @parameterized.parameters((256, "table"), (512, "estimated"))
  def test_invalid_report_timings_come_from_the_target_devices_table(self, m, mark):
    plan = selection.select(self._report(False), Criteria(), target_device=hm.H100,
                            table_dir=self._table_dir(m))
    chosen = plan["sites"]["s"]
    self.assertEqual(kernels_of(plan, "s"), {"fwd": "xla_fp8_rowwise", "grad_lhs": "xla_bf16",
                                             "grad_rhs": "xla_bf16"})
    self.assertIn(f"({mark})", chosen["fwd"]["reason"])
    self.assertEqual(chosen["fwd"]["timing"], mark)
    np.testing.assert_allclose(chosen["fwd"]["speedup"][1], 10.0 / 7.0, rtol=1e-6)
    self.assertIn("speedup 0.8", chosen["grad_lhs"]["reason"])
    self.assertIn("no timing", chosen["grad_rhs"]["reason"])
    ts = plan["provenance"]["timing_source"]
    self.assertEqual((ts["kind"], ts["device"]), ("table", hm.H100))
    self.assertIn("timing_valid=false", ts["reason"])

  def test_report_speedups_are_ignored_when_not_valid(self):
    # the report claims 1.4x everywhere, but made on a CPU it proves nothing
    plan = selection.select(self._report(False), Criteria(), table_dir=empty_dir())
    self.assertEqual(set(kernels_of(plan, "s").values()), {"xla_bf16"})
    reason = plan["sites"]["s"]["fwd"]["reason"]
    self.assertIn("no FP8 without timings", reason)
    self.assertIn("no timing table is committed", reason)
    self.assertIn("safe: xla_fp8_rowwise (28.0 dB)", reason)
    self.assertEqual(plan["provenance"]["timing_source"]["kind"], "none")
    missing = selection.select(self._report(False), Criteria(), target_device="NVIDIA B200",
                               table_dir=self._table_dir(256))
    self.assertIn("no committed timing table for NVIDIA B200",
                  missing["provenance"]["timing_source"]["reason"])

  def test_accuracy_only_criteria_need_no_timings(self):
    plan = selection.select(self._report(False), Criteria(min_speedup=None),
                            table_dir=empty_dir())
    self.assertEqual(set(kernels_of(plan, "s").values()), {"xla_fp8_rowwise"})
    self.assertEqual(plan["sites"]["s"]["fwd"]["reason"],
                     "most accurate safe (accuracy only, speed unknown): 28.0 dB")

  def test_a_safe_kernel_slower_than_bf16_is_never_called_fastest(self):
    # On accuracy alone the only safe FP8 kernel wins though it runs at a third of bf16.
    slow = hm.report({"s": hm.site(hm.same_passes(
        {"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=(0.30, 0.33, 0.36))}))})
    plan = selection.select(slow, Criteria(min_speedup=None), table_dir=empty_dir())
    self.assertEqual(set(kernels_of(plan, "s").values()), {"xla_fp8_rowwise"})
    for p in PASSES:
      reason = plan["sites"]["s"][p]["reason"]
      self.assertTrue(reason.startswith("safe, chosen on accuracy only, slower than bf16: "
                                        "0.33x"), reason)
      self.assertNotIn("fastest", reason)
    fast = hm.report({"s": hm.site(hm.same_passes(
        {"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=(1.2, 1.3, 1.4))}))})
    plan = selection.select(fast, Criteria(min_speedup=None), table_dir=empty_dir())
    self.assertTrue(plan["sites"]["s"]["fwd"]["reason"].startswith(
        "fastest safe (accuracy only): 1.30x"))

  def test_valid_report_for_another_target_device_uses_that_devices_table(self):
    rep = self._report(True)
    own = selection.select(rep, Criteria(), table_dir=empty_dir())
    self.assertEqual(set(kernels_of(own, "s").values()), {"xla_fp8_rowwise"})
    other = selection.select(rep, Criteria(), target_device="NVIDIA H200",
                             table_dir=empty_dir())
    self.assertEqual(set(kernels_of(other, "s").values()), {"xla_bf16"})
    self.assertIn("not the target NVIDIA H200", other["provenance"]["timing_source"]["reason"])

  def test_a_valid_reports_untimed_passes_are_filled_from_its_devices_table(self):
    # The probe timed tensorwise (1.4x, its own measurement) but left rowwise untimed; the
    # card's table has rowwise at 2x bf16 in the forward and 0.83x in the input gradient,
    # and tensorwise at 0.5x, which the report's own timing overrides.
    rep = hm.rowwise_untimed_report()
    directory = tempfile.mkdtemp(prefix="loka_tables_")
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    table = hm.save_h100_table(directory, {
        "xla_fp8_tensorwise": {"fwd": 20.0, "grad_lhs": 20.0, "grad_rhs": 20.0},
        "xla_fp8_rowwise": {"fwd": 5.0, "grad_lhs": 12.0}})
    plain = selection.select(rep, Criteria(), table_dir=directory)
    self.assertEqual(set(kernels_of(plain, "s").values()), {"xla_fp8_tensorwise"})
    filled = selection.select(rep, Criteria(), table_dir=directory, fill_from_table=True)
    self.assertEqual(kernels_of(filled, "s"), {"fwd": "xla_fp8_rowwise",
                                               "grad_lhs": "xla_fp8_tensorwise",
                                               "grad_rhs": "xla_fp8_tensorwise"})
    chosen = filled["sites"]["s"]
    self.assertIn("2.00x", chosen["fwd"]["reason"])
    self.assertIn("(table)", chosen["fwd"]["reason"])
    self.assertEqual(chosen["fwd"]["timing"], "table")
    self.assertIn("1.40x", chosen["grad_lhs"]["reason"])   # the report's own timing stays
    ts = filled["provenance"]["timing_source"]
    self.assertEqual((ts["kind"], ts["fill_table"]),
                     ("report", timing_table.table_path(hm.H100, directory)))
    self.assertIn("left untimed from the committed table", ts["reason"])
    # Without a table of the report's card there is nothing to fill from, and it says so;
    # a named table of another card is an error.
    none = selection.select(rep, Criteria(), table_dir=empty_dir(), fill_from_table=True)
    self.assertEqual(set(kernels_of(none, "s").values()), {"xla_fp8_tensorwise"})
    self.assertIn("no committed timing table of", none["provenance"]["timing_source"]["note"])
    other = {**table, "device_kind": "NVIDIA H200"}
    with self.assertRaisesRegex(timing_table.TimingTableError, "not the report's"):
      selection.select(rep, Criteria(), timing_table=other, fill_from_table=True)

  def test_explicit_table_for_the_wrong_device_is_an_error(self):
    directory = self._table_dir(256)
    path = timing_table.table_path(hm.H100, directory)
    with self.assertRaisesRegex(timing_table.TimingTableError, "not the target"):
      selection.select(self._report(False), Criteria(), timing_table=path,
                       target_device="NVIDIA H200", table_dir=directory)


class SelectProvenanceTest(chex.TestCase):

  def test_report_path_hash_and_unregistered_kernels(self):
    kernels = {"xla_fp8_rowwise": hm.entry(speedup=(1.1, 1.2, 1.3)),
               "vendor_fp8_magic": hm.entry(speedup=(3.0, 3.1, 3.2))}
    rep = hm.report({"s": hm.site(hm.same_passes(kernels))})
    path = os.path.join(tempfile.mkdtemp(), "probe_report.json")
    written = save_report(rep, path)
    plan = selection.select(path, Criteria())
    self.assertIsInstance(plan, Plan)
    self.assertEqual(plan["provenance"]["report_path"], path)
    self.assertEqual(plan["provenance"]["report_sha256"], selection.report_hash(written))
    changed = copy.deepcopy(written)
    changed["sites"]["s"]["passes"]["fwd"]["xla_fp8_rowwise"]["samples"] = 17
    self.assertNotEqual(selection.report_hash(changed), selection.report_hash(written))
    # a faster kernel this checkout does not have is never chosen
    self.assertEqual(set(kernels_of(plan, "s").values()), {"xla_fp8_rowwise"})
    self.assertEqual(plan["model"], "toy")


class RandomReportsTest(chex.TestCase):
  """Selection agrees with a direct reading of the rules on random reports."""

  def test_against_an_independent_oracle(self):
    names = ["xla_fp8_rowwise", "xla_fp8_tensorwise", "xla_fp8_rowwise_fastacc",
             "xla_fp8_tensorwise_precise"]
    bars = {"fwd": 25.0, "grad_lhs": 20.0, "grad_rhs": 20.0}
    checked = {"fp8": 0, "bf16": 0}
    for seed in range(30):
      rng = np.random.default_rng(seed)
      sites, truth = {}, {}
      for s in range(3):
        passes = {}
        for p in PASSES:
          kernels, best = {}, ("xla_bf16", None)
          for k in rng.permutation(names)[:rng.integers(1, len(names) + 1)]:
            sqnr = float(rng.uniform(15, 35))
            underflow = float(rng.uniform(0, 0.02))
            lo = float(rng.uniform(0.8, 1.6))
            speed = (lo, lo + float(rng.uniform(0, 0.2)), lo + 0.3)
            kernels[str(k)] = hm.entry(sqnr=sqnr, underflow=underflow, speedup=speed)
            if sqnr >= bars[p] and underflow <= 0.01 and lo > 1.05:
              if best[1] is None or lo > best[1]:
                best = (str(k), lo)
          passes[p] = kernels
          truth[(f"site_{s}", p)] = best[0]
        sites[f"site_{s}"] = hm.site(passes)
      plan = selection.select(hm.report(sites), Criteria())
      for (name, p), kernel in truth.items():
        self.assertEqual(plan["sites"][name][p]["kernel"], kernel, (seed, name, p))
        checked["bf16" if kernel == "xla_bf16" else "fp8"] += 1
    # both outcomes were exercised
    self.assertGreater(checked["fp8"], 20)
    self.assertGreater(checked["bf16"], 20)


if __name__ == "__main__":
  absltest.main()
