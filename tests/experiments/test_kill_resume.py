"""The main job (`python -m experiments.loka`) and a probe (`python -m experiments.probe`)
killed with SIGKILL at a seeded random point of each long stage, then rerun with the same
command and workdir, finish with the plan (and probe report) of an uninterrupted run.

Stages: (a) the probe's training with its statistics pass, (b) the per-site error
evaluation, (c) the kernel timing (the probe, timing on the CPU), (d) the end-to-end
validation. Each kill is placed by what the run has written so far (a progress line, a
committed checkpoint): the k-th event of the stage (k drawn from the stage's seed) and then a
short random delay; the test checks from the killed run's output that the stage had not
ended, and from the rerun's that it did no piece of work again that the killed run had
reported done. The main job is killed in (a), (b) and (d) in turn in one workdir: each rerun
resumes the run killed before it, finishes that run's stage and is killed in the next one; the
last rerun runs to the end. The probe is killed in (c) in a workdir holding the files the
uninterrupted probe had written when it reached the timing (what a probe killed there has on
disk besides the stage's own), so it goes straight to it. What may differ between the runs is
wall-clock: creation times, durations, the probe's measured overhead and, on the CPU, the
measured kernel times, and the digests over them.

The dlrm `tiny` tower with a 10-step probe is the cheapest run whose plan holds FP8 sites
after the held-out check backs some of them off over three rounds.
"""
import json
import os
import random
import re
import shutil
import signal
import tempfile
import time

import chex
from absl.testing import absltest

from cli_helpers import run_module
from loka_jax.dispatch import select
from loka_jax.probe.report import load_report

SEED = 7
# Wall-clock fields, the workdir's own path, and the digests that cover them.
VOLATILE = {"created", "report_created", "time", "seconds", "report_path", "sha256",
            "report_sha256", "overhead"}
# On the CPU the probe's measured kernel times vary from run to run, and so does what is made
# of them: speedups, whether a time resolves a speedup, each pass's best kernel.
TIMED = {"time_us", "time_iqr_us", "speedup", "baseline_us", "timing", "timing_note", "best",
         "cache"}


MAIN_FLAGS = ("--config.run.model=dlrm", "--config.run.preset=tiny", "--config.run.steps=2",
              "--config.run.batch_size=64", "--config.run.num_eval=256",
              "--config.probe.steps=10", "--config.probe.cadence=5",
              "--config.probe.checkpoint_every=5", "--config.probe.samples=2",
              "--config.probe.sites=top_mlp",
              "--config.select.min_speedup=0", "--config.validate.shadow_steps=0",
              "--config.arms.naive_fp8=false")
PROBE_FLAGS = ("--config.run.model=dlrm", "--config.run.preset=tiny", "--config.run.steps=4",
               "--config.run.checkpoint_every=4", "--config.run.batch_size=64",
               "--config.stats.cadence=2", "--config.evaluate.samples=2",
               "--config.evaluate.kernels=xla_bf16,xla_fp8_tensorwise,xla_fp8_rowwise",
               "--config.evaluate.sites=top_mlp/dense_[01]",
               "--config.timing.time=on", "--config.timing.repeats=2",
               "--config.plots.enabled=false")


def without(value, keys):
  """`value` with every dict entry named in `keys` left out, at any depth."""
  if isinstance(value, dict):
    return {k: without(v, keys) for k, v in value.items() if k not in keys}
  if isinstance(value, list):
    return [without(v, keys) for v in value]
  return value


def differences(a, b, where=""):
  """The paths at which two JSON values differ."""
  if isinstance(a, dict) and isinstance(b, dict):
    return [d for k in sorted(set(a) | set(b), key=str)
            for d in differences(a.get(k), b.get(k), f"{where}/{k}")]
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
  return [] if a == b else [f"{where or '/'}: {a!r:.80} != {b!r:.80}"]


def read_json(path):
  with open(path) as f:
    return json.load(f)


def lines_of(path):
  """The whole JSON lines of a metrics.jsonl (a torn last line left out)."""
  with open(path) as f:
    return [line.rstrip("\n") for line in f if line.endswith("\n")]


class KillAt:
  """`run_module`'s kill_when: True `delay` seconds after the run's output first holds
  `count` lines matching `pattern` (or, with `path`, after that path exists)."""

  def __init__(self, stage, pattern=None, count=1, path=None, max_delay=0.1):
    rng = random.Random(f"{stage}:{SEED}")
    self.pattern, self.path = pattern, path
    self.count = count if isinstance(count, int) else rng.randint(*count)
    self.delay = rng.uniform(0.0, max_delay)
    self.seen = None

  def __call__(self, out, err):
    if self.seen is None:
      if self.path is not None:
        reached = os.path.exists(self.path)
      else:
        reached = len(re.findall(self.pattern, out + err, re.M)) >= self.count
      if not reached:
        return False
      self.seen = time.monotonic()
    return time.monotonic() - self.seen >= self.delay


