"""A plan's validation read back (`dispatch.run_records`, `experiments.report validation`):
status, training runs paired with bf16+Mods by seed and recipe, curves, the CLI's output
and plots, and a clear error on a bad plan file."""
import os
import tempfile

import chex
import numpy as np
from absl.testing import absltest

import report_builders as hm
from cli_helpers import run_module
from loka_jax.dispatch import run_records
from loka_jax.plan.file import SCHEMA, Plan, add_validation, save_plan

SITE = "top_mlp/dense_0"
RUN = "quality_from_init_run"
RECIPE = {"steps": 100, "start": "init", "window": 20, "warmup_steps": 10}


def bare_plan():
  return Plan({"schema": SCHEMA, "model": "dlrm", "preset": "tiny", "rules": [],
               "default": {p: "xla_bf16" for p in hm.PASSES},
               "sites": {SITE: {p: "xla_fp8_rowwise" for p in hm.PASSES}}})


def run(arm, seed, logloss, recipe=RECIPE, finite=True, **extra):
  """A run record as `validate.run_summary` writes it, from fresh random losses."""
  rng = np.random.default_rng(seed + 100 * len(arm))
  record = {"step": RUN, "arm": arm, "seed": seed, **recipe, "finite": finite,
            "seconds": 1.5, **extra}
  if arm == "plan":
    record["sites"] = {SITE: {p: "xla_fp8_rowwise" for p in hm.PASSES}}
  if finite:
    record.update(window_loss=float(rng.uniform(0.4, 0.6)), logloss=logloss,
                  peak_loss=float(rng.uniform(0.7, 2.0)), auc=float(rng.uniform(0.6, 0.8)),
                  calibration=float(rng.uniform(0.9, 1.1)),
                  loss_curve=[float(x) for x in rng.uniform(0.4, 0.7, 4)])
  return record


def with_records(records, plan=None):
  plan = plan or bare_plan()
  for r in records:
    plan = add_validation(plan, r)
  return plan


class StatusTest(chex.TestCase):

  def test_each_stage_reads_as_itself(self):
    self.assertIn("no validation record", run_records.status(bare_plan()))
    partial = with_records([{"step": "speed_promotion", "skipped": True,
                          "reason": "not on a GPU", "final": True},
                            {"step": "quality_held_out", "round": 0, "passed": True,
                             "final": True}])
    line = run_records.status(partial)
    self.assertIn("in progress", line)
    self.assertIn("finished speed_promotion, quality_held_out", line)
    self.assertIn("next quality_shadow", line)
    done = with_records([{"step": "validated", "fp8_sites_before": 5, "fp8_sites_after": 3,
                          "backed_off": ["a", "b"], "promoted": []}], partial)
    self.assertEqual(run_records.status(done),
                     "validated: FP8 sites 5 -> 3 (backed off 2)")
    refused = with_records([{"step": "not_validated", "reason": "no GPU"}])
    self.assertEqual(run_records.status(refused), "not validated: no GPU")


