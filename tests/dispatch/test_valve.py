"""Drift valve in training: a real probe report and plan of a toy click model, then training
with the valve on data whose dense features jump 1000x mid-run (it switches the hit site's
kernel, recompiling once, logs it and saves the plan; a resumed run keeps the switched plan)
and on unshifted data (it never fires)."""
import dataclasses
import json
import os
import tempfile
from unittest import mock

import chex
import jax
import numpy as np
from absl.testing import absltest

from loka_jax import dispatch
from loka_jax.dispatch import reevaluation
from loka_jax.dispatch import valve as valve_lib
from loka_jax.kernels import KernelPlan, registry
from loka_jax.models import SiteConfig
from loka_jax.precision import BF16
from loka_jax.probe import collector as collector_lib
from loka_jax.probe import executables
from loka_jax.probe import training
from loka_jax.probe import report as report_lib
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe import stats_report
from loka_jax.train import (OptimConfig, TrainConfig, create_train_state, make_optimizer,
                            read_metrics, train)
from loka_jax.train import loop as loop_lib
from loka_jax.train import run_files
import train_toys
from cli_helpers import run_module

BATCH = 32
CANDIDATES = ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise")
CANDIDATES_SORTED = sorted(CANDIDATES)
SHIFT_AT = 6          # training batches from here on have dense features x1000
CADENCE = 4           # refreshes after steps 4 (before the shift), 8 and 12 (after it)
# No overhead budget and no compile ahead: these tests guard what a refresh at each cadence
# point does.
CONFIG = valve_lib.ValveConfig(cadence=CADENCE, samples=8, bootstrap=100, max_overhead=0.0,
                               compile_ahead=False)


class ShiftedSource(train_toys.ToySource):
  """The toy stream whose dense features are scaled by `factor` from batch `at` on."""

  def __init__(self, at: int, factor: float, **kwargs):
    super().__init__(**kwargs)
    self.at, self.factor = at, factor

  def train_batch(self, step, batch_size):
    batch = super().train_batch(step, batch_size)
    if step >= self.at:
      batch = dict(batch, dense=(batch["dense"] * self.factor).astype(np.float32))
    return batch


def _untimed(plan):
  """A plan's dict without the times its validation records were added at."""
  data = plan.to_dict()
  data["validation"] = [{k: v for k, v in r.items() if k != "time"} for r in data["validation"]]
  return data


def build(kernel_plan: KernelPlan):
  return train_toys.ToyClickModel(config=SiteConfig(BF16, kernel_plan))


def probe_report(source):
  """A loka.probe/1 report of the toy model: statistics of 3 training batches at init
  (bf16), every candidate evaluated on them (no timings: a CPU report)."""
  model = build(KernelPlan.uniform("xla_bf16"))
  batch = source.train_batch(0, BATCH)
  variables = model.init({"params": jax.random.PRNGKey(0)}, batch)
  abstract = jax.eval_shape(lambda: variables)
  probe = CONFIG.probe
  sites = training.probe_sites(model, abstract, batch, probe)
  collector = training.ProbeCollector(model, source, BATCH, sites, probe,
                                           example_variables=abstract)
  for step in range(3):
    collector.observe(variables, jax.random.PRNGKey(1), step)
  info = {k: {"sort": registry.get(k).sort, "fp8": registry.get(k).fp8, "backend": "xla"}
          for k in CANDIDATES}
  report = report_lib.new_report(
      model="toy", preset="tiny", device="cpu", device_kind="cpu", platform="cpu",
      jax_version=jax.__version__, timing_valid=False, timing_source={"kind": "none"},
      run={"batch_size": BATCH}, probe_config=probe.to_dict(),
      evaluation={"compute_dtype": "bfloat16"}, criteria=Criteria().to_dict(), overhead={},
      kernels=info, excluded_kernels={})
  state = jax.device_get(collector.state)
  for name, site in sites.items():
    report["sites"][name] = reevaluation.site_entry(
        site, collector_lib.site_state(state, sites, name), CANDIDATES, "bfloat16", CONFIG,
        collector.observations, info)
  return report


def train_config(steps):
  return TrainConfig(steps=steps, batch_size=BATCH, log_every=4, checkpoint_every=0,
                     progress=False)


class DriftValveTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.report = probe_report(train_toys.ToySource(seed=3, num_eval=64))
    # Accuracy-only budget: CPU reports carry no timings.
    cls.plan = dispatch.select(cls.report, Criteria(min_speedup=None))
    cls.dir = tempfile.mkdtemp(prefix="loka_valve_")

  def run_valve(self, name, source, steps, log=lambda _: None):
    workdir = os.path.join(self.dir, name)
    valve = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                 CONFIG, log=log)
    final = train(valve.model, source, workdir, train_config(steps), model_hook=valve)
    return valve, final, read_metrics(os.path.join(workdir, "metrics.jsonl")), workdir

  def test_plan_starts_in_fp8(self):
    self.assertIn(self.plan["sites"]["hidden"]["fwd"]["kernel"],
                  ("xla_fp8_tensorwise", "xla_fp8_rowwise"))

  def test_fires_on_a_dense_scale_jump_switches_once_and_resumes_with_it(self):
    source = ShiftedSource(SHIFT_AT, 1000.0, seed=3, num_eval=64)
    compiled_before = set(loop_lib._STEP_CACHE)
    # Stop right after the first refresh past the shift: later refreshes may rightly switch
    # again as training reacts to the shift, which the resumed run below allows.
    lines = []
    valve, final, metrics, workdir = self.run_valve("shift", source, steps=9, log=lines.append)
    self.assertTrue(np.isfinite(final["logloss"]))
    # Said before the re-evaluation starts, naming the drifted FP8 sites.
    started = [l for l in lines if "re-evaluating" in l]
    self.assertLen(started, 1)
    self.assertRegex(started[0], r"^\[drift\] step 8: \d+ FP8 site\(s\) drifted; "
                     r"re-evaluating their kernels: .*hidden")
    self.assertTrue(all(np.isfinite(r["loss"]) for r in metrics if "loss" in r))
    switches = [r for r in metrics if r.get("event") == valve_lib.SWITCH_EVENT]
    self.assertNotEmpty(switches)
    # Nothing before the shift; everything at the first refresh after it (one new plan).
    self.assertEqual({r["step"] for r in switches}, {8})
    hidden = [r for r in switches if r["site"] == "hidden" and r["pass"] == "fwd"]
    self.assertLen(hidden, 1)
    self.assertEqual(hidden[0]["from"], self.plan["sites"]["hidden"]["fwd"]["kernel"])
    self.assertNotEqual(hidden[0]["to"], hidden[0]["from"])
    self.assertRegex(hidden[0]["reason"], r"lhs\.(spread|crest)_log2")
    self.assertIn("drift:", hidden[0]["reason"])
    # The train step compiled for the first plan and once more for the switched one.
    saved = dispatch.read_plan(os.path.join(workdir, valve_lib.ACTIVE_PLAN))
    models = {build(dispatch.to_kernel_plan(p)) for p in (self.plan, saved)}
    self.assertLen(models, 2)
    self.assertEqual({key[0] for key in set(loop_lib._STEP_CACHE) - compiled_before},
                     models - {key[0] for key in compiled_before})
    self.assertTrue(models <= {key[0] for key in loop_lib._STEP_CACHE})
    self.assertEqual(saved["sites"]["hidden"]["fwd"]["kernel"], hidden[0]["to"])
    self.assertEqual([v["step"] for v in saved["validation"] if v["site"] == "hidden"][:1],
                     ["drift"])
    self.assertEqual(valve.overhead()["refreshes"], 2)
    # Resume: a new valve on the run directory starts from the checkpoint's switched plan.
    again = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                 CONFIG, log=lambda _: None)
    self.assertEqual(again.plan["sites"], saved["sites"])
    final = train(again.model, source, workdir, train_config(16), model_hook=again)
    self.assertEqual(final["steps"], 16)
    self.assertTrue(np.isfinite(final["logloss"]))
    self.assertEqual([e for e in again.events if e["step"] <= 9],
                     [r for r in metrics if "event" in r])

  def test_does_not_fire_without_a_shift(self):
    source = train_toys.ToySource(seed=3, num_eval=64)
    valve, final, metrics, workdir = self.run_valve("steady", source, steps=12)
    self.assertTrue(np.isfinite(final["logloss"]))
    self.assertEqual([r for r in metrics if "event" in r], [])
    overhead = valve.overhead()
    self.assertEqual({k: overhead[k] for k in ("refreshes", "seconds", "switches",
                                               "next_refresh")},
                     {"refreshes": 3, "seconds": valve.seconds, "switches": 0,
                      "next_refresh": None})
    self.assertEqual(len(valve.seconds), 3)
    self.assertGreater(overhead["stepping_s"], 0.0)
    self.assertGreater(overhead["share"], 0.0)
    self.assertLess(overhead["share"], 1.0)
    # Without the first refresh (it compiles): the later two over themselves and the steps.
    later = valve.seconds[1] + valve.seconds[2]
    self.assertAlmostEqual(overhead["share_after_first"],
                           later / (later + overhead["stepping_s"]))
    self.assertLess(overhead["share_after_first"], overhead["share"])
    self.assertEqual(valve.plan["sites"], self.plan["sites"])
    self.assertFalse(os.path.exists(os.path.join(workdir, valve_lib.ACTIVE_PLAN)))

  def test_an_overhead_budget_spaces_refreshes_by_their_measured_cost(self):
    # A refresh (statistics pass and checks) costs far more than a toy step: under a budget
    # of 1% the third refresh waits until refreshes average at most 1% of the steps' time.
    source = train_toys.ToySource(seed=3, num_eval=64)
    workdir = os.path.join(self.dir, "budget")
    config = dataclasses.replace(CONFIG, max_overhead=0.01)
    valve = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                 config, log=lambda _: None)
    train(valve.model, source, workdir, train_config(16), model_hook=valve)
    self.assertEqual(valve.refreshes, [4, 8])
    # What the valve knew at step 8: the refresh there and the gaps between steps 1..8.
    refresh, step = valve.seconds[1], np.median(list(valve.step_seconds)[:7])
    self.assertGreater(refresh, 0.01 * 8 * step)   # so a refresh at 12 or 16 would exceed it
    self.assertEqual(valve.next_refresh, 8 + int(np.ceil(refresh / (0.01 * step))))
    # The schedule rides in the checkpoint: a valve resumed there keeps it.
    again = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                 config, log=lambda _: None)
    train(again.model, source, workdir, train_config(20), model_hook=again)
    self.assertEqual(again.next_refresh, valve.next_refresh)
    self.assertEqual(again.refreshes, [4, 8])
    # A resumed process's first refresh (it compiles) sets no budget gap: back to the
    # cadence points until a second one is measured, not a refresh at every step.
    again.seconds = [5.0]
    again._schedule_next(valve.next_refresh)
    self.assertIsNone(again.next_refresh)

  def test_the_pass_compiles_ahead_and_a_refresh_due_before_then_waits_for_it(self):
    # The statistics pass reads as compiling through step 3 and the evaluation functions
    # through step 5: the refresh due at step 4 waits, training goes on, and it runs at step
    # 6 on the executables compiled ahead; then the cadence points again. Without run-ahead,
    # the valve is asked about compiles once a step, after it.
    source = train_toys.ToySource(seed=3, num_eval=64)
    workdir = os.path.join(self.dir, "ahead")
    lines = []
    valve = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                 dataclasses.replace(CONFIG, compile_ahead=True),
                                 log=lines.append)
    ahead_before = executables.counts()["ahead"]
    with mock.patch.object(training.ProbeCollector, "compiling_ahead",
                           new_callable=mock.PropertyMock,
                           side_effect=[True] * 3 + [False] * 20) as compiling, \
        mock.patch.object(executables.Precompiler, "done",
                          side_effect=[False] * 2 + [True] * 20) as evaluations_done:
      train(valve.model, source, workdir,
            dataclasses.replace(train_config(16), run_ahead=False), model_hook=valve)
    self.assertEqual(compiling.call_count, 16)   # asked once a step, from the first
    self.assertEqual(evaluations_done.call_count, 13)   # once the pass is compiled
    self.assertEqual(valve.refreshes, [6, 8, 12, 16])
    self.assertIsNone(valve.deferred_since)
    self.assertEqual([l for l in lines if "still compiling" in l],
                     ["[drift] step 4: a refresh is due; the statistics pass or the evaluation "
                      "functions are still compiling in the background, so it waits for them "
                      "while training goes on"])
    # The refreshes took the functions compiled ahead instead of compiling them inline.
    self.assertGreater(executables.counts()["ahead"], ahead_before)
    overhead = valve.overhead()
    self.assertGreater(overhead["ahead_s"], 0.0)
    spent = sum(valve.seconds) + overhead["ahead_s"]
    self.assertAlmostEqual(overhead["share"], spent / (spent + overhead["stepping_s"]))

  def test_a_reevaluation_takes_the_evaluation_functions_compiled_ahead(self):
    # With compile ahead, the functions of the FP8 sites' re-evaluation compile in the
    # background from the first step: the switch after the shift compiles nothing inline.
    source = ShiftedSource(SHIFT_AT, 1000.0, seed=3, num_eval=64)
    workdir = os.path.join(self.dir, "ahead_shift")
    valve = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                 dataclasses.replace(CONFIG, compile_ahead=True),
                                 log=lambda _: None)
    self.assertIn("hidden", valve.fp8_sites())
    inline_before = executables.counts()["inline"]
    # Both compiles read as done from the first step: the refreshes keep their steps, and a
    # function still compiling is waited for where the re-evaluation calls it.
    with mock.patch.object(training.ProbeCollector, "compiling_ahead",
                           new_callable=mock.PropertyMock, return_value=False), \
        mock.patch.object(executables.Precompiler, "done", return_value=True):
      train(valve.model, source, workdir, train_config(9), model_hook=valve)
    metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    self.assertEqual({r["step"] for r in metrics if r.get("event") == valve_lib.SWITCH_EVENT},
                     {8})
    self.assertEqual(executables.counts()["inline"], inline_before)
    # The swap queued the new plan's evaluations; closing at the end of training leaves no
    # compile queued for the process to wait on at exit.
    pools = list(valve._evaluations)
    self.assertLen(pools, 2)
    valve.close()
    self.assertTrue(all(f.done() for pool in pools for f in pool._futures))

  def test_a_refresh_computes_the_drift_numbers_without_spectra_or_histograms(self):
    # The drift check reads scales, spreads, amax and flush; a refresh leaves out the
    # covariance spectra and histograms (most of its host time) and computes the rest as a
    # report's full statistics do.
    source = ShiftedSource(0, 1000.0, seed=3, num_eval=64)
    valve = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH,
                                 os.path.join(self.dir, "light"), CONFIG, log=lambda _: None)
    state = create_train_state(valve.model, make_optimizer(OptimConfig()),
                               source.train_batch(0, BATCH), 0)
    light, raw = valve.refresh_stats(0, state)
    sites = valve._sites_collector().sites
    keys = collector_lib.state_keys(sites)
    full = {n: stats_report.site_stats(s, raw["sites"][keys[n]], 1) for n, s in sites.items()}
    spectra = ("spectrum", "row_cov_spectrum", "col_cov_spectrum")
    for name, stats in full.items():
      for op in ("lhs", "rhs", "grad"):
        detailed = stats[op]
        self.assertTrue(any(detailed.get(k) for k in spectra), (name, op))
        self.assertNotIn("histogram", light[name][op])
        for key in spectra:
          if key in detailed:
            self.assertEqual(light[name][op][key], [])
        left_out = (*spectra, "histogram", "top_eigen_fraction")
        self.assertEqual({k: v for k, v in light[name][op].items() if k not in left_out},
                         {k: v for k, v in detailed.items() if k not in left_out})
    # The same verdicts (the source's shift fires them).
    by_light = dispatch.drift.drifted_sites(self.report, light, CONFIG.bound)
    by_full = dispatch.drift.drifted_sites(self.report, full, CONFIG.bound)
    self.assertTrue(any(d.shifted for d in by_full.values()))
    self.assertEqual({n: d.to_dict() for n, d in by_light.items()},
                     {n: d.to_dict() for n, d in by_full.items()})

  def test_a_shifted_site_in_bf16_on_every_pass_is_not_reevaluated(self):
    # bf16 is every site's fallback: a drift cannot make it unsafe, so the valve records the
    # drift and evaluates nothing.
    plan = self.plan
    for name, site in self.plan["sites"].items():
      if any(site[p]["kernel"] != "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")):
        plan = dispatch.back_off(plan, name, None, "this test runs it in bf16", step="test")
    source = ShiftedSource(SHIFT_AT, 1000.0, seed=3, num_eval=64)
    workdir = os.path.join(self.dir, "bf16_shift")
    lines = []
    valve = valve_lib.DriftValve(build, plan, self.report, source, BATCH, workdir, CONFIG,
                                 log=lines.append)
    self.assertEqual(valve.fp8_sites(), [])
    with mock.patch.object(valve_lib.evaluate, "evaluate_site",
                           wraps=valve_lib.evaluate.evaluate_site) as evaluated:
      train(valve.model, source, workdir, train_config(9), model_hook=valve)
    evaluated.assert_not_called()
    metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    self.assertEqual([r for r in metrics if r.get("event") == valve_lib.SWITCH_EVENT], [])
    kept = [r for r in metrics if r.get("event") == valve_lib.KEPT_EVENT]
    self.assertIn("hidden", {r["site"] for r in kept})
    self.assertEqual({r["step"] for r in kept}, {8})
    for r in kept:
      self.assertTrue(r["reason"].endswith("; every pass runs xla_bf16: nothing to re-evaluate"),
                      r["reason"])
    self.assertRegex([r for r in kept if r["site"] == "hidden"][0]["reason"],
                     r"^lhs\.(spread|crest)_log2")
    self.assertEqual(valve.plan["sites"], plan["sites"])
    self.assertIn("[drift] step 8: hidden drifted; every pass runs xla_bf16: nothing to "
                  "re-evaluate", lines)
    self.assertFalse([l for l in lines if "still safe" in l])

  def _refresh_at_init(self, plan, factor, name):
    """The valve on `plan` and the statistics of one refresh of its initial state on
    training data scaled by `factor`: (valve, {shifted FP8 site: drift}, raw statistics)."""
    source = ShiftedSource(0, factor, seed=3, num_eval=64)
    valve = valve_lib.DriftValve(build, plan, self.report, source, BATCH,
                                 os.path.join(self.dir, name), CONFIG, log=lambda _: None)
    state = create_train_state(valve.model, make_optimizer(OptimConfig()),
                               source.train_batch(0, BATCH), 0)
    stats, raw = valve.refresh_stats(0, state)
    drifts = dispatch.drift.drifted_sites(valve.baselines, stats, CONFIG.bound)
    shifted = {n: d for n, d in drifts.items() if d.shifted and n in valve.fp8_sites()}
    return valve, shifted, raw

  def _every_candidate(self, valve, shifted, raw):
    """What a re-evaluation of every candidate at every shifted site selects."""
    sites = valve._collector.sites
    keys = collector_lib.state_keys(sites)
    report = dict(self.report, sites=dict(self.report["sites"]))
    for name in shifted:
      report["sites"][name] = reevaluation.reevaluated_entry(
          self.report, name, sites[name], raw["sites"][keys[name]], CONFIG)
    return dispatch.drift.reselect_drifted(valve.plan, report, shifted, valve.criteria,
                                           budget_per_site=valve.per_site or None)

  def _evaluated(self, valve, shifted, raw):
    """(valve.reselect's result, [(site, kernels evaluated)] in call order)."""
    with mock.patch.object(valve_lib.evaluate, "evaluate_site",
                           wraps=valve_lib.evaluate.evaluate_site) as evaluated:
      result = valve.reselect(0, shifted, raw)
    return result, [(c.args[0].name, sorted(k.name for k in c.args[2]))
                    for c in evaluated.call_args_list]

  def test_a_drifted_site_whose_kernels_stay_safe_evaluates_only_those(self):
    # `hidden` runs xla_fp8_rowwise (and bf16 on grad_rhs); a 30x scale shifts it but its
    # kernels stay safe: xla_fp8_tensorwise, a candidate it does not run, is not evaluated,
    # and the outcome is what evaluating every candidate gives.
    plan = dispatch.back_off(self.plan, "hidden", "grad_rhs", "this test", step="test")
    self.assertEqual({plan["sites"]["hidden"][p]["kernel"] for p in ("fwd", "grad_lhs")},
                     {"xla_fp8_rowwise"})
    valve, shifted, raw = self._refresh_at_init(plan, 30.0, "safe_subset")
    self.assertIn("hidden", shifted)
    (new_plan, steps), calls = self._evaluated(valve, shifted, raw)
    self.assertIn(("hidden", ["xla_bf16", "xla_fp8_rowwise"]), calls)
    self.assertNotIn("xla_fp8_tensorwise", {k for _, ks in calls for k in ks})
    self.assertFalse(any(s["switched"] for s in steps))
    full_plan, full_steps = self._every_candidate(valve, shifted, raw)
    self.assertEqual(_untimed(new_plan), _untimed(full_plan))
    self.assertEqual(steps, full_steps)

  def test_a_site_that_must_switch_evaluates_every_candidate_to_choose_again(self):
    # A 1000x scale makes both sites' FP8 kernels unsafe: each is evaluated on the kernels
    # it runs, then on every candidate, and the switch is the one a full evaluation makes.
    plan = dispatch.back_off(self.plan, "hidden", "grad_rhs", "this test", step="test")
    lines = []
    valve, shifted, raw = self._refresh_at_init(plan, 1000.0, "switch_subset")
    valve.log = lines.append
    self.assertIn("hidden", shifted)
    (new_plan, steps), calls = self._evaluated(valve, shifted, raw)
    switched = [s["site"] for s in steps if s["switched"]]
    self.assertIn("hidden", switched)
    hidden = [ks for name, ks in calls if name == "hidden"]
    self.assertEqual(hidden, [["xla_bf16", "xla_fp8_rowwise"], list(CANDIDATES_SORTED)])
    self.assertRegex(lines[-1], r"^\[drift\] step 0: \d site\(s\) run a kernel no longer "
                     r"safe; evaluating every candidate to choose again: .*hidden")
    full_plan, full_steps = self._every_candidate(valve, shifted, raw)
    self.assertEqual(_untimed(new_plan), _untimed(full_plan))
    self.assertEqual(steps, full_steps)

  def test_a_refresh_waits_only_for_the_compiles_of_the_kernels_the_plan_runs(self):
    # The running kernels' evaluation functions are queued first; the other candidates'
    # (here xla_fp8_tensorwise at `hidden`) after them, and no refresh waits for those.
    plan = dispatch.back_off(self.plan, "hidden", "grad_rhs", "this test", step="test")
    source = train_toys.ToySource(seed=3, num_eval=64)
    valve = valve_lib.DriftValve(build, plan, self.report, source, BATCH,
                                 os.path.join(self.dir, "ahead_first"),
                                 dataclasses.replace(CONFIG, compile_ahead=True),
                                 log=lambda _: None)
    state = create_train_state(valve.model, make_optimizer(OptimConfig()),
                               source.train_batch(0, BATCH), 0)
    executables.clear()   # compiled by an earlier test, a job is not queued again
    try:
      valve._pass_compiling(state)
      pool, first = valve._evaluations[0], valve._evaluations_first[0]
      self.assertGreater(first, 0)
      self.assertGreater(pool.queued, first)
      for f in pool._futures[:first]:
        f.result()
      self.assertTrue(pool.done(first=first))
    finally:
      valve.close()

  def test_the_loop_runs_ahead_of_the_steps_the_valve_does_not_read(self):
    # Refreshes at 4 and 8 (the shift fires a switch at 8): the valve reads the state after
    # those, the loop the last (evaluated); after every other step the valve is called with
    # the next step's state, dispatched ahead. The run's lines, events and plan are those of
    # a run that never runs ahead.
    source = ShiftedSource(SHIFT_AT, 1000.0, seed=3, num_eval=64)
    out = {}
    for ahead in (False, True):
      workdir = os.path.join(self.dir, f"valve_ahead_{ahead}")
      valve = valve_lib.DriftValve(build, self.plan, self.report, source, BATCH, workdir,
                                   CONFIG, log=lambda _: None)
      seen = []
      after_step = valve.after_step

      def recording(step, state, step_metrics=None, after_step=after_step, seen=seen):
        seen.append((step, int(state.step)))
        return after_step(step, state, step_metrics)

      valve.after_step = recording
      train(valve.model, source, workdir,
            dataclasses.replace(train_config(9), run_ahead=ahead), model_hook=valve)
      lines = [{k: v for k, v in r.items() if k not in run_files.WALL_CLOCK_FIELDS}
               for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]
      out[ahead] = (seen, lines, valve.refreshes, _untimed(valve.plan))
    self.assertEqual(out[False][0], [(s, s) for s in range(1, 10)])
    self.assertEqual(out[True][0], [(s, s if s in (1, 4, 8, 9) else s + 1)
                                    for s in range(1, 10)])
    self.assertEqual(out[True][2], [4, 8])
    self.assertIn(valve_lib.SWITCH_EVENT, {r.get("event") for r in out[True][1]})
    self.assertEqual(out[True][1:], out[False][1:])