class KillResumeCase(chex.TestCase):
  MODULE = None
  FLAGS = ()
  PREFIX = None   # of the temporary folder holding the uninterrupted run and the killed ones

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if cls.MODULE is None:  # the shared base, no job of its own
      return
    cls.root = tempfile.mkdtemp(prefix=cls.PREFIX)
    cls.reference = os.path.join(cls.root, "uninterrupted")
    done = cls.run_job(cls.reference)
    if done.returncode != 0:
      raise AssertionError(f"the uninterrupted {cls.MODULE} run failed:\n"
                           f"{done.stderr[-3000:]}")

  @classmethod
  def run_job(cls, workdir, kill_when=None):
    # Every run uses the suite's compilation cache ($JAX_COMPILATION_CACHE_DIR, from
    # tests/conftest.py): the killed runs and the reruns load what the first run compiled.
    return run_module(cls.MODULE, f"--workdir={workdir}", *cls.FLAGS, timeout=300,
                      kill_when=kill_when)

  def workdir_at(self, name, reached=()):
    """A new workdir holding the files (`reached`, paths in the workdir) the uninterrupted
    run had written when it reached a stage: a run started there goes straight to it."""
    workdir = os.path.join(self.root, name)
    for path in reached:
      source, target = os.path.join(self.reference, path), os.path.join(workdir, path)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, target)
    return workdir

  def assertResumed(self, name, killed, again, stage_end, work=None):
    """`killed`: a run killed in a stage (its output then lacks `stage_end`); `again`: the
    rerun in its workdir, which finished that stage (to the end of the job, or until killed
    in a later stage). `work`: a pattern of the output lines that report a piece of work done
    (and kept); the rerun does none of the pieces the killed run reported again."""
    self.assertEqual(killed.returncode, -signal.SIGKILL,
                     f"{name}: the run was not killed\n{killed.stdout[-2000:]}"
                     f"{killed.stderr[-2000:]}")
    self.assertNotIn(stage_end, killed.stdout,
                     f"{name}: the kill fell after the stage it was meant for")
    self.assertIn(again.returncode, (0, -signal.SIGKILL),
                  again.stdout[-2000:] + again.stderr[-3000:])
    self.assertIn(stage_end, again.stdout, f"{name}: the rerun did not finish the stage\n"
                  f"{again.stdout[-2000:]}{again.stderr[-3000:]}")
    if work is not None:
      before = re.findall(work, killed.stdout, re.M)
      self.assertNotEmpty(before, f"{name}: the kill came before any work of the stage")
      self.assertEmpty(set(before) & set(re.findall(work, again.stdout, re.M)),
                       f"{name}: the rerun did again what the killed run had done")

  def kill_then_rerun(self, workdir, killer, stage_end, work=None):
    """Runs the job in `workdir` until `killer` kills it, then reruns it to its end; checks
    both with `assertResumed`."""
    killed = self.run_job(workdir, killer)
    again = self.run_job(workdir)
    self.assertEqual(again.returncode, 0, again.stdout[-2000:] + again.stderr[-3000:])
    self.assertResumed(os.path.basename(workdir), killed, again, stage_end, work)


