"""`python -m experiments.dispatch`: report -> plan file, choice table, model check, errors."""
import os
import tempfile

import chex
from absl.testing import absltest

import report_builders as hm
from cli_helpers import run_module
from loka_jax import dispatch
from loka_jax.probe import timing_table
from loka_jax.probe.report import save_report

# The tiny DLRM's act x weight sites and their shapes at batch 16.
DLRM_TINY = {"bottom_mlp/dense_0": ((16, 8), (8, 32)), "bottom_mlp/dense_1": ((16, 32), (32, 16)),
             "top_mlp/dense_0": ((16, 52), (52, 64)), "top_mlp/dense_1": ((16, 64), (64, 32)),
             "top_mlp/dense_2": ((16, 32), (32, 1))}


def run_cli(*args):
  return run_module("experiments.dispatch", *args, timeout=120)


class DispatchCliTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    kernels = {"xla_fp8_rowwise": hm.entry(sqnr=28.0, mere=0.05, speedup=(1.2, 1.3, 1.4)),
               "xla_fp8_tensorwise": hm.entry(sqnr=22.0, mere=0.08, speedup=(1.4, 1.5, 1.6))}
    sites = {n: hm.site(hm.same_passes(kernels), lhs=l, rhs=r) for n, (l, r) in DLRM_TINY.items()}
    report = hm.report(sites, model="dlrm", run={"model": "dlrm", "preset": "tiny",
                                                 "data": "synthetic", "mods": [], "seed": 0,
                                                 "batch_size": 16})
    cls.workdir = tempfile.mkdtemp(prefix="loka_dispatch_cli_")
    cls.report_path = os.path.join(cls.workdir, "probe_report.json")
    save_report(report, cls.report_path)

  def test_writes_the_plan_and_prints_the_choice_table(self):
    out = os.path.join(self.workdir, "plan.json")
    result = run_cli(f"--config.report={self.report_path}", f"--config.out={out}")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    plan = dispatch.read_plan(out)
    self.assertEqual({plan["sites"][n]["fwd"]["kernel"] for n in DLRM_TINY}, {"xla_fp8_rowwise"})
    # top_mlp/dense_2 has one output column: its grad_lhs is an outer product (K = 1), whose
    # speedup no timing resolves, so it stays bf16.
    self.assertEqual({n: plan["sites"][n]["grad_lhs"]["kernel"] for n in DLRM_TINY},
                     {**{n: "xla_fp8_tensorwise" for n in DLRM_TINY},
                      "top_mlp/dense_2": "xla_bf16"})
    self.assertEqual(plan["provenance"]["report_path"], os.path.abspath(self.report_path))
    self.assertRegex(result.stdout, r"top_mlp/dense_2\s+fwd\s+xla_fp8_rowwise\s+fastest "
                                    r"eligible: 1.30x \[1.20, 1.40\], 28.0 dB")
    self.assertIn("dgrad: xla_fp8_tensorwise x4", result.stdout)
    self.assertIn("check: plan fits dlrm/tiny (6 sites, batch 16)", result.stdout)

  def test_mere_budget_and_per_site_budgets(self):
    out = os.path.join(self.workdir, "plan_mere.json")
    result = run_cli(f"--config.report={self.report_path}", f"--config.out={out}",
                     "--config.select.metric=mere", "--config.select.max_error=0.06",
                     "--config.check=false",
                     '--config.select.site_budgets={"top_mlp/.*": {"max_mere": 0.01}}')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    plan = dispatch.read_plan(out)
    # MERE 0.05 passes 0.06, 0.08 does not: rowwise everywhere but on the strict top MLP
    self.assertEqual(plan["sites"]["bottom_mlp/dense_0"]["grad_lhs"]["kernel"],
                     "xla_fp8_rowwise")
    self.assertEqual(plan["sites"]["top_mlp/dense_1"]["fwd"]["kernel"], "xla_bf16")
    self.assertEqual(plan["provenance"]["budget"]["default"]["max_mere"], 0.06)
    self.assertIn("check: not checked", result.stdout)

  def test_the_weight_gradient_bar_can_be_set_apart_from_the_input_gradient_bar(self):
    # One kernel, accurate in the forward and the input gradient (28 dB) and not in the
    # weight gradient (12 dB), as the delayed op's weight gradients at Wukong `large`.
    good = {"xla_fp8_tensorwise": hm.entry(sqnr=28.0, speedup=(1.4, 1.5, 1.6))}
    poor = {"xla_fp8_tensorwise": hm.entry(sqnr=12.0, speedup=(1.4, 1.5, 1.6))}
    sites = {"top_mlp/dense_0": hm.site({"fwd": good, "grad_lhs": good, "grad_rhs": poor},
                                        lhs=(16, 52), rhs=(52, 64))}
    report_path = os.path.join(self.workdir, "probe_report_wgrad.json")
    save_report(hm.report(sites), report_path)

    def kernels(*flags):
      out = os.path.join(self.workdir, "plan_wgrad.json")
      result = run_cli(f"--config.report={report_path}", f"--config.out={out}",
                       "--config.check=false", *flags)
      self.assertEqual(result.returncode, 0, result.stderr[-3000:])
      plan = dispatch.read_plan(out)
      return ({p: c["kernel"] for p, c in plan["sites"]["top_mlp/dense_0"].items()},
              plan["provenance"]["budget"]["default"])
    chosen, budget = kernels()
    self.assertEqual(chosen, {"fwd": "xla_fp8_tensorwise", "grad_lhs": "xla_fp8_tensorwise",
                              "grad_rhs": "xla_bf16"})
    self.assertIsNone(budget["min_sqnr_wgrad_db"])
    chosen, budget = kernels("--config.select.min_sqnr_wgrad_db=10")
    self.assertEqual(chosen["grad_rhs"], "xla_fp8_tensorwise")
    self.assertEqual(budget["min_sqnr_wgrad_db"], 10.0)
    # The gradient bar then holds for the input gradient alone.
    chosen, _ = kernels("--config.select.min_sqnr_grad_db=30",
                        "--config.select.min_sqnr_wgrad_db=10")
    self.assertEqual(chosen, {"fwd": "xla_fp8_tensorwise", "grad_lhs": "xla_bf16",
                              "grad_rhs": "xla_fp8_tensorwise"})

  def test_a_serving_plan_keeps_every_gradient_in_bf16(self):
    out = os.path.join(self.workdir, "plan_serve.json")
    result = run_cli(f"--config.report={self.report_path}", f"--config.out={out}",
                     "--config.select.objective=serve", "--config.check=false")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    plan = dispatch.read_plan(out)
    self.assertEqual(plan["provenance"]["objective"], "serve")
    # the fastest eligible forward (tensorwise fails the 25 dB forward bar; rowwise passes)
    self.assertEqual({plan["sites"][n]["fwd"]["kernel"] for n in DLRM_TINY}, {"xla_fp8_rowwise"})
    self.assertEqual({plan["sites"][n][p]["kernel"] for n in DLRM_TINY
                      for p in ("grad_lhs", "grad_rhs")}, {"xla_bf16"})
    self.assertIn("serving plan: inference runs no backward", result.stdout)

  def test_a_serving_proposal_puts_the_accurate_forwards_the_speed_bar_left_in_fp8(self):
    out = os.path.join(self.workdir, "plan_serve_strict.json")
    proposal_path = os.path.join(self.workdir, "plan_serve_proposal.json")
    # rowwise's forward (1.20x pessimistic) misses a 1.5x bar: the plan serves bf16
    result = run_cli(f"--config.report={self.report_path}", f"--config.out={out}",
                     "--config.select.objective=serve", "--config.select.min_speedup=1.5",
                     "--config.check=false", f"--config.serving_proposal={proposal_path}")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    plan, proposal = dispatch.read_plan(out), dispatch.read_plan(proposal_path)
    self.assertEqual({plan["sites"][n]["fwd"]["kernel"] for n in DLRM_TINY}, {"xla_bf16"})
    # tensorwise fails the 25 dB forward bar; rowwise is safe and the export serves it
    self.assertEqual({proposal["sites"][n]["fwd"]["kernel"] for n in DLRM_TINY},
                     {"xla_fp8_rowwise"})
    self.assertEqual({proposal["sites"][n][p]["kernel"] for n in DLRM_TINY
                      for p in ("grad_lhs", "grad_rhs")}, {"xla_bf16"})
    self.assertIn(f"serving proposal: {len(DLRM_TINY)} more FP8 forward(s)", result.stdout)
    self.assertIn("untimed", result.stdout)
    refused = run_cli(f"--config.report={self.report_path}", f"--config.out={out}",
                      f"--config.serving_proposal={proposal_path}")
    self.assertNotEqual(refused.returncode, 0)
    self.assertIn("--config.serving_proposal needs --config.select.objective=serve",
                  refused.stderr)

  def test_a_valid_reports_untimed_kernel_is_timed_from_the_named_table(self):
    # The probe left rowwise untimed everywhere; the card's table times it at one site's
    # shape: 2x bf16 in the forward, slower in both gradients.
    untimed = {"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=None)}
    report = hm.report({n: hm.site(hm.same_passes(untimed), lhs=l, rhs=r)
                        for n, (l, r) in DLRM_TINY.items()}, model="dlrm")
    report_path = os.path.join(self.workdir, "untimed_report.json")
    save_report(report, report_path)
    table_path = os.path.join(self.workdir, "table.json")
    timing_table.save_table(hm.dense_table(hm.H100, 16, 8, 32, {
        "xla_bf16": {"fwd": 10.0, "grad_lhs": 10.0, "grad_rhs": 10.0},
        "xla_fp8_rowwise": {"fwd": 5.0, "grad_lhs": 20.0, "grad_rhs": 20.0}}), table_path)
    plans = {}
    for fill in ("false", "true"):
      out = os.path.join(self.workdir, f"plan_fill_{fill}.json")
      result = run_cli(f"--config.report={report_path}", f"--config.out={out}",
                       f"--config.timing.table={table_path}", "--config.check=false",
                       f"--config.timing.fill_from_table={fill}")
      self.assertEqual(result.returncode, 0, result.stderr[-3000:])
      plans[fill] = dispatch.read_plan(out)
    fp8 = lambda plan: {(n, p) for n, s in plan["sites"].items() for p, e in s.items()
                        if e["kernel"] != "xla_bf16"}
    self.assertEqual(fp8(plans["false"]), set())
    # Every forward takes it: exact at the timed shape, from the nearest one elsewhere.
    self.assertEqual(fp8(plans["true"]), {(n, "fwd") for n in DLRM_TINY})
    marks = {n: plans["true"]["sites"][n]["fwd"]["timing"] for n in DLRM_TINY}
    self.assertEqual(marks, {n: "table" if n == "bottom_mlp/dense_0" else "estimated"
                             for n in DLRM_TINY})
    self.assertIn("2.00x", plans["true"]["sites"]["bottom_mlp/dense_0"]["fwd"]["reason"])

  def test_a_plan_that_does_not_fit_the_model_fails_listing_the_sites(self):
    out = os.path.join(self.workdir, "plan_wukong.json")
    result = run_cli(f"--config.report={self.report_path}", f"--config.out={out}",
                     "--config.run.model=wukong")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("unknown site(s) ['top_mlp/dense_0', 'top_mlp/dense_1', 'top_mlp/dense_2']",
                  result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    self.assertFalse(os.path.exists(out))
    missing = run_cli(f"--config.report={os.path.join(self.workdir, 'none.json')}",
                      f"--config.out={out}")
    self.assertNotEqual(missing.returncode, 0)
    self.assertIn("cannot read the probe report", missing.stderr)
    self.assertNotIn("Traceback", missing.stderr)


if __name__ == "__main__":
  absltest.main()
