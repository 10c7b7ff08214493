"""The bench suite on the CPU: its targets' names, the GEMM calls it counts in a step's HLO,
arms that compile to one program, pacing against the hard end, rows after a probe, and
head-to-head timing."""
import json
import os
import re
import time
from unittest import mock

import numpy as np
from absl.testing import absltest

from bench_rows import tempdir
from experiments.bench import pace, speed, suite, targets, variants
from experiments.bench.results import ResultsFile
from loka_jax.kernels.choice import KernelChoice, KernelPlan
from loka_jax.models.site import SiteConfig


class ParseTargetTest(absltest.TestCase):

  def test_model_and_tower_targets_and_a_clear_error(self):
    self.assertEqual(suite.parse_target("dhen/large"), suite.Target("models", "dhen", "large"))
    tower = suite.parse_target("tower/4096x256x8", 512)
    self.assertEqual((tower.suite, tower.preset, tower.batch_size), ("towers", "4096x256x8", 512))
    for bad in ("dhen", "/large", "dhen/", ""):
      with self.assertRaisesRegex(ValueError, "expected model/preset or tower/BxWxD"):
        suite.parse_target(bad)


class GemmCallsTest(absltest.TestCase):

  def test_every_gemm_backend_of_a_gpu_hlo_is_counted(self):
    from experiments.bench.speed import gemm_calls
    # Lines in the form of an H100 step's optimized HLO (custom-call targets, fusion kinds).
    hlo = "\n".join([
        '%a = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%x, %w), '
        'custom_call_target="__cublas$lt$matmul"',
        '%b = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%x, %w), '
        'custom_call_target="__cublas$lt$matmul$f8"',
        '%c = bf16[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}',
        '%d = bf16[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        '%e = f32[64,32]{1,0} custom-call(%x, %w), custom_call_target="__gpu$xla.gpu.triton"',
    ])
    self.assertEqual(gemm_calls(hlo), {"cublaslt": 1, "cublaslt_fp8": 1, "xla_triton_gemm": 2,
                                       "pallas_triton": 1})


class SameProgramTest(absltest.TestCase):
  """The rule `targets.same_program_as_bf16_mods` rests on: a LoKA plan with every site on
  xla_bf16 compiles to bf16+Mods' own train and inference programs (so validation's
  all-bf16 baseline and the bench's bf16+Mods arm time one program)."""

  def _programs(self, target, site):
    from loka_jax.train import loop
    from loka_jax.train.optim import OptimConfig, make_optimizer
    from loka_jax.train.state import create_train_state
    model = target.build(site, variants.VARIANTS["bf16_mods"].mods)
    batch = target.source(0).train_batch(0, 64)
    optim = OptimConfig()
    state = create_train_state(model, make_optimizer(optim), batch, 0)
    train_step, eval_step = loop.compiled_steps(model, optim, "stop")

    def text(fn):  # instruction numbering and source metadata differ between two builds
      hlo = fn.lower(state, batch).compile().as_text()
      return re.sub(r"\.\d+", "", re.sub(r"metadata=\{[^}]*\}", "", hlo))
    return text(train_step), text(eval_step)

  def test_an_all_bf16_plan_compiles_to_the_bf16_mods_program(self):
    target = suite.tower_targets(["64x32x3"])[0]
    bf16_mods = self._programs(target, SiteConfig.for_precision("bf16"))
    all_bf16 = self._programs(target, speed.site_config(variants.VARIANTS["loka"],
                                                        KernelPlan.uniform("xla_bf16")))
    self.assertEqual(all_bf16, bf16_mods)
    # and the comparison can tell two programs apart: one FP8 site changes it
    fp8 = KernelPlan(sites=(("mlp/dense_1", KernelChoice.uniform("xla_fp8_tensorwise")),),
                     default=KernelChoice.uniform("xla_bf16"))
    self.assertNotEqual(self._programs(target, speed.site_config(variants.VARIANTS["loka"],
                                                                 fp8))[0], bf16_mods[0])


