"""Measuring part of a target again (`bench.forget`, `experiments.forget_rows`): exactly the
rows and plan files named leave the workdir, land byte for byte under forgotten/, and a
resumed bench then sees them as not done."""
import json
import os
import shutil
import tempfile

from absl.testing import absltest

from cli_helpers import run_module
from experiments.bench import forget, planning, quality, suite
from experiments.bench.results import ResultsFile


def _tempdir(test):
  path = tempfile.mkdtemp(prefix="loka_forget_")
  test.addCleanup(shutil.rmtree, path, ignore_errors=True)
  return path


def _speed_row(model, preset, variant, value, mods_set=None):
  row = {"suite": "models", "model": model, "preset": preset, "variant": variant,
         "device": "NVIDIA H200", "train": {"speedup": value}}
  if mods_set:
    row["mods_set"] = mods_set
  return row


def _workdir(test):
  d = _tempdir(test)
  rows = [_speed_row("dhen", "large", v, 1.0 + i / 10)
          for i, v in enumerate(("bf16", "bf16_mods", "loka"))]
  rows += [_speed_row("dcnv2", "large", "loka", 1.3),
           _speed_row("dhen", "large", "loka", 1.4, mods_set="no_bias+blocknorm")]
  with open(os.path.join(d, "bench.jsonl"), "w") as f:
    for r in rows[:2]:
      f.write(json.dumps(r) + "\n")
    f.write('{"suite": "models", "torn\n')          # a line a killed write left
    for r in rows[2:]:
      f.write(json.dumps(r) + "\n")
  folder = planning.plan_dir(os.path.join(d, "plans"), "dhen", "large")
  os.makedirs(folder)
  for name in ("plan.json", "plan_serve.json"):
    with open(os.path.join(folder, name), "w") as f:
      json.dump({"name": name}, f)
  return d, rows


