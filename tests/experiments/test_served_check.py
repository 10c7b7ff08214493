"""The served model's quality behind a LoKA row's inference verdicts (`bench.served_check`):
which score applies to a row, how an outside-the-budget score voids the inference verdicts
and nothing else, and the report's `--served_quality` flag end to end."""
import json
import os

import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from bench_rows import speed, tempdir
from experiments.bench import served_check, tables, targets

BUDGET = 2e-4


def _rows(rng, model="dhen", preset="large", loka_fields=None):
  """bf16, bf16+Mods, its served form and a peer, and a LoKA row faster than all of them."""
  rows = [{"suite": "models", "model": model, "preset": preset, "variant": v,
           "device": "NVIDIA H200", "batch_size": 4096, "train": speed(t, rng),
           "infer": speed(i, rng)}
          for v, t, i in (("bf16", 1.0, 1.0), ("bf16_mods", 1.0, 1.0),
                          ("bf16_mods_served", 1.0, 1.1), ("flax_fp8_delayed", 0.9, 1.05),
                          ("loka", 1.3, 1.6))]
  rows[-1].update(loka_fields or {"serve_plan": "/w/plans/plan_serve.json",
                                  "export_modes": {"fp8": 62, "high": 0}})
  return rows


def _measured(change, modes):
  return {"logloss": 0.5, "export_modes": modes, "budget": BUDGET,
          "vs_served_bf16_mods": {"rel_logloss_change": change, "se": 1e-5},
          "vs_bf16_mods": {"rel_logloss_change": change, "se": 1e-5},
          "within_budget": abs(change) <= BUDGET}


def _report(directory, name, target="dhen/large", serving=(8.4e-4, {"fp8": 62}),
            training=(-1e-5, {"fp8": 13, "high": 49}), mods_set=None):
  path = os.path.join(directory, name)
  served = {"bf16_mods_served": _measured(0.0, {"high": 62}),
            "loka": _measured(*training)}
  if serving is not None:
    served["loka_serving_plan"] = _measured(*serving)
  with open(path, "w") as f:
    json.dump({"target": target, "mods_set": mods_set, "plans": {}, "served": served}, f)
  return path


def _by(verdicts, target, mode):
  found = [v for v in verdicts if v["target"] == target and v["mode"] == mode]
  assert len(found) == 1, (target, mode, found)
  return found[0]


class ForRowTest(absltest.TestCase):

  def test_the_served_export_is_the_serving_plan_with_serve_plan_else_the_training_plan(self):
    d = tempdir(self)
    reports = served_check.load_reports([_report(d, "r.json")])
    row = _rows(np.random.default_rng(0))[-1]
    score = served_check.for_row(row, reports)
    self.assertAlmostEqual(score["rel_logloss_change"], 8.4e-4)
    self.assertFalse(score["within_budget"])
    self.assertEqual(score["source"], os.path.join(d, "r.json"))
    trained_only = {**row, "export_modes": {"fp8": 13, "high": 49}}
    del trained_only["serve_plan"]
    score = served_check.for_row(trained_only, reports)
    self.assertAlmostEqual(score["rel_logloss_change"], -1e-5)
    self.assertTrue(score["within_budget"])

  def test_a_report_of_another_export_is_not_applied(self):
    d = tempdir(self)
    row = _rows(np.random.default_rng(0))[-1]
    # The report scored a serving plan with 48 FP8 forwards; the row served 62.
    reports = served_check.load_reports([_report(d, "r.json", serving=(8.4e-4, {"fp8": 48,
                                                                                "high": 14}))])
    self.assertIn("export modes {'fp8': 48, 'high': 14}",
                  served_check.for_row(row, reports)["mismatch"])
    reports = served_check.load_reports([_report(d, "none.json", serving=None)])
    self.assertIn("no score of loka_serving_plan",
                  served_check.for_row(row, reports)["mismatch"])

  def test_reports_are_keyed_by_target_and_mods_set_the_later_file_winning(self):
    d = tempdir(self)
    old = _report(d, "old.json")
    new = _report(d, "new.json", serving=(1e-5, {"fp8": 62}))
    other_set = _report(d, "set.json", mods_set="no_bias+blocknorm")
    other_model = _report(d, "dcnv2.json", target="dcnv2/large")
    reports = served_check.load_reports([old, new, other_set, other_model])
    self.assertCountEqual(reports, [("dcnv2", "large", None), ("dhen", "large", None),
                                    ("dhen", "large", "no_bias+blocknorm")])
    row = _rows(np.random.default_rng(0))[-1]
    self.assertEqual(served_check.for_row(row, reports)["source"], new)
    self.assertEqual(served_check.for_row({**row, "mods_set": "no_bias+blocknorm"},
                                          reports)["source"], other_set)
    self.assertIsNone(served_check.for_row({**row, "preset": "small"}, reports))

  def test_the_rows_own_gate_score_comes_first(self):
    d = tempdir(self)
    reports = served_check.load_reports([_report(d, "r.json")])
    own = {"rel_logloss_change": 1e-5, "se": 1e-5, "within_budget": True, "budget": BUDGET}
    row = {**_rows(np.random.default_rng(0))[-1], "serve_promotion": {"quality": own}}
    self.assertEqual(served_check.for_row(row, reports),
                     {**own, "source": "the bench's served-quality gate"})

  def test_unreadable_reports_are_errors_naming_the_file(self):
    d = tempdir(self)
    with self.assertRaisesRegex(served_check.ServedQualityError, "nope.json does not exist"):
      served_check.load_reports([os.path.join(d, "nope.json")])
    torn = os.path.join(d, "torn.json")
    with open(torn, "w") as f:
      f.write('{"target": "dhen/large", "served": {')
    with self.assertRaisesRegex(served_check.ServedQualityError, "torn.json"):
      served_check.load_reports([torn])
    # The bench's own gate file has no export modes per candidate: not this report.
    wrong = os.path.join(d, "serve_quality.json")
    with open(wrong, "w") as f:
      json.dump({"target": "dhen/large", "served": {"selected": {"within_budget": True}}}, f)
    with self.assertRaisesRegex(served_check.ServedQualityError,
                                "serve_quality.json: not a served-quality report"):
      served_check.load_reports([wrong])
    no_target = _report(d, "no_target.json", target="dhen")
    with self.assertRaisesRegex(served_check.ServedQualityError, "expected model/preset"):
      served_check.load_reports([no_target])