class DeadlineTest(absltest.TestCase):

  def test_past_the_deadline_nothing_is_built_and_a_rerun_finishes(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, probe=False)
    logs = []
    with mock.patch.object(speed.TargetBench, "set_baseline",
                           side_effect=AssertionError("baseline built past the deadline")):
      done = suite.run_target(target, variants.parse_variants(["bf16_mods"]), results,
                              settings=settings, deadline=time.time() - 1, device="cpu",
                              log=logs.append)
    self.assertFalse(done)
    self.assertIn(f"  deadline: {target.name} left for the next run, its baseline not built",
                  logs)
    self.assertEqual(list(results.rows()), [])
    self.assertTrue(suite.run_target(target, variants.parse_variants(["bf16_mods"]), results,
                                     settings=settings, deadline=float("inf"), device="cpu",
                                     log=lambda _: None))
    self.assertEqual([r["variant"] for r in results.rows()], ["bf16", "bf16_mods"])


  def test_rows_start_by_their_expected_length_when_the_hard_end_is_known(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    key = ("towers", target.model, target.preset, "cpu", None)
    logs = []

    def run(names, deadline, end_by, head_to_head=()):
      settings = suite.SpeedSettings(repeats=3, probe=False, head_to_head=head_to_head)
      return suite.run_target(target, variants.parse_variants(names), results,
                              settings=settings, deadline=deadline, device="cpu",
                              log=logs.append, end_by=end_by)

    # Past pacing.max_minutes with no row recorded, pacing.max_minutes rules: nothing is built.
    self.assertFalse(run(["bf16_mods"], time.time() - 1, time.time() + 3600))
    self.assertEqual(list(results.rows()), [])
    self.assertTrue(run(["bf16_mods"], float("inf"), None))
    rows = {r["variant"]: r for r in results.rows()}
    self.assertEqual(sorted(rows), ["bf16", "bf16_mods"])
    self.assertTrue(all(r["row_s"] > 0 for r in rows.values()))
    longest = max(r["row_s"] for r in rows.values())
    self.assertAlmostEqual(suite.expected_row_s(results, key, "fp8_tensorwise"),
                           pace.MARGIN * longest)
    self.assertAlmostEqual(suite.expected_row_s(results, key, "bf16"),
                           pace.MARGIN * rows["bf16"]["row_s"])
    # The bf16 row's length counts the baseline's build, the bf16 arm itself: a slow build
    # (here 1 s more) shows in it, so the rows paced by it expect a compile.
    set_baseline = speed.TargetBench.set_baseline
    def set_baseline_slowly(bench, model):
      time.sleep(1.0)
      return set_baseline(bench, model)
    scratch = ResultsFile(os.path.join(out, "scratch.jsonl"), suite.KEY_FIELDS)
    with mock.patch.object(speed.TargetBench, "set_baseline", set_baseline_slowly):
      self.assertTrue(suite.run_target(
          target, variants.parse_variants(["bf16"]), scratch,
          settings=suite.SpeedSettings(repeats=3, probe=False), deadline=float("inf"),
          device="cpu", log=logs.append))
    (bf16_row,) = list(scratch.rows())
    self.assertGreaterEqual(bf16_row["row_s"], 1.0)
    # Past pacing.max_minutes, a row starts when the longest recorded one would end in time ...
    self.assertTrue(run(["fp8_tensorwise"], time.time() - 1, time.time() + 3600))
    self.assertIn("fp8_tensorwise", {r["variant"] for r in results.rows()})
    # ... and, before it, none starts that would not: not the baseline ...
    logs.clear()
    self.assertFalse(run(["fp8_rowwise"], float("inf"), time.time() + 0.5 * longest))
    self.assertIn("its baseline not built", logs[-1])
    # ... nor a row after another.
    logs.clear()
    expected = {"fp8_rowwise": 1e-3, "flax_fp8_delayed": 1e6}
    with mock.patch.object(suite, "expected_row_s",
                           side_effect=lambda results, key, name: expected[name]):
      self.assertFalse(run(["fp8_rowwise", "flax_fp8_delayed"], float("inf"),
                           time.time() + 3600))
    self.assertIn("fp8_rowwise", {r["variant"] for r in results.rows()})
    self.assertIn("flax_fp8_delayed left for the next run (it may take 1000000 s", logs[-1])
    # A head-to-head row does not start past pacing.max_minutes, where its rebuilds stop.
    logs.clear()
    self.assertFalse(run(["flax_fp8_delayed"], time.time() - 1, time.time() + 3600,
                         head_to_head=("flax_fp8_delayed",)))
    self.assertIn("head-to-head", logs[-1])
    self.assertNotIn("flax_fp8_delayed", {r["variant"] for r in results.rows()})


class ProbeThenRowsTest(absltest.TestCase):

  def test_a_probe_that_leaves_no_plan_builds_no_baseline(self):
    # The probe has the run's time (its budget is the time to the deadline) and stops short
    # of a plan when its next step would not fit: the target waits for the next run, its
    # peers too, instead of compiling a baseline the deadline throws away.
    from loka_jax import dispatch
    from experiments.bench import planning
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, plans_dir=os.path.join(out, "plans"),
                                   head_to_head=())
    pending = variants.parse_variants(["bf16_mods", "loka"])
    logs = []
    with mock.patch.object(planning, "make_plan", return_value=None) as make_plan, \
        mock.patch.object(speed.TargetBench, "set_baseline",
                          side_effect=AssertionError("baseline built after the probe")):
      done = suite.run_target(target, pending, results, settings=settings,
                              deadline=time.time() + 600, device="cpu", log=logs.append)
    self.assertFalse(done)
    make_plan.assert_called_once()
    self.assertIn(f"  planning (probe or validation) ran to its budget and the LoKA plan is "
                  f"not ready: {target.name} left for the next run, its baseline not built",
                  logs)
    self.assertEqual(list(results.rows()), [])

    # A probe that writes its plan: the baseline and the other rows follow in the same run.
    def plan_made(spec, plans_root, *args, **kwargs):
      path = planning.plan_path(plans_root, spec.model, spec.preset)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      dispatch.save_plan({"schema": "loka.plan/1", "sites": {},
                          "default": {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}},
                         path)
      return path
    logs = []
    with mock.patch.object(planning, "make_plan", side_effect=plan_made):
      suite.run_target(target, variants.parse_variants(["bf16_mods"]) + pending[1:], results,
                       settings=settings, deadline=time.time() + 600, device="cpu",
                       log=logs.append)
    self.assertTrue(any("bf16 compiled" in line for line in logs), logs)
    self.assertContainsSubset({"bf16", "bf16_mods"}, {r["variant"] for r in results.rows()})


