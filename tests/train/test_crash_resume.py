"""Crash-resume: a training subprocess SIGKILLed at fixed points (one inside a checkpoint
write) and restarted from its workdir ends bit-identical to an uninterrupted run.

The run is the tiny DLRM with `--precision=loka` and a plan that mixes XLA FP8 kernels with
Flax's delayed-scaling op, so FP8 state (amax histories and scales) must survive every kill.
Each run is a child process of its own, forked from the warm interpreter of the CLI tests
(`cli_helpers.run_module`), and the children share the suite's compilation cache: only the
first one compiles the run's steps.
"""
import json
import os
import signal
import tempfile

import chex
import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from loka_jax.train import WALL_CLOCK_FIELDS, read_metrics

CRASH_RUN = "tests.crash_run"   # tests/crash_run.py, a script beside the helpers, as a module
STEPS = 8
CHECKPOINT_EVERY = 2
BF16 = {"fwd": "xla_bf16", "grad_lhs": "xla_bf16", "grad_rhs": "xla_bf16"}
DELAYED = {"fwd": "flax_fp8_delayed", "grad_lhs": "flax_fp8_delayed",
           "grad_rhs": "flax_fp8_delayed"}
PLAN = {
    "schema": "loka.plan/1", "model": "dlrm",
    "sites": {"interaction/dot": DELAYED, "top_mlp/dense_2": DELAYED},
    "rules": [
        {"pattern": "bottom_mlp/.*", "passes": {"fwd": "xla_fp8_rowwise",
                                                "grad_lhs": "xla_fp8_tensorwise",
                                                "grad_rhs": "xla_fp8_rowwise"}},
        {"pattern": "top_mlp/dense_[01]", "passes": {"fwd": "xla_fp8_tensorwise",
                                                     "grad_lhs": "xla_fp8_rowwise",
                                                     "grad_rhs": "xla_bf16"}}],
    "default": BF16}
# Where each successive run of the interrupted workdir dies, one point per phase of a run:
# inside the commit of a checkpoint (files written, directory not yet renamed), between
# checkpoints (after step 5's line), halfway through a metrics line, and halfway through
# final.json after the last checkpoint. The run after the last kill finishes.
KILLS = ("checkpoint:4", "step:5", "metrics:7", "final")


def without_wall_clock(records):
  return [{k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS} for r in records]


def committed_steps(workdir):
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  return sorted(int(n) for n in names if n.isdigit())


class CrashResumeTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = tempfile.mkdtemp(prefix="loka_crash_")
    cls.plan = os.path.join(cls.root, "plan.json")
    with open(cls.plan, "w") as f:
      json.dump(PLAN, f)

  def launch(self, workdir, *args):
    """Runs tests/crash_run.py; returns (exit code, the first step it trained (None if it
    trained none), stderr tail)."""
    done = run_module(CRASH_RUN, workdir, f"--plan={self.plan}", f"--steps={STEPS}",
                      f"--checkpoint_every={CHECKPOINT_EVERY}", *args, timeout=240)
    first = [int(line.split()[-1]) for line in done.stdout.splitlines()
             if line.startswith("first step ")]
    return done.returncode, (first[0] if first else None), done.stderr[-3000:]

  def run_killed(self, workdir, where, resumes_at):
    """Runs until the kill at `where`, checking that it resumed after step `resumes_at`."""
    code, first, err = self.launch(workdir, f"--kill={where}")
    self.assertEqual(code, -signal.SIGKILL, f"--kill={where} did not die by SIGKILL:\n{err}")
    self.assertEqual(first, resumes_at + 1, f"--kill={where}: resumed at the wrong step")

  def test_killed_and_resumed_equals_uninterrupted(self):
    whole = os.path.join(self.root, "whole")
    code, first, err = self.launch(whole, f"--dump={whole}.npz")
    self.assertEqual((code, first), (0, 1), err)

    broken = os.path.join(self.root, "broken")
    metrics = os.path.join(broken, "metrics.jsonl")

    self.run_killed(broken, "checkpoint:4", resumes_at=0)
    # Orbax wrote step 4 into its temporary directory and never renamed it: not a checkpoint.
    leftovers = [n for n in os.listdir(os.path.join(broken, "checkpoints"))
                 if n.startswith("4.") and "tmp" in n]
    self.assertNotEmpty(leftovers, "the kill did not happen inside the checkpoint write")
    self.assertEqual(committed_steps(broken), [2])
    self.assertEqual(read_metrics(metrics)[-1]["step"], 4)

    self.run_killed(broken, "step:5", resumes_at=2)
    self.assertEqual(committed_steps(broken), [2, 4])
    self.assertEqual(read_metrics(metrics)[-1]["step"], 5)

    self.run_killed(broken, "metrics:7", resumes_at=4)
    with open(metrics) as f:
      last = f.read().splitlines()[-1]
    self.assertStartsWith(last, '{"')
    with self.assertRaises(json.JSONDecodeError):  # the torn line
      json.loads(last)

    self.run_killed(broken, "final", resumes_at=6)
    self.assertEqual(committed_steps(broken)[-1], STEPS)
    self.assertFalse(os.path.exists(os.path.join(broken, "final.json")))
    self.assertTrue(os.path.exists(os.path.join(broken, "final.json.tmp")))

    # The last run restores step 8 and only evaluates and writes final.json.
    code, first, err = self.launch(broken, f"--dump={broken}.npz")
    self.assertEqual((code, first), (0, None), err)

    # Parameters, optimizer state, FP8 state, step and rng: bit for bit.
    expected, resumed = np.load(f"{whole}.npz"), np.load(f"{broken}.npz")
    self.assertEqual(sorted(resumed.files), sorted(expected.files))
    fp8 = [k for k in expected.files if k.startswith("fp8_meta/")]
    self.assertNotEmpty(fp8, "the plan put no FP8 state in play")
    self.assertTrue(any(np.abs(expected[k]).max() > 0 for k in fp8 if "amax_history" in k))
    for key in expected.files:
      self.assertEqual(resumed[key].dtype, expected[key].dtype, key)
      np.testing.assert_array_equal(resumed[key], expected[key], err_msg=key)
    self.assertEqual(int(resumed["step"]), STEPS)

    # One metrics line per step, equal apart from wall-clock fields; final.json equal too.
    lines_whole = read_metrics(os.path.join(whole, "metrics.jsonl"))
    lines_resumed = read_metrics(metrics)
    self.assertEqual([r["step"] for r in lines_resumed], list(range(1, STEPS + 1)))
    self.assertEqual(without_wall_clock(lines_resumed), without_wall_clock(lines_whole))
    finals = []
    for workdir in (whole, broken):
      with open(os.path.join(workdir, "final.json")) as f:
        finals.append(json.load(f))
    self.assertEqual(without_wall_clock(finals[1:]), without_wall_clock(finals[:1]))
    for key in ("ne", "logloss", "auc"):
      self.assertTrue(np.isfinite(finals[1][key]), key)


if __name__ == "__main__":
  absltest.main()