class VerdictsTest(absltest.TestCase):

  def test_outside_the_budget_every_inference_verdict_is_missed_and_training_stands(self):
    d = tempdir(self)
    rows = _rows(np.random.default_rng(1))
    plain = targets.check_all(rows)
    voided = targets.check_all(rows, served_check.load_reports([_report(d, "r.json")]))
    self.assertEqual([v for v in plain if v["mode"] == "infer" and v["met"] is not True], [])
    self.assertEqual(len(voided), len(plain) + 1)
    for before, after in zip(plain, voided):
      self.assertEqual((before["target"], before["value"]), (after["target"], after["value"]))
      if before["mode"] == "infer":
        self.assertIs(after["met"], False, after["target"])
        self.assertIn("outside the 0.02% budget", after["note"])
      else:
        self.assertEqual(after, before)
    served = _by(voided, "loka_served_quality", "served")
    self.assertIs(served["met"], False)
    self.assertAlmostEqual(served["value"], 8.4e-4)
    self.assertEqual(served["ci"], [-BUDGET, BUDGET])
    glance = tables.glance_table(voided)
    self.assertIn("+0.084% MISSED", glance)
    self.assertIn("loka_not_slower_than_bf16_mods_served (infer)", glance)

  def test_within_the_budget_nothing_changes_but_the_served_verdict(self):
    d = tempdir(self)
    rows = _rows(np.random.default_rng(2))
    plain = targets.check_all(rows)
    within = targets.check_all(rows, served_check.load_reports(
        [_report(d, "r.json", serving=(1.2e-4, {"fp8": 62}))]))
    self.assertEqual(within[:-1], plain)
    self.assertIs(within[-1]["met"], True)
    self.assertEqual(within[-1]["target"], "loka_served_quality")

  def test_a_mismatched_report_is_said_and_decides_nothing(self):
    d = tempdir(self)
    rows = _rows(np.random.default_rng(3))
    plain = targets.check_all(rows)
    got = targets.check_all(rows, served_check.load_reports(
        [_report(d, "r.json", serving=(8.4e-4, {"fp8": 48, "high": 14}))]))
    self.assertEqual(got[:-1], plain)
    self.assertIsNone(got[-1]["met"])
    self.assertIsNone(got[-1]["value"])
    self.assertIn("not applied", got[-1]["note"])

  def test_a_wukong_large_reported_ratio_stays_reported(self):
    d = tempdir(self)
    rows = _rows(np.random.default_rng(4), model="wukong")
    got = targets.check_all(rows, served_check.load_reports(
        [_report(d, "r.json", target="wukong/large")]))
    reported = _by(got, "wukong_large_over_bf16", "infer")
    self.assertIsNone(reported["met"])
    self.assertIn("not counted", reported["note"])
    self.assertIs(_by(got, "wukong_large_over_bf16_mods", "infer")["met"], False)
    self.assertIs(_by(got, "wukong_large_over_bf16_mods", "train")["met"], True)


class CliTest(absltest.TestCase):

  def test_the_report_takes_served_quality_reports(self):
    d = tempdir(self)
    rows = os.path.join(d, "rows.jsonl")
    with open(rows, "w") as f:
      for r in _rows(np.random.default_rng(5)):
        f.write(json.dumps(r) + "\n")

    def run(*args):
      return run_module("experiments.report", "rows", f"--rows={rows}",
                        f"--out={os.path.join(d, 'out')}", *args, timeout=120)

    done = run(f"--served_quality={_report(d, 'r.json')}")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    with open(os.path.join(d, "out", "targets.json")) as f:
      verdicts = json.load(f)
    self.assertIs(_by(verdicts, "loka_served_quality", "served")["met"], False)
    self.assertIs(_by(verdicts, "loka_not_slower_than_bf16_mods", "infer")["met"], False)
    broken = run(f"--served_quality={os.path.join(d, 'nope.json')}")
    self.assertNotEqual(broken.returncode, 0)
    self.assertIn("nope.json does not exist", broken.stderr + broken.stdout)


if __name__ == "__main__":
  absltest.main()
