"""The main job (`python -m experiments.loka`) end to end at a test size: probe -> dispatch ->
validate -> three arms -> report.md, plan.json, probe_report.json and PNGs; a rerun resumes."""
import json
import os
import tempfile

import chex
from absl.testing import absltest

from cli_helpers import PNG_MAGIC, run_module
from loka_jax import dispatch

FLAGS = ("--config.probe.steps=10", "--config.probe.samples=2",
         "--config.probe.sites=layer_0/fmb/mlp/dense_[01]", "--config.run.steps=8",
         "--config.validate.shadow_steps=6", "--config.validate.from_init_steps=6",
         "--config.run.num_eval=256", "--config.run.batch_size=64", "--config.probe.cadence=5")
# The runs use the suite's compilation cache ($JAX_COMPILATION_CACHE_DIR, tests/conftest.py):
# the rerun and the other budget load what the first run compiled.


def run_main(workdir):
  return run_module("experiments.loka", f"--workdir={workdir}", *FLAGS, timeout=400)


class MainJobTest(chex.TestCase):

  def test_probe_dispatch_validate_train_report(self):
    workdir = os.path.join(tempfile.mkdtemp(prefix="loka_main_"), "run")
    done = run_main(workdir)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    for name in ("probe_report.json", "plan_selected.json", "plan.json", "report.md"):
      self.assertTrue(os.path.exists(os.path.join(workdir, name)), name)
    for name in ("plan.png", "arms.png"):
      with open(os.path.join(workdir, name), "rb") as f:
        self.assertEqual(f.read(8), PNG_MAGIC)
    with open(os.path.join(workdir, "plan.json")) as f:
      plan = json.load(f)
    self.assertEqual(plan["schema"], "loka.plan/1")
    self.assertCountEqual(plan["sites"], ["layer_0/fmb/mlp/dense_0", "layer_0/fmb/mlp/dense_1"])
    steps = [r["step"] for r in plan["validation"]]
    for step in ("quality_held_out", "quality_shadow", "quality_from_init", "speed",
                 "validated"):
      self.assertIn(step, steps)
    speed = [r for r in plan["validation"] if r["step"] == "speed"]
    self.assertTrue(speed[0]["skipped"])                        # a CPU: recorded, not timed
    with open(os.path.join(workdir, "report.md")) as f:
      text = f.read()
    self.assertIn("| site | fwd | dgrad | wgrad |", text)
    self.assertIn("| layer_0/fmb/mlp/dense_0 |", text)
    # The H200 table makes every FP8 candidate slower at these two sites' tiny shapes: an
    # all-bf16 plan has nothing to validate, and says so.
    self.assertIn("- held-out: skipped (no FP8 site in the plan", text)
    for arm in ("| bf16+Mods |", "| LoKA (Mods + plan) |", "| fp8_all xla_fp8_tensorwise + Mods |"):
      self.assertIn(arm, text)
    self.assertIn("Speed: not measured (not on a GPU", text)
    self.assertRegex(text, r"of the speed-only plan \(every site's fastest kernel, accuracy "
                           r"ignored; `experiments.report plan_headroom`\): \d+\.\d\dx")
    loka_dir = "loka_" + dispatch.read_plan(os.path.join(workdir, "plan.json")).kernel_digest()[:8]
    for arm in ("bf16_mods", loka_dir, "fp8_all"):
      with open(os.path.join(workdir, "arms", arm, "final.json")) as f:
        final = json.load(f)
      self.assertEqual(final["steps"], 8)
    again = run_main(workdir)                                    # every part resumes
    self.assertEqual(again.returncode, 0, again.stderr[-3000:])
    self.assertIn("probe report found", again.stdout)
    self.assertIn("validated plan found", again.stdout)
    # Another budget selects and validates again, and trains its own LoKA arm.
    other = run_module("experiments.loka", f"--workdir={workdir}", *FLAGS,
                       "--config.select.min_speedup=0", timeout=400)
    self.assertEqual(other.returncode, 0, other.stderr[-3000:])
    self.assertNotIn("validated plan found", other.stdout)
    with open(os.path.join(workdir, "report.md")) as f:
      text = f.read()
    self.assertIn("held-out (round 0)", text)                    # FP8 sites: measured,
    self.assertIn("(one standard error)", text)                  # with the eval set's spread
    self.assertIn("training from initialization 6 steps (round 0)", text)


if __name__ == "__main__":
  absltest.main()
