"""`experiments.measure delayed_warmup` on a tiny DCNv2: one probe evaluated with the delayed
op warmed on each sample itself and on others, both recorded; bad arguments fail clearly."""
import json
import os
import tempfile

from absl.testing import absltest

from cli_helpers import run_module


def run_cli(*args, timeout=400):
  return run_module("experiments.measure", "delayed_warmup", *args, timeout=timeout)


class DelayedWarmupCliTest(absltest.TestCase):

  def test_one_probe_evaluated_both_ways(self):
    workdir = tempfile.mkdtemp(prefix="loka_delayed_warmup_")
    got = run_cli("--model=dlrm", "--preset=tiny", "--steps=30", "--batch_size=64",
                  "--samples=4", "--kernels=xla_bf16,flax_fp8_delayed",
                  "--sites=top_mlp/dense_0$", f"--workdir={workdir}")
    self.assertEqual(got.returncode, 0, got.stderr[-3000:])
    with open(os.path.join(workdir, "delayed_warmup.json")) as f:
      out = json.load(f)
    self.assertEqual(out["chunks"], {"itself": [1], "others": [4]})
    # Every site's three passes, each with both readings; the trained statistics are one.
    self.assertEqual(len(out["rows"]), 3)   # the one site asked for
    self.assertTrue(any(r["sqnr_db_lo"][0] != r["sqnr_db_lo"][1] for r in out["rows"]))
    self.assertIn("| site | pass | kernel |", got.stdout)
    reports = [json.load(open(os.path.join(workdir, w, "probe_report.json")))
               for w in ("itself", "others")]
    self.assertEqual(reports[0]["run"]["final"], reports[1]["run"]["final"])

  def test_bad_arguments_fail_with_a_clear_message(self):
    got = run_cli("--kernels=no_such_kernel", f"--workdir={tempfile.mkdtemp()}")
    self.assertNotEqual(got.returncode, 0)
    self.assertIn("--kernels: unknown ['no_such_kernel']", got.stderr)
    got = run_cli("--kernels=xla_bf16,xla_fp8_tensorwise", f"--workdir={tempfile.mkdtemp()}")
    self.assertNotEqual(got.returncode, 0)
    self.assertIn("nothing warms a delayed-scaling state", got.stderr)
    got = run_cli("--kernels=xla_bf16,flax_fp8_delayed")
    self.assertNotEqual(got.returncode, 0)
    self.assertIn("--workdir is required", got.stderr)


if __name__ == "__main__":
  absltest.main()
