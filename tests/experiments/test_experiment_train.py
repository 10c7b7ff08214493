"""`python -m experiments.train` end to end: a real tiny preset on synthetic data."""
import json
import os
import tempfile

import chex
import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from loka_jax.train import experiment



def run_cli(*args, timeout=300):
  return run_module("experiments.train", *args, timeout=timeout)


class TrainCliTest(chex.TestCase):

  def test_wukong_tiny_trains_and_writes_its_files(self):
    workdir = tempfile.mkdtemp(prefix="loka_cli_")
    result = run_cli("--config.run.model=wukong", "--config.run.preset=tiny",
                     "--config.run.data=synthetic", "--config.run.precision=bf16",
                     "--config.run.steps=100", "--config.run.seed=1", f"--workdir={workdir}",
                     "--config.run.batch_size=256", "--config.train.eval_every=50",
                     "--config.train.log_every=25", "--config.train.checkpoint_every=50",
                     "--config.run.num_eval=2048")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    with open(os.path.join(workdir, "final.json")) as f:
      final = json.load(f)
    self.assertEqual(json.loads(result.stdout), final)
    self.assertEqual((final["steps"], final["precision"], final["seed"], final["model"]),
                     (100, "bf16", 1, "wukong"))
    self.assertEqual(final["num_eval_examples"], 2048)
    # Learns: clearly better than predicting the base rate (NE 1), not better than the teacher.
    self.assertLess(final["ne"], 0.95)
    self.assertGreater(final["ne"], final["oracle_ne"] - 0.05)
    self.assertGreater(final["auc"], 0.6)
    self.assertTrue(np.isfinite(final["logloss"]))
    self.assertNotIn("error", final)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in lines], [25, 50, 75, 100])
    self.assertEqual([r["step"] for r in lines if "ne" in r], [50, 100])
    self.assertEqual(lines[-1]["ne"], final["ne"])
    self.assertTrue(all(np.isfinite(r["loss"]) for r in lines))
    # Both checkpoints, and the record that training from step 50 reached 100 finitely.
    self.assertEqual(sorted(os.listdir(os.path.join(workdir, "checkpoints"))),
                     ["100", "50", "earned.json"])
    with open(os.path.join(workdir, "checkpoints", "earned.json")) as f:
      self.assertEqual(json.load(f), {"step": 50})
    with open(os.path.join(workdir, "config.json")) as f:
      self.assertEqual(json.load(f)["run"]["precision"], "bf16")

  def test_triton_gemm_off_sets_its_xla_flag_and_trains(self):
    # XLA parses XLA_FLAGS when the backend starts and aborts on a flag it does not know, so
    # a run that trains took the flag.
    workdir = tempfile.mkdtemp(prefix="loka_cli_")
    result = run_cli("--config.run.model=dlrm", "--config.run.preset=tiny",
                     "--config.run.steps=4", "--config.run.batch_size=64",
                     "--config.run.num_eval=128", "--config.train.log_every=2",
                     "--config.train.triton_gemm=false", f"--workdir={workdir}")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertEqual(json.loads(result.stdout)["steps"], 4)

  def test_a_cooldown_reaches_the_optimizer_and_a_long_one_is_one_line(self):
    workdir = tempfile.mkdtemp(prefix="loka_cli_")
    common = ("--config.run.model=dlrm", "--config.run.preset=tiny", "--config.run.steps=4",
              "--config.run.batch_size=64", "--config.run.num_eval=128")
    result = run_cli(*common, "--config.optim.cooldown_steps=2", f"--workdir={workdir}")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    optim = json.load(open(os.path.join(workdir, "config.json")))["train"]["optim"]
    self.assertEqual((optim["cooldown_start"], optim["cooldown_steps"]), (2, 2))
    long = run_cli(*common, "--config.optim.warmup_steps=1", "--config.optim.cooldown_steps=4",
                   "--workdir=" + tempfile.mkdtemp())
    self.assertEqual(long.returncode, 1)
    self.assertEqual(long.stderr.strip(), "error: --config.optim.cooldown_steps=4: must be in "
                     "[0, run.steps - optim.warmup_steps = 3]")

  def test_a_large_preset_without_warmup_gets_a_note(self):
    # The note comes before anything is built; a flag combination refused right after it
    # keeps the test from building a `large` model.
    refused = ("--config.run.model=dlrm", "--config.run.preset=large",
               "--config.parallel.mesh=data:1", "--config.drift.every=5",
               "--workdir=" + tempfile.mkdtemp())
    plain = run_cli(*refused)
    self.assertIn("--config.drift.every does not run in a sharded run yet", plain.stderr)
    self.assertIn("note: the `large` presets spike in their first steps without a "
                  "learning-rate warm-up", plain.stderr)
    self.assertIn("optim.warmup_steps=50", plain.stderr)
    warm = run_cli(*refused, "--config.optim.warmup_steps=50")
    self.assertIn("--config.drift.every does not run in a sharded run yet", warm.stderr)
    self.assertNotIn("note:", warm.stderr)

  def test_recipe_notes(self):
    from loka_jax.train import OptimConfig
    (note,) = experiment.recipe_notes("large", OptimConfig())
    self.assertIn("optim.warmup_steps=50", note)
    self.assertEqual(experiment.recipe_notes("large", OptimConfig(warmup_steps=10)), ())
    self.assertEqual(experiment.recipe_notes("small", OptimConfig()), ())
    self.assertEqual(experiment.recipe_notes("tiny", OptimConfig()), ())

  def test_loka_without_plan_is_a_clear_error(self):
    result = run_cli("--config.run.model=wukong", "--config.run.precision=loka",
                     "--workdir=" + tempfile.mkdtemp())
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("precision 'loka' needs a plan: set run.plan", result.stderr)
    self.assertNotIn("Traceback", result.stderr)

  def test_missing_workdir_is_a_usage_error(self):
    result = run_cli("--config.run.model=wukong")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("--workdir is required", result.stderr)


class PlanLoaderTest(chex.TestCase):

  def test_a_missing_plan_file_is_one_line_naming_it(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_"), "plan.json")
    with self.assertRaises(experiment.PlanError) as caught:
      experiment.load_plan(path)
    message = str(caught.exception)
    self.assertIn(path, message)
    self.assertNotIn("\n", message)

  def test_no_plan_says_which_setting_is_missing(self):
    with self.assertRaisesRegex(experiment.PlanError, "set run.plan"):
      experiment.load_plan(None)

if __name__ == "__main__":
  absltest.main()
