"""experiments/gpu_profile_call.sh, the one-call profile of a target, run on the CPU: it
brings back the profile's files and the named training HLOs, and refuses a call without a
target."""
import gzip
import json
import os
import subprocess
import tempfile

from absl.testing import absltest

from cli_helpers import REPO, cpu_env


class GpuProfileCallTest(absltest.TestCase):

  def test_brings_back_the_profile_and_the_named_hlos(self):
    # A Mods set other than the default reaches the Mods arm, and the plan goes to that
    # set's folder, where the LoKA arm of the same set looks for it; OWN_STATES reaches the
    # profile.
    with tempfile.TemporaryDirectory() as tmp:
      plan = os.path.join(tmp, "some_plan.json")
      with open(plan, "w") as f:
        f.write('{"schema": "loka.plan/1"}')
      env = dict(cpu_env(), MODEL="dlrm", PRESET="tiny", VARIANTS="bf16_mods",
                 MODS="blocknorm,no_bias", PLAN=plan, REPORT=plan,
                 HLO="bf16_mods", WORK=tmp, OUT=os.path.join(tmp, "out"), OWN_STATES="1")
      done = subprocess.run(["bash", "experiments/gpu_profile_call.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
      self.assertEqual(done.returncode, 0, done.stderr[-2000:])
      self.assertIn("profile rc=0", done.stdout)
      out = os.path.join(tmp, "out")
      with open(os.path.join(out, "profile_dlrm.json")) as f:
        saved = json.load(f)
      self.assertEqual(set(saved["profiles"]),
                       {"bf16 train", "bf16 infer", "bf16_mods train", "bf16_mods infer"})
      self.assertEqual(saved["target"], "dlrm/tiny (Mods no_bias+blocknorm)")
      self.assertTrue(saved["own_states"])   # OWN_STATES=1 reached the profile
      self.assertEqual(saved["variant_mods"],
                       {"bf16": [], "bf16_mods": ["no_bias", "blocknorm"]})
      self.assertTrue(os.path.exists(
          os.path.join(tmp, "plans", "mods_no_bias+blocknorm", "dlrm_tiny", "plan.json")))
      self.assertTrue(os.path.exists(os.path.join(out, "profile_dlrm.md")))
      with gzip.open(os.path.join(out, "hlo_dlrm_bf16_mods_train.txt.gz"), "rt") as f:
        self.assertIn("HloModule", f.read())
      self.assertFalse(os.path.exists(os.path.join(out, "hlo_dlrm_bf16_train.txt.gz")))

  def test_a_call_without_a_target_is_refused(self):
    env = {k: v for k, v in cpu_env().items() if k not in ("MODEL", "PRESET")}
    done = subprocess.run(["bash", "experiments/gpu_profile_call.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    self.assertNotEqual(done.returncode, 0)
    self.assertIn("MODEL", done.stderr)


if __name__ == "__main__":
  absltest.main()
