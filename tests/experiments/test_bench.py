"""The headline benchmark's command line on the CPU: resumable rows, targets.only, the towers
and quality configs. Timings here are smoke numbers; the checks are structural."""
import json
import os

from absl.testing import absltest

from bench_rows import tempdir
from cli_helpers import REPO, run_module
from experiments.bench import suite, variants
from experiments.bench.results import ResultsFile

TOWERS_CONFIG = os.path.join("experiments", "configs", "bench_towers.py")
QUALITY_CONFIG = os.path.join("experiments", "configs", "bench_quality.py")
# A bench CLI run's compilation cache: conftest's for this run (unset, the bench keeps one in
# its workdir, empty in every test), so the steps this file compiled are not compiled again.
COMPILE_CACHE = f"--config.compile_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}"



class CliTest(absltest.TestCase):

  def test_runs_filters_and_resumes(self):
    out = tempdir(self)
    first = run_module("experiments.bench", f"--config={TOWERS_CONFIG}",
                       "--config.targets.towers=32x16x2,48x16x2", "--config.targets.only=32x16x2",
                       "--config.speed.variants=bf16,fp8_rowwise", "--config.speed.repeats=3",
                       "--config.pacing.max_minutes=3", "--config.pacing.end_by_minutes=2.5",
                       f"--workdir={out}", "--config.probe.enabled=false",
                       "--config.speed.min_call_ms=0.5", COMPILE_CACHE, timeout=240)
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    # A hard end before pacing.max_minutes caps it, said, and costs the call nothing.
    self.assertIn("pacing.max_minutes=3.0 is past pacing.end_by_minutes=2.5", first.stdout)
    rows = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual(sorted((r["preset"], r["variant"]) for r in rows),
                     [("32x16x2", "bf16"), ("32x16x2", "fp8_rowwise")])
    for r in rows:
      self.assertLen(r["train"]["samples_us"], 3)
      self.assertGreater(r["infer"]["median_us"], 0)
      self.assertEqual(r["min_call_s"], 5e-4)  # the field reaches the timing and the row
    # A rerun skips finished rows: nothing is compiled or measured again.
    logs = []
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    done = suite.run_target(target, variants.parse_variants(["bf16", "fp8_rowwise"]), results,
                            settings=suite.SpeedSettings(repeats=3, probe=False),
                            deadline=float("inf"), device=rows[0]["device"], log=logs.append)
    self.assertTrue(done)
    self.assertEqual(logs, [])
    self.assertLen(open(os.path.join(out, "bench.jsonl")).read().splitlines(), 2)
    self.assertIn("all selected rows are done", first.stdout)
    for name in ("report.md", "targets.json", os.path.join("plots", "speedup_towers.png")):
      self.assertTrue(os.path.exists(os.path.join(out, name)), name)


  def test_deterministic_ops_run_the_quality_suite_and_no_timed_one(self):
    out = tempdir(self)
    base = ["experiments.bench", f"--workdir={out}"]
    deterministic = "--config.quality.xla_deterministic=true"
    timed = run_module(*base, f"--config={TOWERS_CONFIG}", deterministic, timeout=120)
    self.assertNotEqual(timed.returncode, 0)
    self.assertIn("--config.quality.xla_deterministic=True: for suite quality only",
                  timed.stderr)
    # quality.seeds: the arm at each of its seeds, and no bf16 noise seed beside them.
    quality_run = run_module(
        *base, f"--config={QUALITY_CONFIG}", COMPILE_CACHE, deterministic,
        "--config.quality.data=synthetic", "--config.quality.preset=tiny",
        "--config.targets.models=dlrm", "--config.quality.arms=bf16",
        "--config.quality.seeds=2,1", "--config.quality.steps=3", "--config.quality.eval=100",
        "--config.targets.batch_size=64", timeout=240)
    self.assertEqual(quality_run.returncode, 0, quality_run.stderr[-3000:])
    rows = [json.loads(l) for l in open(os.path.join(out, "quality.jsonl"))]
    self.assertEqual([(r["arm"], r["seed"]) for r in rows], [("bf16", 2), ("bf16", 1)])
    for row in rows:
      self.assertTrue(row["xla_deterministic"])
      self.assertIsNotNone(row["logloss"])
    # Different seeds train different runs.
    self.assertNotEqual(rows[0]["logloss"], rows[1]["logloss"])

  def test_bad_quality_seeds_fail_before_any_run(self):
    out = tempdir(self)
    for flag in ("--config.quality.seeds=1,x", "--config.quality.noise_seeds=1,1"):
      run = run_module("experiments.bench", f"--workdir={out}", f"--config={QUALITY_CONFIG}",
                       "--config.quality.data=synthetic", flag, timeout=120)
      self.assertNotEqual(run.returncode, 0, flag)
      self.assertIn(f"{flag}: must list distinct non-negative integers", run.stderr)
      self.assertFalse(os.path.exists(os.path.join(out, "quality.jsonl")), flag)

  def test_the_variants_field_names_every_variant(self):
    # The comment above `speed.variants` in the config file is the field's help.
    lines = open(os.path.join(REPO, "experiments", "configs", "bench.py")).read().splitlines()
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("speed.variants"))
    start = max(i for i in range(end) if not lines[i].strip().startswith("#")) + 1
    field_help = " ".join(line.strip("# ") for line in lines[start:end])
    for name in variants.VARIANTS:
      self.assertRegex(field_help, rf"\b{name}\b", name)

  def test_a_missing_plan_alone_builds_no_baseline(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, probe=False, plans_dir=os.path.join(out, "plans"))

    def run():
      logs = []
      done = suite.run_target(target, variants.parse_variants(["loka"]), results,
                              settings=settings, deadline=float("inf"), device="cpu",
                              log=logs.append)
      return done, logs
    done, logs = run()                       # the bf16 row is measured, LoKA waits
    self.assertFalse(done)
    self.assertTrue(any("bf16 compiled" in line for line in logs), logs)
    done, logs = run()                       # only LoKA is left: no baseline is built
    self.assertFalse(done)
    self.assertTrue(any("plan is not ready" in line for line in logs), logs)
    self.assertFalse(any("compiled" in line for line in logs), logs)
    rows = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual([r["variant"] for r in rows], ["bf16"])


if __name__ == "__main__":
  absltest.main()