class TrainRunValveTest(chex.TestCase):
  """The path `experiments.train --config.run.precision=loka --config.run.plan=P
  --config.drift.every=N` takes."""

  def test_a_preset_run_carries_the_valve_and_a_plan_without_report_is_refused(self):
    from loka_jax.dispatch import pipeline
    from loka_jax.probe import ProbeConfig, ProbeOptions
    from loka_jax.train import experiment
    root = tempfile.mkdtemp(prefix="loka_valve_run_")
    spec = experiment.RunSpec(model="dlrm", preset="tiny", mods=("all",), num_eval=256)
    probe_train = TrainConfig(steps=6, batch_size=64, progress=False, log_every=0)
    result = pipeline.probe_and_plan(
        spec, os.path.join(root, "plan"), train_config=probe_train,
        probe_config=ProbeConfig(cadence=3),
        probe_options=ProbeOptions(samples=2, kernels=("xla_bf16", "xla_fp8_rowwise"),
                                   sites="top_mlp/dense_0", bootstrap=20,
                                   plots=False),
        criteria=Criteria(min_speedup=None), validation=None)
    run_spec = experiment.RunSpec(model="dlrm", preset="tiny", mods=("all",), num_eval=256,
                                  precision="loka", plan=result.paths["plan"], drift_every=3,
                                  drift_compile_ahead=False)
    # The command line takes the valve's settings (no budget, no compile ahead): it refreshes
    # at steps 3 and 6, says what they cost, and the run's config.json records the settings.
    # `experiments.train` runs `valve_lib.run`: its final metrics are the command's stdout.
    cli_dir = os.path.join(root, "cli")
    run = run_module("experiments.train", "--config.run.model=dlrm",
                     "--config.run.preset=tiny", "--config.run.mods=all",
                     "--config.run.precision=loka", f"--config.run.plan={result.paths['plan']}",
                     "--config.drift.every=3", "--config.drift.max_overhead=0",
                     "--config.drift.compile_ahead=false", "--config.run.steps=6",
                     "--config.run.batch_size=64", "--config.run.num_eval=256",
                     "--config.train.log_every=3", f"--workdir={cli_dir}", timeout=300)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    final = json.loads(run.stdout)
    self.assertEqual(final["steps"], 6)
    self.assertTrue(np.isfinite(final["logloss"]))
    self.assertRegex(run.stderr, r"\[drift\] 2 refreshes in this process \([0-9.]+ s; the "
                     r"first [0-9.]+ s\), [0-9]+ switches: [0-9.]+% of its training time")
    with open(os.path.join(cli_dir, "config.json")) as f:
      run_info = json.load(f)["run"]
    self.assertEqual((run_info["drift_max_overhead"], run_info["drift_compile_ahead"]),
                     (0.0, False))
    # The final metrics say what the refreshes (at steps 3 and 6) cost.
    self.assertEqual(final["drift"]["refreshes"], 2)
    self.assertEqual(len(final["drift"]["seconds"]), 2)
    self.assertGreater(final["drift"]["share"], final["drift"]["share_after_first"])
    # The valve's plan rides in the run's checkpoints (what a resumed run continues with).
    step, saved = valve_lib.checkpoint_plan(cli_dir)
    self.assertEqual(step, 6)
    self.assertEqual(saved.kernel_digest(), result.plan.kernel_digest())
    # A plan whose provenance names no report cannot guard anything: refused up front.
    bare = result.plan.to_dict()
    bare["provenance"] = {k: v for k, v in bare["provenance"].items() if k != "report_path"}
    bare_path = os.path.join(root, "bare_plan.json")
    dispatch.save_plan(bare, bare_path)
    with self.assertRaisesRegex(experiment.PlanError, "names no probe report"):
      valve_lib.run(dataclasses.replace(run_spec, plan=bare_path), os.path.join(root, "bad"),
                     TrainConfig(steps=2, batch_size=64, progress=False))
    # A budget outside [0, 1) is refused with the setting it came from.
    with self.assertRaisesRegex(experiment.PlanError,
                                r"drift.max_overhead=2.0: .*must be in \[0, 1\)"):
      valve_lib.run(dataclasses.replace(run_spec, drift_max_overhead=2.0),
                    os.path.join(root, "bad_budget"),
                    TrainConfig(steps=2, batch_size=64, progress=False))


if __name__ == "__main__":
  absltest.main()