class ForgetTest(absltest.TestCase):

  def test_moves_exactly_the_named_rows_and_files_and_loses_nothing(self):
    d, rows = _workdir(self)
    with open(os.path.join(d, "bench.jsonl")) as f:
      before = f.read()
    done = forget.forget(d, suite="models", model="dhen", preset="large", names=["loka"],
                         plan_files=["plan_serve.json"], stamp="s1")
    self.assertEqual(done["rows"], 1)
    self.assertEqual(done["plan_files"], ["plan_serve.json"])
    results = ResultsFile(os.path.join(d, "bench.jsonl"), suite.KEY_FIELDS)
    key = ("models", "dhen", "large", "loka", "NVIDIA H200", None)
    self.assertFalse(results.done(key))                     # the bench measures it again
    for other in (("models", "dhen", "large", "bf16_mods", "NVIDIA H200", None),
                  ("models", "dcnv2", "large", "loka", "NVIDIA H200", None),
                  ("models", "dhen", "large", "loka", "NVIDIA H200", "no_bias+blocknorm")):
      self.assertTrue(results.done(other), other)
    with open(os.path.join(d, "bench.jsonl")) as f:
      after = f.read()
    self.assertIn('{"suite": "models", "torn\n', after)     # not ours to judge: kept
    with open(os.path.join(d, "forgotten", "s1", "bench.jsonl")) as f:
      moved = f.read()
    self.assertEqual(moved, json.dumps(rows[2]) + "\n")
    self.assertEqual(sorted(after.splitlines() + moved.splitlines()),
                     sorted(before.splitlines()))
    folder = planning.plan_dir(os.path.join(d, "plans"), "dhen", "large")
    self.assertFalse(os.path.exists(os.path.join(folder, "plan_serve.json")))
    self.assertTrue(os.path.exists(os.path.join(folder, "plan.json")))
    with open(os.path.join(d, "forgotten", "s1", "plans", "dhen_large",
                           "plan_serve.json")) as f:
      self.assertEqual(json.load(f), {"name": "plan_serve.json"})
    with open(os.path.join(d, "forgotten", "s1", "forgotten.json")) as f:
      self.assertEqual(json.load(f), [done])

  def test_a_mods_set_has_its_own_rows_and_plan_folder(self):
    d, rows = _workdir(self)
    folder = planning.plan_dir(os.path.join(d, "plans", "mods_no_bias+blocknorm"), "dhen",
                               "large")
    os.makedirs(folder)
    with open(os.path.join(folder, "plan.json"), "w") as f:
      f.write("{}")
    done = forget.forget(d, suite="models", model="dhen", preset="large", names=["loka"],
                         mods=("no_bias", "blocknorm"), plan_files=["plan.json"], stamp="s")
    self.assertEqual(done["rows"], 1)
    with open(os.path.join(d, "forgotten", "s", "bench.jsonl")) as f:
      self.assertEqual(json.loads(f.read())["mods_set"], "no_bias+blocknorm")
    self.assertTrue(os.path.exists(os.path.join(
        d, "forgotten", "s", "plans", "mods_no_bias+blocknorm", "dhen_large", "plan.json")))
    # the default set's plan stays
    self.assertTrue(os.path.exists(os.path.join(
        planning.plan_dir(os.path.join(d, "plans"), "dhen", "large"), "plan.json")))

  def test_quality_rows_are_forgotten_by_arm(self):
    d = _tempdir(self)
    path = os.path.join(d, "quality.jsonl")
    rows = [{"suite": "quality", "data": "synthetic", "model": "dcnv2", "preset": "large",
             "arm": arm, "seed": 0, "device": "NVIDIA H200", "warmup_steps": 50}
            for arm in ("bf16", "loka")]
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    root = os.path.join(d, quality.RUNS_FOLDER)
    for r in rows:
      os.makedirs(quality.run_dir(root, r))
      with open(os.path.join(quality.run_dir(root, r), "config.json"), "w") as f:
        f.write(r["arm"])
    done = forget.forget(d, suite="quality", model="dcnv2", preset="large", names=["loka"],
                         stamp="s")
    results = ResultsFile(path, quality.KEY_FIELDS)
    self.assertEqual([r["arm"] for r in results.rows()], ["bf16"])
    # The forgotten row's run folder went with it, whole; the other arm's stayed.
    loka_dir = os.path.relpath(quality.run_dir(root, rows[1]), d)
    self.assertEqual(done["run_folders"], [loka_dir])
    self.assertFalse(os.path.exists(os.path.join(d, loka_dir)))
    with open(os.path.join(d, "forgotten", "s", loka_dir, "config.json")) as f:
      self.assertEqual(f.read(), "loka")
    self.assertTrue(os.path.isdir(quality.run_dir(root, rows[0])))

  def test_a_quality_row_without_a_run_folder_of_its_own_is_forgotten_alone(self):
    # A LoKA row that is bf16+Mods' twin names no folder of its own: bf16+Mods' stays.
    d = _tempdir(self)
    rows = [{"suite": "quality", "data": "synthetic", "model": "dlrm", "preset": "large",
             "arm": arm, "seed": 0, "device": "NVIDIA H200"} for arm in ("bf16_mods", "loka")]
    with open(os.path.join(d, "quality.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    twin_of = quality.run_dir(os.path.join(d, quality.RUNS_FOLDER), rows[0])
    os.makedirs(twin_of)
    done = forget.forget(d, suite="quality", model="dlrm", preset="large", names=["loka"])
    self.assertEqual((done["rows"], done["run_folders"]), (1, []))
    self.assertTrue(os.path.isdir(twin_of))

  def test_the_probe_report_and_folder_go_so_the_next_call_probes_again(self):
    d, _ = _workdir(self)
    folder = planning.plan_dir(os.path.join(d, "plans"), "dhen", "large")
    os.makedirs(os.path.join(folder, "probe", "timing_cache"))
    os.makedirs(os.path.join(folder, "validation_state"))
    for name in ("probe_report.json", os.path.join("probe", "timing_cache", "card.json"),
                 os.path.join("validation_state", "final.json")):
      with open(os.path.join(folder, name), "w") as f:
        f.write(name)
    named = ["plan.json", "probe_report.json", "probe", "validation_state"]
    done = forget.forget(d, suite="models", model="dhen", preset="large", names=["loka"],
                         plan_files=named, stamp="p")
    self.assertEqual(done["plan_files"], named)
    self.assertEqual(sorted(os.listdir(folder)), ["plan_serve.json"])
    moved = os.path.join(d, "forgotten", "p", "plans", "dhen_large")
    with open(os.path.join(moved, "probe", "timing_cache", "card.json")) as f:
      self.assertEqual(f.read(), os.path.join("probe", "timing_cache", "card.json"))
    self.assertTrue(os.path.isfile(os.path.join(moved, "probe_report.json")))

  def test_wrong_requests_are_refused_and_change_nothing(self):
    d, _ = _workdir(self)
    with open(os.path.join(d, "bench.jsonl")) as f:
      before = f.read()
    with self.assertRaisesRegex(forget.ForgetError, r"unknown variant\(s\) \['lokaa'\]"):
      forget.forget(d, suite="models", model="dhen", preset="large", names=["lokaa"])
    with self.assertRaisesRegex(forget.ForgetError, r"unknown arm\(s\) \['bf16_mods_served'\]"):
      forget.forget(d, suite="quality", model="dhen", preset="large",
                    names=["bf16_mods_served"])
    with self.assertRaisesRegex(forget.ForgetError, r"unknown plan file\(s\) \['probes'\]"):
      forget.forget(d, suite="models", model="dhen", preset="large", names=["loka"],
                    plan_files=["probes"])
    with self.assertRaisesRegex(forget.ForgetError, "nothing to forget: .* of dhen/small"):
      forget.forget(d, suite="models", model="dhen", preset="small", names=["loka"])
    with open(os.path.join(d, "bench.jsonl")) as f:
      self.assertEqual(f.read(), before)
    self.assertFalse(os.path.exists(os.path.join(d, "forgotten")))


class CliTest(absltest.TestCase):

  def test_moves_the_rows_and_says_so(self):
    d, _ = _workdir(self)

    def run(*args):
      return run_module("experiments.forget_rows", f"--workdir={d}",
                        "--config.forget.target=dhen/large", *args, timeout=120)

    done = run("--config.forget.variants=loka", "--config.forget.plan_files=plan_serve.json")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("moved 1 row(s) of loka and plan_serve.json", done.stdout)
    again = run("--config.forget.variants=loka", "--config.forget.plan_files=plan_serve.json")
    self.assertNotEqual(again.returncode, 0)
    self.assertIn("nothing to forget", again.stderr + again.stdout)


if __name__ == "__main__":
  absltest.main()