class MainJobKillTest(KillResumeCase):
  MODULE = "experiments.loka"
  FLAGS = MAIN_FLAGS
  PREFIX = "loka_kill_main_"
  # The stages the job is killed in, in turn, and the start of the line its output has once
  # the stage ended.
  STAGES = (("statistics", "[probe] trained to step"),
            ("evaluation", "[probe] evaluation phase"),
            ("validation", "[pipeline] plan: "))

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.workdir = os.path.join(cls.root, "killed")
    metrics = os.path.join(cls.workdir, "probe", "metrics.jsonl")
    killers = {
        # Just after the probe's checkpoint at step 5, an observation step (the next is at
        # 10): the rerun resumes from it, and must observe at step 10, not 6.
        "statistics": KillAt("statistics", max_delay=0.05,
                             path=os.path.join(cls.workdir, "probe", "checkpoints", "5")),
        # After the first of the probe's three sites (each takes 0.1-0.5 s).
        "evaluation": KillAt("evaluation", r"^\[probe\] evaluated \d+/", max_delay=0.15),
        # Among the held-out rounds' site measurements (saved one by one in
        # plan_validating.json).
        "validation": KillAt("validation", r"^\[pipeline\] quality_held_out round \d+, site",
                             count=(1, 3)),
    }
    # Each run's output, and the probe's metrics lines when it ended.
    cls.runs, cls.metrics = [], []
    for stage, _ in cls.STAGES:
      cls.runs.append(cls.run_job(cls.workdir, killers[stage]))
      cls.metrics.append(lines_of(metrics) if os.path.exists(metrics) else [])
    cls.runs.append(cls.run_job(cls.workdir))
    cls.metrics.append(lines_of(metrics))

  def assertKilledThenResumed(self, stage, work=None):
    """The run killed in `stage`, and its rerun: see `assertResumed`."""
    i = [name for name, _ in self.STAGES].index(stage)
    self.assertResumed(stage, self.runs[i], self.runs[i + 1], self.STAGES[i][1], work)
    last = self.runs[-1]
    self.assertEqual(last.returncode, 0, last.stdout[-2000:] + last.stderr[-3000:])

  def assertSameOutcome(self, workdir):
    plan, expected = (read_json(os.path.join(d, "plan.json")) for d in (workdir, self.reference))
    fp8 = [name for name, passes in expected["sites"].items()
           if any("fp8" in choice["kernel"] for choice in passes.values())]
    self.assertNotEmpty(fp8, "the uninterrupted run's plan holds no FP8 site")
    self.assertEmpty(differences(without(plan, VOLATILE), without(expected, VOLATILE)))
    report, expected = (read_json(os.path.join(d, "probe_report.json"))
                        for d in (workdir, self.reference))
    self.assertEmpty(differences(without(report, VOLATILE), without(expected, VOLATILE)))
    # Every arm trained to its end, and the LoKA arm on this plan.
    loka = [d for d in os.listdir(os.path.join(workdir, "arms")) if d.startswith("loka_")]
    self.assertEqual(loka, [d for d in os.listdir(os.path.join(self.reference, "arms"))
                            if d.startswith("loka_")])
    self.assertTrue(os.path.exists(os.path.join(workdir, "report.md")))

  def test_killed_in_the_statistics_pass(self):
    # The first run, from an empty workdir. The probe writes a metrics line at each checkpoint
    # (5, 10), before saving it. A rerun keeps the lines up to the step it resumes from as
    # they are and writes the later ones; one that trained from step 0 again would write line
    # 5 anew (its time and speed differ).
    self.assertKilledThenResumed("statistics")
    kept = [line for line in self.metrics[0] if json.loads(line)["step"] <= 5]
    self.assertEqual([json.loads(line)["step"] for line in kept], [5])
    for rerun in self.metrics[1:]:   # the rerun trained to its end; the later ones kept it
      self.assertEqual([json.loads(line)["step"] for line in rerun], [5, 10])
      self.assertEqual(rerun[0], kept[0], "the rerun trained the checkpoint's steps again")
    self.assertSameOutcome(self.workdir)

  def test_killed_in_the_per_site_evaluation(self):
    # The rerun of the run killed in the statistics pass: the probe trained (its checkpoints,
    # statistics inside), then killed among its sites.
    self.assertKilledThenResumed("evaluation", work=r"^\[probe\] evaluated \d+/\d+ (\S+)")
    self.assertSameOutcome(self.workdir)

  def test_killed_in_the_validation(self):
    # The rerun of the run killed in the evaluation: the probe report and the selected plan
    # written, then killed among the held-out rounds.
    self.assertKilledThenResumed(
        "validation", work=r"^\[pipeline\] quality_held_out round (\d+), site (\S+):")
    self.assertSameOutcome(self.workdir)


class ProbeKillTest(KillResumeCase):
  MODULE = "experiments.probe"
  FLAGS = PROBE_FLAGS
  PREFIX = "loka_kill_probe_"

  def test_killed_in_the_kernel_timing(self):
    # From the trained and evaluated probe (its statistics summarized, every site's errors
    # cached: it does not train again), after the first of its two shapes (about 1 s each).
    workdir = self.workdir_at("timing", ["checkpoints", "config.json", "metrics.jsonl",
                                         "final.json", "probe_eval.jsonl", "probe_trained.json"])
    killer = KillAt("timing", r"^\[probe\] timed ", max_delay=0.3)
    self.kill_then_rerun(workdir, killer, "[probe] report: ", work=r"^\[probe\] timed (\S+)")
    report = load_report(os.path.join(workdir, "probe_report.json"))
    expected = load_report(os.path.join(self.reference, "probe_report.json"))
    self.assertEmpty(differences(without(report, VOLATILE | TIMED),
                                 without(expected, VOLATILE | TIMED)))
    timed = lambda r: sorted((name, p, k) for name, site in r["sites"].items()
                             for p, per in site["passes"].items()
                             for k, e in per.items() if e.get("time_us"))
    self.assertNotEmpty(timed(expected), "the probe timed nothing")
    self.assertEqual(timed(report), timed(expected))
    plan, expected_plan = (select(r, min_speedup=None) for r in (report, expected))
    self.assertEmpty(differences(without(plan.to_dict(), VOLATILE),
                                 without(expected_plan.to_dict(), VOLATILE)))


if __name__ == "__main__":
  absltest.main()
