"""`experiments.measure held_out_sites` on a tiny Wukong: the baseline kernel moves nothing,
an FP8 kernel moves the held-out loss, bad arguments fail with a clear message."""
import json
import os
import tempfile

from absl.testing import absltest

from cli_helpers import run_module

SITES = ("layer_0/fmb/mlp/dense_0", "head/dense_1")


def run_cli(*args, timeout=300):
  return run_module("experiments.measure", "held_out_sites", *args, timeout=timeout)


class HeldOutSitesTest(absltest.TestCase):

  def test_bf16_moves_nothing_and_fp8_moves_the_loss(self):
    workdir = tempfile.mkdtemp(prefix="loka_held_out_sites_")
    got = run_cli("--model=wukong", "--preset=tiny", "--mods=all", "--steps=10",
                  "--batch_size=64", "--num_eval=512", "--eval_batch_size=256",
                  "--kernels=xla_bf16,xla_fp8_rowwise", f"--sites={'|'.join(SITES)}",
                  "--one_program", "--gradients", f"--workdir={workdir}")
    self.assertEqual(got.returncode, 0, got.stderr[-3000:])
    with open(os.path.join(workdir, "held_out_sites.json")) as f:
      out = json.load(f)
    self.assertEqual(out["num_eval"], 512)
    for kernel in ("xla_bf16", "xla_fp8_rowwise"):
      self.assertEqual(sorted(out["changes"][kernel]), sorted(("all",) + SITES))
    # The baseline's own kernel is the same program: exactly no change, at every site, and
    # no spread over the examples either.
    self.assertEqual(set(out["changes"]["xla_bf16"].values()), {0.0})
    self.assertEqual(set(out["standard_errors"]["xla_bf16"].values()), {0.0})
    self.assertTrue(any(v != 0.0 for v in out["changes"]["xla_fp8_rowwise"].values()))
    self.assertTrue(all(v > 0.0 for v in out["standard_errors"]["xla_fp8_rowwise"].values()))
    self.assertIn("| all | +0.0000% +- 0.0000% |", got.stdout)
    # One program of switched sites scores a per-pass kernel's sites as their own programs
    # do, bit for bit (validation's `held_out_one_program`).
    for kernel in ("xla_bf16", "xla_fp8_rowwise"):
      one = out["one_program"][kernel]
      self.assertEqual(one["changes"], {s: out["changes"][kernel][s] for s in SITES})
      self.assertEqual(one["max_gap_in_standard_errors"], 0.0)
    self.assertIn("largest gap 0.000 standard errors", got.stdout)
    # So does each site's gradient change (the training checks' `gradient_one_program`),
    # none at all for the baseline's own kernel.
    for kernel in ("xla_bf16", "xla_fp8_rowwise"):
      grads = out["gradients"][kernel]
      self.assertEqual(grads["one_program"], grads["per_site"])
      self.assertEqual(grads["max_relative_gap"], 0.0)
    self.assertEqual(set(out["gradients"]["xla_bf16"]["per_site"].values()), {0.0})
    self.assertTrue(all(v > 0.0 for v in out["gradients"]["xla_fp8_rowwise"]["per_site"].values()))

  def test_bad_arguments_fail_with_a_clear_message(self):
    got = run_cli("--kernels=no_such_kernel", f"--workdir={tempfile.mkdtemp()}")
    self.assertNotEqual(got.returncode, 0)
    self.assertIn("--kernels: unknown ['no_such_kernel']", got.stderr)
    workdir = tempfile.mkdtemp()
    got = run_cli("--sites=no/such/site", "--num_eval=256", f"--workdir={workdir}")
    self.assertNotEqual(got.returncode, 0)
    self.assertIn("matches none of the model's sites", got.stderr)
    self.assertFalse(os.path.exists(os.path.join(workdir, "run")))  # refused before training
    got = run_cli("--gradients", f"--workdir={tempfile.mkdtemp()}")
    self.assertNotEqual(got.returncode, 0)
    self.assertIn("--gradients compares the two ways of measuring: add --one_program",
                  got.stderr)


if __name__ == "__main__":
  absltest.main()