class RunsTest(chex.TestCase):

  def test_plan_runs_pair_with_the_baseline_at_their_seed_and_recipe(self):
    other = {**RECIPE, "warmup_steps": 0}
    runs = [run("bf16_mods", 0, 0.50), run("bf16_mods", 1, 0.52), run("plan", 0, 0.49),
            run("plan", 1, 0.53), run("plan", 0, 0.40, recipe=other),
            run("plan", 2, 0.51), run("plan", 1, None, finite=False)]
    plan = with_records(runs)
    (records,) = run_records.training_runs(plan).values()
    self.assertLen(records, len(runs))
    changes = [run_records.paired_change(r, records) for r in records]
    self.assertIsNone(changes[0])                       # a baseline has no change
    self.assertAlmostEqual(changes[2], 0.49 / 0.50 - 1)
    self.assertAlmostEqual(changes[3], 0.53 / 0.52 - 1)
    self.assertIsNone(changes[4])                       # no baseline with that warm-up
    self.assertIsNone(changes[5])                       # no baseline at seed 2
    self.assertIsNone(changes[6])                       # non-finite
    blocks = run_records.runs_tables("quality_from_init", records)
    self.assertLen(blocks, 2)                           # one per recipe
    self.assertIn("warm-up 10", blocks[0])
    self.assertNotIn("warm-up", blocks[1].splitlines()[0])
    self.assertIn(f"{100 * (0.49 / 0.50 - 1):+.3f}%", blocks[0])
    self.assertIn("| plan (1 FP8 sites) | 1 | non-finite |", blocks[0])
    # Baseline rows first.
    rows = [l for l in blocks[0].splitlines() if l.startswith("| bf16_mods") or
            l.startswith("| plan")]
    self.assertEqual([l.split(" | ")[0] for l in rows][:2], ["| bf16_mods"] * 2)
    curves = run_records.curves(records)
    self.assertEqual(curves[("plan (1 FP8 sites)", 1)], records[3]["loss_curve"])
    self.assertLen(curves, 5)                           # the non-finite run has none

  def test_each_round_of_the_plan_is_named_apart(self):
    # Round 1 steps the site to another FP8 op: as many FP8 sites, another plan.
    stepped = {SITE: {p: "flax_fp8_delayed_grad_lhs" for p in hm.PASSES}}
    runs = [run("bf16_mods", 0, 0.50), run("plan", 0, 0.55), dict(run("plan", 0, 0.49),
                                                                  sites=stepped)]
    (records,) = run_records.training_runs(with_records(runs)).values()
    labels = run_records.arm_labels(records)
    self.assertEqual(labels, ["bf16_mods", "plan 1 (1 FP8 sites)", "plan 2 (1 FP8 sites)"])
    self.assertLen(run_records.curves(records), 3)
    (table,) = run_records.runs_tables("quality_from_init", records)
    self.assertIn(f"| plan 2 (1 FP8 sites) | 0 | {records[2]['window_loss']:.5f} | 0.49000 | "
                  f"{100 * (0.49 / 0.50 - 1):+.3f}% |", table)

  def test_the_curves_table_shows_a_non_finite_block_as_a_gap(self):
    table = run_records.curves_table({("plan", 3): [0.5, None, 0.41234]}, "window")
    self.assertEqual(table.splitlines(), ["| arm | window | loss curve |", "|---|---|---|",
                                          "| plan | 3 | 0.500 - 0.412 |"])

  def test_a_noise_floor_run_is_its_own_arm(self):
    shadow = {"steps": 40, "start": "checkpoint", "window": 10, "warmup_steps": 0}
    runs = [dict(run("bf16_mods", 0, 0.5, recipe=shadow), step="quality_shadow_run"),
            dict(run("bf16_mods_jittered", 0, 0.51, recipe=shadow, jitter=0.001),
                 step="quality_shadow_run")]
    records = run_records.training_runs(with_records(runs))["quality_shadow"]
    self.assertEqual(run_records.arm_labels(records),
                     ["bf16_mods", "bf16_mods_jittered (jitter 0.001)"])
    (table,) = run_records.runs_tables("quality_shadow", records)   # its baseline's recipe
    self.assertIn(f"| {100 * (0.51 / 0.50 - 1):+.3f}% |", table)


class CliTest(chex.TestCase):

  def test_a_missing_or_corrupt_plan_is_a_usage_error_naming_it(self):
    from absl import app
    from experiments.run_config import read_plan_arg
    path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_arg_"), "plan.json")
    with self.assertRaisesRegex(app.UsageError, f"--plan={path}: no such file"):
      read_plan_arg(path)
    with open(path, "w") as f:
      f.write("[]")
    with self.assertRaisesRegex(app.UsageError, path):
      read_plan_arg(path, "--plans")

  def test_prints_the_tables_and_plots_the_curves(self):
    workdir = tempfile.mkdtemp(prefix="loka_validation_report_")
    plan = with_records([{"step": "speed_promotion", "skipped": True,
                          "reason": "not on a GPU", "final": True},
                         run("bf16_mods", 0, 0.50), run("plan", 0, 0.49)])
    path = os.path.join(workdir, "plan_validating.json")
    save_plan(plan, path)
    out = os.path.join(workdir, "plots")
    result = run_module("experiments.report", "validation", f"--plan={path}", f"--out={out}",
                        timeout=120)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("validation in progress", result.stdout)
    self.assertIn(f"{100 * (0.49 / 0.50 - 1):+.3f}%", result.stdout)
    self.assertIn("quality_from_init run, plan seed 0", result.stdout)
    png = os.path.join(out, "validation_quality_from_init.png")
    with open(png, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    with open(path, "w") as f:
      f.write('{"schema": ')
    corrupt = run_module("experiments.report", "validation", f"--plan={path}", timeout=120)
    self.assertNotEqual(corrupt.returncode, 0)
    self.assertIn(path, corrupt.stderr)
    self.assertNotIn("Traceback", corrupt.stderr)


if __name__ == "__main__":
  absltest.main()
