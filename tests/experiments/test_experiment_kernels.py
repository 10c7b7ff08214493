"""`python -m experiments.kernels`: the kernel list and the check with its JSON as a user runs
them."""
import json
import os
import tempfile

from absl.testing import absltest

from cli_helpers import run_module
from loka_jax import kernels
from loka_jax.kernels import base as kernels_base


def _run(*args):
  done = run_module("experiments.kernels", *args, timeout=300)
  done.check_returncode()
  return done


class KernelsCliTest(absltest.TestCase):

  def test_list_names_every_registered_kernel(self):
    out = _run("--config.list=true").stdout
    for name in kernels.names():
      self.assertIn(name, out)
    self.assertIn("passes=fwd,grad_lhs,grad_rhs", out)

  def test_check_writes_the_check_schema(self):
    path = os.path.join(tempfile.mkdtemp(), "check.json")
    only = "xla_bf16,xla_fp8_tensorwise,xla_fp8_rowwise,flax_fp8_delayed"
    out = _run("--config.check.m=72", "--config.check.k=136", "--config.check.n=40",
               "--config.check.seed=3", f"--config.check.json={path}",
               f"--config.check.only={only}").stdout
    self.assertIn("SQNR dB", out)
    with open(path) as f:
      report = json.load(f)
    self.assertEqual(report["schema"], "loka.check/1")
    self.assertEqual(report["shape"], {"m": 72, "k": 136, "n": 40})
    rows = {(r["kernel"], r["pass"]): r for r in report["results"]}
    self.assertLen(rows, 4 * 3)
    for (name, _), row in rows.items():
      self.assertIsNone(row["error"])
      self.assertGreaterEqual(row["sqnr_db"], 18.0 if name != "xla_bf16" else 40.0)
      for key in ("rel_fro", "mere", "underflow", "backend"):
        self.assertIn(key, row)

  def test_check_gives_every_registered_kernel_a_verdict(self):
    # Every registered kernel at the smallest shape, Pallas ones in interpret mode: none may
    # raise or give a non-finite output (the command exits 1 then), and a chain kernel (a
    # GEMM with its epilogue fused in) is checked as its whole chain, backward included
    # where it has one.
    path = os.path.join(tempfile.mkdtemp(), "check.json")
    proc = run_module("experiments.kernels", "--config.check.m=8", "--config.check.k=16",
                      "--config.check.n=16", f"--config.check.json={path}", timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stderr[-2000:] + proc.stdout[-4000:])
    with open(path) as f:
      report = json.load(f)
    verdicts = report["verdicts"]
    self.assertEqual(sorted(verdicts), kernels.names())
    self.assertNotIn("error", verdicts.values())
    batched = ["pallas_fp8_batched", "pallas_mosaic_fp8_batched"]
    self.assertEqual([k for k, v in verdicts.items() if v == "unsupported"],
                     batched)  # batched specs only; this one is dense
    self.assertIn(f"verdicts: {len(verdicts) - 2} measured, 2 unsupported", proc.stdout)
    chains = [k for k in kernels.all_kernels() if isinstance(k, kernels_base.ChainKernel)]
    self.assertNotEmpty(chains)  # the fused-epilogue kernels
    for kernel in chains:
      rows = {r["pass"]: r for r in report["results"] if r["kernel"] == kernel.name}
      want = ["fwd", "grad_lhs", "grad_rhs", "grad_bias"] if kernel.has_backward else ["fwd"]
      self.assertEqual(sorted(rows), sorted(want), kernel.name)
      for row in rows.values():
        self.assertGreaterEqual(row["sqnr_db"], 18.0, (kernel.name, row["pass"]))

  def test_bad_arguments_are_one_line_errors(self):
    proc = run_module("experiments.kernels", "--config.check.shapes=12by4", timeout=120)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("error: --config.check.shapes: '12by4' must look like 2048x256x768",
                  proc.stderr)


if __name__ == "__main__":
  absltest.main()
