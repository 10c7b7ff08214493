"""The served model's held-out quality: each export scored on the probe's trained parameters,
paired with bf16+Mods, on a tiny DLRM probed on the CPU (its trained state and real probe
statistics), and the measurement's CLI on that planned target."""
import copy
import json
import os
import shutil
import tempfile

import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from experiments.bench import planning, suite
from loka_jax.dispatch import export as export_lib
from loka_jax.dispatch import pipeline, serve_quality
from loka_jax.dispatch.validate import BASELINE
from loka_jax.probe import ProbeOptions
from loka_jax.train.metrics import bce_with_logits
from plan_builders import make_plan

BATCH = 64
TARGET = suite.Target("models", "dlrm", "tiny")
PROBED = {}


def setUpModule():
  """One probe of the tiny DLRM target, planned as the bench plans it: both test classes read
  it (the exports are scored on its trained state and statistics; the CLI finds the target
  planned). The top MLP's three sites make a planned target as well as all six (the
  measurement reads the plan whatever it covers), at half the probe's evaluation."""
  root = tempfile.mkdtemp(prefix="loka_serve_quality_")
  plans = os.path.join(root, "plans")
  spec, config = suite.probe_run(TARGET, suite.SpeedSettings(plans_dir=plans, probe_steps=4))
  result = pipeline.probe_and_plan(
      spec, planning.plan_dir(plans, "dlrm", "tiny"), train_config=config, validation=None,
      probe_options=ProbeOptions(samples=2, repeats=2, bootstrap=20, plots=False,
                                 site_plots=False, kernels=("xla_bf16", "xla_fp8_rowwise"),
                                 sites="top_mlp"))
  PROBED.update(root=root, plans=plans, spec=spec, config=config, result=result)


def tearDownModule():
  shutil.rmtree(PROBED["root"], ignore_errors=True)


class ServedQualityTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    result = PROBED["result"]
    cls.ctx = pipeline.context_for_run(PROBED["spec"], result.paths["probe_dir"],
                                       PROBED["config"])
    cls.report = {"sites": {n: {"stats": site["stats"]}
                            for n, site in result.report["sites"].items()}}
    cls.plan = make_plan(cls.report["sites"])   # FP8 forwards at every site but the last
    cls.measured = cls._measure(cls.report)      # the plan as probed: three tests read it

  @classmethod
  def _measure(cls, report):
    return serve_quality.served_quality(cls.ctx, {"plan": cls.plan}, report)

  def test_each_export_is_scored_on_its_own_forward(self):
    got = self.measured
    # The same number from the exported model applied by hand to the held-out batches.
    exported = export_lib.export(self.ctx.build(BASELINE), self.ctx.state.params, self.plan,
                                 self.report, batch=self.ctx.batch())
    losses = [np.asarray(bce_with_logits(exported.apply(b), b["label"]))
              for b in self.ctx.source.eval_batches(BATCH)]
    self.assertAlmostEqual(got["plan"]["logloss"], float(np.mean(np.concatenate(losses))),
                           places=5)
    self.assertEqual(got["plan"]["num_examples"], TARGET.plan_eval_examples())
    self.assertGreater(got["plan"]["export_modes"]["fp8"], 0)
    fp8 = got["plan"]["vs_served_bf16_mods"]
    self.assertNotEqual(fp8["rel_logloss_change"], 0.0)   # e4m3 serving moves the loss
    self.assertGreater(fp8["se"], 0.0)

  def test_bf16_mods_served_from_its_export_scores_as_unexported(self):
    served = self.measured[serve_quality.SERVED_BF16]
    self.assertEqual(served["export_modes"].get("fp8", 0), 0)
    self.assertLess(abs(served["vs_bf16_mods"]["rel_logloss_change"]), 1e-5)
    self.assertTrue(served["within_budget"])

  def test_an_export_clipped_by_its_scales_is_out_of_budget(self):
    # Activation scales from amax 1000x too small: nearly every activation saturates.
    clipped = copy.deepcopy(self.report)
    for site in clipped["sites"].values():
      for operand in site["stats"].values():
        if isinstance(operand, dict) and "max" in (operand.get("amax") or {}):
          operand["amax"]["max"] = float(operand["amax"]["max"]) / 1000.0
    good = self.measured["plan"]["vs_served_bf16_mods"]
    bad = self._measure(clipped)["plan"]
    change = bad["vs_served_bf16_mods"]
    self.assertFalse(bad["within_budget"])
    self.assertGreater(abs(change["rel_logloss_change"]),
                       max(10 * abs(good["rel_logloss_change"]), 2 * change["se"]))


if __name__ == "__main__":
  absltest.main()


class CliTest(absltest.TestCase):

  def test_scores_a_planned_targets_exports_and_writes_them(self):
    plans, root = PROBED["plans"], PROBED["root"]
    out = os.path.join(root, "served.json")
    run = run_module("experiments.measure", "serving_quality", "--target=dlrm/tiny",
                     f"--plans_dir={plans}", "--probe_steps=4", f"--out={out}")
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    written = json.load(open(out))
    self.assertEqual(written["target"], "dlrm/tiny")
    self.assertEqual(sorted(written["served"]), ["bf16_mods_served", "loka"])
    self.assertEqual(written["served"]["loka"]["num_examples"], TARGET.plan_eval_examples())
    self.assertIn("| loka |", run.stdout)
    missing = run_module("experiments.measure", "serving_quality", "--target=dlrm/small",
                         f"--plans_dir={plans}")
    self.assertNotEqual(missing.returncode, 0)
    self.assertIn("no plan at", missing.stderr)