class HeadToHeadTest(absltest.TestCase):

  def test_the_subject_runs_last_and_is_timed_against_each_reference(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, probe=False, head_to_head=("fp8_rowwise",))

    def run(names):
      logs = []
      done = suite.run_target(target, variants.parse_variants(names), results,
                              settings=settings, deadline=float("inf"), device="cpu",
                              log=logs.append)
      self.assertTrue(done)
      return logs
    run(["bf16_mods"])  # an earlier run timed bf16+Mods: its arm is gone
    logs = run(["fp8_rowwise", "bf16_mods", "fp8_tensorwise"])
    rows = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual([r["variant"] for r in rows],
                     ["bf16", "bf16_mods", "fp8_tensorwise", "fp8_rowwise"])
    for r in rows[:3]:
      self.assertNotIn("head_to_head", r)
    self.assertIn("  fp8_rowwise vs bf16_mods: building bf16_mods again for the pair", logs)
    self.assertFalse(any("building fp8_tensorwise" in line for line in logs), logs)
    pairs = rows[-1]["head_to_head"]
    # bf16+Mods, and the best (only) other peer; no served arm ran.
    self.assertEqual(sorted(pairs), ["bf16_mods", "fp8_tensorwise"])
    for modes in pairs.values():
      for mode in ("train", "infer"):
        pair = modes[mode]
        self.assertLen(pair["samples_us"], 3)
        self.assertLen(pair["other_samples_us"], 3)
        # The ratio is the other's median step over the subject's, from the pair's samples.
        self.assertAlmostEqual(pair["ratio"], np.median(pair["other_samples_us"])
                               / np.median(pair["samples_us"]), delta=1e-3 * pair["ratio"])
        self.assertLessEqual(pair["ci"][0], pair["ratio"])
        self.assertGreaterEqual(pair["ci"][1], pair["ratio"])
    self.assertTrue(any("fp8_rowwise vs fp8_tensorwise, one interleaving" in l for l in logs),
                    logs)

  def test_a_reference_is_not_rebuilt_when_its_build_would_end_past_the_deadline(self):
    # LoKA's row is written only after its pairs: a rebuild the call's hard limit cuts short
    # would lose the row itself, so a rebuild starts only when the longest build of the run
    # would still end by the deadline.
    subject = speed.Arm("loka", None, None, {}, {})
    rows = {"bf16_mods": {"variant": "bf16_mods"}, "loka": {"variant": "loka"}}

    class PairsOf:  # records which arms LoKA was paired with
      def head_to_head(self, arm, others, repeats, seed):
        self.paired = sorted(others)
        return {}
    settings = suite.SpeedSettings(repeats=3, probe=False)
    for build_s, rebuilt in ((120.0, []), (5.0, ["bf16_mods"])):
      built, logs, bench = [], [], PairsOf()
      fields = suite._head_to_head(
          bench, subject, {}, rows, lambda name: built.append(name) or subject,
          time.time() + 60.0, settings, logs.append, build_s)
      self.assertEqual(built, rebuilt, logs)
      self.assertEqual(bench.paired, rebuilt)
      self.assertEqual(fields, {})
      if not rebuilt:
        self.assertIn("  loka vs bf16_mods: not built again, since a build (120 s at most so "
                      "far) would end past the deadline (the ratio of rows stands)", logs)

  def test_a_rebuild_longer_than_the_runs_builds_paces_the_next(self):
    # The first rebuild takes 0.35 s where the run's builds had taken 0.05 s: the second
    # would then end past a deadline 0.6 s away, so it is not started.
    subject = speed.Arm("loka", None, None, {}, {})
    rows = {n: {"variant": n} for n in ("bf16_mods", targets.SERVED, "loka")}

    class PairsOf:
      def head_to_head(self, arm, others, repeats, seed):
        return {}
    built, logs = [], []

    def slow_build(name):
      time.sleep(0.35)
      built.append(name)
      return subject
    suite._head_to_head(PairsOf(), subject, {}, rows, slow_build, time.time() + 0.6,
                        suite.SpeedSettings(repeats=3, probe=False), logs.append, 0.05)
    self.assertEqual(built, ["bf16_mods"], logs)
    self.assertTrue(any(f"loka vs {targets.SERVED}: not built again" in l for l in logs), logs)


if __name__ == "__main__":
  absltest.main()
