"""The main job's recorded settings: a rerun with other settings moves aside exactly the
stages they change and says so; a probe report of another run is refused by the pipeline."""
import json
import os
import tempfile

from absl.testing import absltest

from experiments import job_settings
from loka_jax.dispatch import pipeline
from loka_jax.train import experiment

SETTINGS = {"run": {"model": "wukong", "steps": 300, "seed": 0},
            "probe": {"steps": 100, "compile_workers": -1},
            "select": {"min_speedup": None}, "validate": {"shadow_steps": 200},
            "arms": {"naive_fp8": True}, "compilation_cache": "/cache"}


def changed(path, value):
  out = json.loads(json.dumps(SETTINGS))
  group, field = path.split(".") if "." in path else (None, path)
  (out[group] if group else out)[field] = value
  return out


def finished_workdir():
  """A workdir holding every stage's files, made with SETTINGS."""
  workdir = tempfile.mkdtemp(prefix="loka_job_")
  job_settings.record(workdir, SETTINGS)
  for stage in job_settings.STAGES:
    for name in job_settings.OUTPUTS[stage]:
      with open(os.path.join(workdir, name), "w") as f:
        f.write(stage)
  return workdir


def present(workdir):
  return {n for s in job_settings.STAGES for n in job_settings.OUTPUTS[s]
          if os.path.exists(os.path.join(workdir, n))}


class SettleTest(absltest.TestCase):

  def test_same_settings_keep_everything(self):
    workdir = finished_workdir()
    self.assertIsNone(job_settings.settle(workdir, SETTINGS))
    self.assertLen(present(workdir), sum(len(v) for v in job_settings.OUTPUTS.values()))
    # Settings that change nothing computed do not count as a change either.
    self.assertIsNone(job_settings.settle(workdir, changed("compilation_cache", "")))

  def test_more_steps_redo_the_arms_only(self):
    workdir = finished_workdir()
    said = job_settings.settle(workdir, changed("run.steps", 60))
    self.assertIn("run.steps: 300 -> 60", said)
    self.assertIn("redoing arms;", said)
    self.assertEqual(present(workdir), set(job_settings.OUTPUTS["probe"]
                                           + job_settings.OUTPUTS["select"]
                                           + job_settings.OUTPUTS["validate"]))
    moved = said.rsplit(" ", 1)[-1]
    self.assertEqual(sorted(os.listdir(moved)), sorted(job_settings.OUTPUTS["arms"]))
    with open(os.path.join(workdir, job_settings.SETTINGS_JSON)) as f:
      self.assertEqual(json.load(f)["run"]["steps"], 60)
    self.assertIsNone(job_settings.settle(workdir, changed("run.steps", 60)))

  def test_another_model_redoes_everything_and_a_budget_the_plan_on(self):
    workdir = finished_workdir()
    said = job_settings.settle(workdir, changed("run.model", "dlrm"))
    self.assertIn("run.model: 'wukong' -> 'dlrm'", said)
    self.assertIn("redoing probe, select, validate, arms", said)
    self.assertEqual(present(workdir), set())
    workdir = finished_workdir()
    said = job_settings.settle(workdir, changed("select.min_speedup", 0.0))
    self.assertIn("redoing select, validate, arms", said)
    self.assertEqual(present(workdir), set(job_settings.OUTPUTS["probe"]))

  def test_an_unrecorded_workdir_is_left_alone_and_an_unreadable_record_is_one_line(self):
    workdir = finished_workdir()
    os.remove(os.path.join(workdir, job_settings.SETTINGS_JSON))
    self.assertIsNone(job_settings.settle(workdir, changed("run.model", "dlrm")))
    self.assertFalse(os.path.exists(os.path.join(workdir, job_settings.SETTINGS_JSON)))
    with open(os.path.join(workdir, job_settings.SETTINGS_JSON), "w") as f:
      f.write('{"run": ')
    with self.assertRaisesRegex(ValueError, r"job_settings.json: unreadable .*delete it"):
      job_settings.settle(workdir, SETTINGS)


class ProbeReportOfAnotherRunTest(absltest.TestCase):

  def test_the_pipeline_refuses_a_report_of_another_model(self):
    spec = experiment.RunSpec(model="dlrm", preset="tiny", mods=("all",))
    report = {"run": {**spec.run_info(), "model": "wukong"}}
    with self.assertRaisesRegex(pipeline.RunMismatchError,
                                r"^x.json probed another run \(model: 'wukong' there, 'dlrm' "
                                r"here\)"):
      pipeline._check_same_run(report, spec, "x.json")
    pipeline._check_same_run({"run": spec.run_info()}, spec, "x.json")


if __name__ == "__main__":
  absltest.main()
