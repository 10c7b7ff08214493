"""Drift valve in training: refresh the probe's statistics at a cadence, re-evaluate the sites
that shifted, and switch the kernels that are no longer safe (recompiling once).

  valve = DriftValve(build, plan, report, source, batch_size, workdir, ValveConfig(cadence=25))
  train(valve.model, source, workdir, train_config, model_hook=valve)

Every `cadence` steps the valve runs the probe's jitted statistics pass on the next training
batch with the current parameters, into fresh statistics (one observation); when refreshes
would take more than `max_overhead` of the training time (2%), it waits longer between them,
from their measured cost and the step's. The statistics pass compiles on background threads
from the first step (`compile_ahead`; autotuning it takes minutes on a GPU) while training
goes on, and a refresh that falls due before it is ready waits for it. Each refresh compares each
site with its *baseline*: the report's statistics the plan was selected on, or the statistics
of the site's last re-evaluation. A site beyond `DriftBound` (drift.py) gets the probe's
evaluation on its fresh statistics (errors only: speed does not drift, so each entry keeps the
report's timing fields), and `drift.reselect_drifted` judges its current kernels under the
plan's own budget (its `provenance.budget`): first only the kernels it runs are evaluated,
and every candidate only where one of those is no longer safe (`DriftValve.reselect`). If
any pass switches, the valve builds the model for the new plan and hands it to the loop as
a `ModelSwap`: the train step recompiles once,
parameters, optimizer and fp8 state carry over, and metrics.jsonl gets one line per switched
pass {"step", "event": "drift_switch", "site", "pass", "from", "to", "reason"} (and one
{"event": "drift_kept"} line per shifted site whose kernels stayed safe).

The active plan is written to WORKDIR/drift_plan.json after each switch and saved in every
checkpoint's extras (`dispatch_plan`, with the baselines and events under `drift_valve`);
a valve built on a run directory whose newest checkpoint holds a switched plan starts from
that plan, so a resumed run continues with it.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np

from loka_jax.dispatch import drift as drift_lib
from loka_jax.dispatch import reevaluation as reeval_lib
from loka_jax.plan.file import FALLBACK, Plan, as_plan, save_plan, to_kernel_plan
from loka_jax.kernels import PASSES
from loka_jax.probe import collector as collector_lib
from loka_jax.probe import training
from loka_jax.probe import evaluate, executables, stats_report
from loka_jax.probe.eligibility import Criteria
from loka_jax.models import SiteConfig, build_model
from loka_jax.probe.report import load_report
from loka_jax.train import experiment
from loka_jax.train.checkpoint import latest_json_extras
from loka_jax.train.experiment import PlanError  # what experiments.train reports cleanly
from loka_jax.train.loop import ModelSwap

PLAN_KEY = "dispatch_plan"     # checkpoint extras: the active plan (JSON)
STATE_KEY = "drift_valve"      # checkpoint extras: baselines, events, refresh steps (JSON)
ACTIVE_PLAN = "drift_plan.json"
SWITCH_EVENT = "drift_switch"
KEPT_EVENT = "drift_kept"
# A drifted site in bf16 on every pass: the fallback itself, which no drift makes unsafe.
NOTHING_TO_REEVALUATE = f"every pass runs {FALLBACK}: nothing to re-evaluate"


class ValveSetupError(ValueError):
  """A valve whose plan, report or model do not fit together."""


@dataclasses.dataclass(frozen=True)
class ValveConfig:
  """When the valve looks and how it re-evaluates a shifted site."""
  cadence: int = 25                          # steps between statistics refreshes, at least
  # The most training time refreshes may take (a fraction): past it, a refresh waits longer
  # than `cadence` (`collector.budgeted_gap`, from the measured refresh and step times). 0:
  # every `cadence` steps, whatever they cost.
  max_overhead: float = 0.02
  # Compile the statistics pass on background threads from the first step, and put off a
  # refresh due before that compile ends to the first step after it, so training never stalls
  # on it. False: the first refresh compiles it, the loop waiting.
  compile_ahead: bool = True
  bound: drift_lib.DriftBound = drift_lib.DriftBound()
  criteria: Optional[Criteria] = None        # None: the plan's own budget (provenance)
  samples: int = 32                          # evaluation draws per source and site
  bootstrap: int = 200                       # bootstrap resamples of each error CI
  probe: collector_lib.ProbeConfig = collector_lib.ProbeConfig(min_observations=1)
  seed: int = 0

  def __post_init__(self):
    if self.cadence < 1:
      raise ValueError(f"drift valve cadence must be >= 1 step, got {self.cadence}")
    if not 0.0 <= self.max_overhead < 1.0:
      raise ValueError(f"drift valve max_overhead must be in [0, 1), got {self.max_overhead}")
    if self.samples < 2:
      raise ValueError(f"drift valve samples must be >= 2, got {self.samples}")

  def to_dict(self) -> Dict[str, Any]:
    out = dataclasses.asdict(self)
    out["criteria"] = None if self.criteria is None else self.criteria.to_dict()
    return out


def checkpoint_plan(workdir: str) -> Optional[Tuple[int, Plan]]:
  """(step, plan) saved in the newest checkpoint of the run in `workdir`, or None (no
  checkpoint, or one saved without a valve)."""
  directory = os.path.join(workdir, "checkpoints")
  latest = latest_json_extras(directory)
  if latest is None:
    return None
  step, extras = latest
  data = extras.get(PLAN_KEY)
  return None if data is None else (step, as_plan(data, f"{directory}/{step}: {PLAN_KEY}"))


def plan_budget(plan: Plan) -> Tuple[Criteria, List[Tuple[str, Criteria]]]:
  """(global criteria, per-site overrides) the plan was selected with (its provenance)."""
  budget = (plan.get("provenance") or {}).get("budget") or {}
  fields = {f.name for f in dataclasses.fields(Criteria)}
  make = lambda d: Criteria(**{k: v for k, v in (d or {}).items() if k in fields})
  per_site = [(item["pattern"], make(item["criteria"])) for item in budget.get("per_site", [])]
  return make(budget.get("default")), per_site


def _without_histograms(stats: Mapping) -> Dict:
  """A site's stats without the histograms (the baselines travel in checkpoint JSON)."""
  return {k: ({kk: vv for kk, vv in v.items() if kk != "histogram"} if isinstance(v, Mapping)
              else v) for k, v in stats.items()}


class DriftValve:
  """The training loop's model hook (loop.ModelHook) that runs the drift valve."""

  def __init__(self, build: Callable[[Any], Any], plan, report: Mapping, source,
               batch_size: int, workdir: str, config: ValveConfig = ValveConfig(), *,
               timing_table=None, log: Callable[[str], None] = print):
    """
    Args:
      build: kernel plan (a KernelPlan) -> the model to train with it.
      plan: the plan selected on `report` (Plan, its JSON or a path).
      report: the ProbeReport the plan was selected on (its stats are the first baselines,
        its timings and kernel metadata serve every re-evaluation).
      source, batch_size: the training data (refreshes observe training batches).
      workdir: the run directory (the active plan is written there).
      config: cadence, drift bound, budget and evaluation size.
      timing_table: the timing table selection used, when the report's timings were invalid
        (default: the plan's provenance).
    """
    self.build = build
    self.report = report
    self.source = source
    self.batch_size = batch_size
    self.workdir = workdir
    self.config = config
    self.log = log
    self.plan = as_plan(plan)
    saved = checkpoint_plan(workdir)
    if saved is not None:  # a resumed run continues with the plan its checkpoint holds
      self.plan = saved[1]
    missing = sorted(set(self.plan["sites"]) - set(report["sites"]))
    if missing:
      raise ValveSetupError(f"drift valve: plan site(s) {missing[:6]} are not in the probe "
                            "report; give the report the plan was selected on")
    if config.criteria is not None:
      self.criteria, self.per_site = config.criteria, []
    else:
      self.criteria, self.per_site = plan_budget(self.plan)
    timing = (self.plan.get("provenance") or {}).get("timing_source") or {}
    self.timing_table = timing_table or (timing.get("path") if timing.get("kind") == "table"
                                         else None)
    self.baselines: Dict[str, Dict] = {n: _without_histograms(s.get("stats") or {})
                                       for n, s in report["sites"].items()}
    self.events: List[Dict[str, Any]] = []
    self.refreshes: List[int] = []
    self.seconds: List[float] = []
    # Wall-clock seconds between the loop's calls, refreshes left out (the latest thousand).
    self.step_seconds: "collections.deque[float]" = collections.deque(maxlen=1000)
    self.stepping_s = 0.0   # their sum over this process
    self.next_refresh: Optional[int] = None   # set by the overhead budget; None: cadence
    self._last_return: Optional[float] = None
    self.model = build(to_kernel_plan(self.plan))
    self._collector = None
    self._ahead_for = None   # the collector whose pass compiles ahead (a swap makes another)
    self.deferred_since: Optional[int] = None   # a due refresh waiting for that compile
    self.ahead_s = 0.0   # the loop's seconds in starting it (building the pass, tracing)
    self._evaluations: List[executables.Precompiler] = []   # re-evaluations' compiles
    # Per pool, how many of its compiles (queued first) a refresh waits for: the kernels the
    # plan runs, which every re-evaluation checks; the other candidates compile after them.
    self._evaluations_first: List[int] = []
    self._reads: Dict[int, bool] = {}   # reads_state's answers, until after_step takes them

  # ---------------------------------------------------------------- ModelHook

  def extras(self) -> Dict[str, Any]:
    return {PLAN_KEY: self.plan.to_dict(),
            STATE_KEY: {"baselines": self.baselines, "events": self.events,
                        "refreshes": self.refreshes, "next_refresh": self.next_refresh,
                        "config": self.config.to_dict()}}

  def on_restore(self, step: int, extras: Mapping[str, Any]) -> None:
    saved = extras.get(PLAN_KEY)
    if saved is not None and as_plan(saved).to_dict()["sites"] != self.plan["sites"]:
      raise ValveSetupError(
          f"{self.workdir}: the checkpoint of step {step} was trained with another plan than "
          "the valve's (its newest checkpoint was unreadable and an older one, from before a "
          "drift switch, was restored); rerun to resume from that checkpoint's plan")
    state = extras.get(STATE_KEY) or {}
    self.baselines.update(state.get("baselines") or {})
    self.events = [e for e in state.get("events", []) if e.get("step", 0) <= step]
    self.refreshes = [s for s in state.get("refreshes", []) if s <= step]
    self.next_refresh = state.get("next_refresh")

  def _due(self, step: int) -> bool:
    """Whether a refresh is due after `step`: one waiting for its compiles, else the next
    cadence point or the step the overhead budget set."""
    return self.deferred_since is not None or (
        step % self.config.cadence == 0 if self.next_refresh is None
        else step >= self.next_refresh)

  def reads_state(self, step: int) -> bool:
    """Whether `after_step(step)` reads the training state (loop.ModelHook): at the call
    that starts the compiles ahead from the state's shapes (the first, and the first after a
    swap), and at a refresh that is due and whose compiles are done. The loop runs ahead of
    every other step. The answer binds `after_step(step)`: a refresh whose compiles end in
    between waits a step."""
    if self.config.compile_ahead and (self._collector is None
                                      or self._ahead_for is not self._collector):
      reads = True   # the compiles ahead start from this call (after a swap: the new model's)
    else:
      reads = self._due(step) and not (self.config.compile_ahead and self._compiling())
    self._reads[step] = reads
    return reads

  def after_step(self, step: int, state, step_metrics=None) -> Optional[ModelSwap]:
    del step_metrics
    now = time.perf_counter()
    if self._last_return is not None:
      self.step_seconds.append(now - self._last_return)
      self.stepping_s += now - self._last_return
    self._last_return = now
    due = self._due(step)
    # False: the loop ran ahead on this step's word that no state would be read.
    may_read = self._reads.pop(step, True)
    compiling = False
    if self.config.compile_ahead:
      compiling = self._pass_compiling(state) or not may_read
      self._last_return = time.perf_counter()
      self.ahead_s += self._last_return - now
    if compiling:
      if due and self.deferred_since is None:
        self.deferred_since = step
        self.log(f"[drift] step {step}: a refresh is due; the statistics pass or the "
                 "evaluation functions are still compiling in the background, so it waits "
                 "for them while training goes on")
      return None
    if not due:
      return None
    self.deferred_since = None
    try:
      return self._refresh(step, state)
    finally:
      self._last_return = time.perf_counter()
      self.seconds.append(self._last_return - now)
      self._schedule_next(step)

  def _schedule_next(self, step: int) -> None:
    """The step of the next refresh under the overhead budget: from the median refresh
    after the first of this process (which compiles) and the median step; until both are
    measured (a fresh or resumed process), the next cadence point."""
    if not self.config.max_overhead:
      return
    if len(self.seconds) < 2 or not self.step_seconds:
      self.next_refresh = None
      return
    gap = collector_lib.budgeted_gap(self.config.cadence, float(np.median(self.seconds[1:])),
                                     float(np.median(self.step_seconds)),
                                     self.config.max_overhead)
    self.next_refresh = int(step) + gap

  def _pass_compiling(self, state) -> bool:
    """Starts compiling the current model's statistics pass and its FP8 sites' evaluation
    functions ahead (once per model, from the training state of the step just taken);
    whether any of those compiles is still running. A refresh waits for both: a shifted
    site's re-evaluation would otherwise wait inline for its functions, which under a cold
    cache can take minutes for a `large` model's sites."""
    collector = self._sites_collector()
    if self._ahead_for is not collector:
      self._ahead_for = collector
      workers = max(1, executables.default_workers() // 2)
      # Shapes, not the arrays: the next step donates this state's buffers while the compile
      # threads may still be lowering the pass for it.
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=getattr(x, "sharding", None),
          weak_type=getattr(x, "weak_type", False)), state)
      collector.try_compile_ahead(shapes, workers)
      self._compile_evaluations_ahead(collector, workers)
    return self._compiling()

  def _compiling(self) -> bool:
    """Whether the current model's compiles a refresh waits for are still running (true
    before they were started)."""
    if self._ahead_for is not self._collector or self._collector is None:
      return True
    return self._collector.compiling_ahead or not all(
        pool.done(first=n) for pool, n in zip(self._evaluations, self._evaluations_first))

  def close(self) -> None:
    """Drops the compiles still queued ahead (running ones finish): at the end of training,
    so the process does not wait at exit for functions no refresh will call."""
    for pool in [*self._evaluations, self._collector]:
      if pool is not None:
        pool.close()
    self._evaluations, self._evaluations_first = [], []

  def fp8_sites(self) -> List[str]:
    """The active plan's sites with a pass in another kernel than xla_bf16: the only ones a
    drift can make unsafe (bf16 is every site's fallback)."""
    return [n for n, site in self.plan["sites"].items()
            if any(site[p]["kernel"] != FALLBACK for p in PASSES)]

  def running_kernels(self, name: str) -> List[str]:
    """The kernels the active plan runs at site `name`, and the bf16 fallback: what a
    re-evaluation checks first (the safety verdicts of the kernels a site runs)."""
    return sorted({self.plan["sites"][name][p]["kernel"] for p in PASSES} | {FALLBACK})

  def _compile_evaluations_ahead(self, collector, workers: int) -> None:
    """Queues the evaluation functions a re-evaluation of each FP8 site would compile, on a
    pool of their own (the statistics pass's pool closes at its first call), so a refresh
    that finds such a site shifted does not stop training for their compiles: first those
    of the kernels the plan runs (a refresh waits for these), then the other candidates',
    which only a site that must switch evaluates. After a swap the new plan's jobs join
    what is compiled or queued already (equal jobs compile once). Only a speed-up: a
    failure leaves them to compile when first called, which reports the error."""
    for pool in self._evaluations:   # an earlier plan's: what it queued still compiles
      pool.finish_in_background()
    try:
      stages: Tuple[List, List] = ([], [])
      for name in self.fp8_sites():
        if name not in collector.sites:
          continue
        running = self.running_kernels(name)
        candidates = reeval_lib.candidates(self.report, name)
        for jobs, kernels in zip(stages, ([k for k in candidates if k in running],
                                          [k for k in candidates if k not in running])):
          if kernels:
            jobs += evaluate.compile_jobs(
                collector.sites[name],
                collector_lib.site_state(collector.state, collector.sites, name),
                reeval_lib.registered(kernels), reeval_lib.compute_dtype(self.report),
                reeval_lib.eval_config(self.config))
      pool = executables.Precompiler(workers)
      self._evaluations.append(pool)
      self._evaluations_first.append(pool.queued)
      pool.submit(stages[0])
      self._evaluations_first[-1] = pool.queued
      pool.submit(stages[1])
    except Exception as e:  # noqa: BLE001 - compiling ahead is an optimization only
      self.log(f"[drift] the evaluation functions were not compiled ahead ({type(e).__name__}: "
               f"{str(e)[:200]}); a re-evaluation compiles them when it needs them")

  # ---------------------------------------------------------------- the refresh

  def _sites_collector(self):
    """The probe's statistics pass for the current model (rebuilt after a swap)."""
    if self._collector is None:
      batch = self.source.train_batch(0, self.batch_size)
      abstract = jax.eval_shape(
          lambda b: self.model.init({"params": jax.random.PRNGKey(0),
                                     "dropout": jax.random.PRNGKey(1)}, b, train=False), batch)
      sites = training.probe_sites(self.model, abstract, batch, self.config.probe)
      sites = {n: s for n, s in sites.items() if n in self.report["sites"]}
      self._collector = training.ProbeCollector(
          self.model, self.source, self.batch_size, sites, self.config.probe,
          example_variables=abstract)
    return self._collector

  def refresh_stats(self, step: int, state) -> Tuple[Dict[str, Dict], Any]:
    """({site: stats}, raw statistics) of one fresh observation of training batch `step`."""
    collector = self._sites_collector()
    fresh = collector_lib.init_state(collector.sites, self.config.probe,
                                     _reservoir_dtype(collector.state))
    collector.extras[training.STATS_KEY] = jax.device_put(fresh, jax.devices()[0])
    collector.meta["steps"] = []
    collector.observe(state.variables(), state.rng, step)
    raw = jax.device_get(collector.state)
    keys = collector_lib.state_keys(collector.sites)
    stats = {n: stats_report.site_stats(s, raw["sites"][keys[n]], 1, detail=False)
             for n, s in collector.sites.items()}
    return stats, raw

  def _refresh(self, step: int, state) -> Optional[ModelSwap]:
    self.refreshes.append(step)
    stats, raw = self.refresh_stats(step, state)
    drifts = drift_lib.drifted_sites(self.baselines, stats, self.config.bound)
    shifted = {n: d for n, d in drifts.items() if d.shifted}
    if not shifted:
      return None
    # A site in bf16 on every pass has nothing a drift could make unsafe: not re-evaluated.
    fp8 = set(self.fp8_sites())
    bf16_only = sorted(n for n in shifted if n not in fp8)
    shifted = {n: d for n, d in shifted.items() if n in fp8}
    if shifted:   # said before it starts: it evaluates the kernels each site runs
      self.log(f"[drift] step {step}: {len(shifted)} FP8 site(s) drifted; re-evaluating their "
               f"kernels: {', '.join(sorted(shifted)[:6])}{' ...' if len(shifted) > 6 else ''}")
    new_plan, steps = self.reselect(step, shifted, raw) if shifted else (self.plan, [])
    for name in [*shifted, *bf16_only]:  # judged (or nothing to judge) on these statistics
      self.baselines[name] = _without_histograms(stats[name])
    records = [{"step": step, "event": KEPT_EVENT, "site": name,
                "reason": f"{'; '.join(drifts[name].reasons)}; {NOTHING_TO_REEVALUATE}"}
               for name in bf16_only]
    for s in steps:
      reason = "; ".join(s.get("reasons", []))
      if s.get("switched"):
        for p, (old, new) in s["switched"].items():
          why = new_plan["sites"][s["site"]][p]["reason"]
          records.append({"step": step, "event": SWITCH_EVENT, "site": s["site"], "pass": p,
                          "from": old, "to": new, "reason": f"{reason}; {why}"})
      else:
        records.append({"step": step, "event": KEPT_EVENT, "site": s["site"],
                        "reason": f"{reason}; {s.get('action')}"})
    self.events.extend(records)
    for r in records:
      self.log(f"[drift] step {step}: {r['site']} " + (
          f"{r['pass']} {r['from']} -> {r['to']}" if r["event"] == SWITCH_EVENT
          else f"drifted; {NOTHING_TO_REEVALUATE}" if r["site"] in bf16_only
          else "kernels still safe: kept"))
    self.plan = new_plan  # with the validation record of the re-evaluation
    if not any(s.get("switched") for s in steps):
      return ModelSwap(None, tuple(records))  # nothing to recompile: the records only
    save_plan(self.plan, os.path.join(self.workdir, ACTIVE_PLAN))
    self.model = self.build(to_kernel_plan(self.plan))
    self._collector = None  # the statistics pass follows the new model
    return ModelSwap(self.model, tuple(records))

  def reselect(self, step: int, shifted: Mapping[str, drift_lib.SiteDrift], raw
               ) -> Tuple[Plan, List[Dict]]:
    """(new plan, drift steps) of the `shifted` FP8 sites on fresh statistics `raw`, in two
    stages: the kernels each site runs (and bf16) are evaluated and judged first, and only a
    site where one is no longer safe evaluates every candidate to choose its new kernels.
    The result is the same as evaluating every candidate everywhere (each kernel's errors
    and bootstrap do not depend on the others evaluated beside it); a `large` model's
    refresh that finds most sites drifted but safe evaluates a fraction of the kernels."""
    collector = self._collector
    keys = collector_lib.state_keys(collector.sites)
    new_report = copy.deepcopy(dict(self.report))

    def evaluate_sites(names, kernels_of):
      for name in names:
        new_report["sites"][name] = reeval_lib.reevaluated_entry(
            self.report, name, collector.sites[name], raw["sites"][keys[name]], self.config,
            kernels_of(name))

    def judge():
      return drift_lib.reselect_drifted(
          self.plan, new_report, shifted, self.criteria, budget_per_site=self.per_site or None,
          timing_table=self.timing_table)

    evaluate_sites(shifted, self.running_kernels)
    new_plan, steps = judge()
    switching = [s["site"] for s in steps if s.get("switched")]
    if not switching:
      return new_plan, steps
    self.log(f"[drift] step {step}: {len(switching)} site(s) run a kernel no longer safe; "
             f"evaluating every candidate to choose again: {', '.join(switching[:6])}"
             f"{' ...' if len(switching) > 6 else ''}")
    evaluate_sites(switching, lambda name: None)
    return judge()

  def overhead(self) -> Dict[str, Any]:
    """Refreshes made (and their steps, a resumed run's earlier ones included), the
    wall-clock seconds of this process's refreshes (the first compiles what was not compiled
    ahead), switches, the step the next refresh is due at under the overhead budget
    (None: the next cadence point), `stepping_s` (the seconds between the loop's calls,
    refreshes left out), `ahead_s` (the loop's seconds in starting the pass's compile ahead),
    `waiting_since` (the step of a due refresh still waiting for that compile, or None),
    `share`: this process's refresh and start seconds over its training time (steps,
    refreshes and starts; None before a step was timed), and `share_after_first`: the
    refreshes after the first alone, what a long run tends to once the one-time costs are
    paid (None before a second refresh)."""
    spent = sum(self.seconds) + self.ahead_s
    later = sum(self.seconds[1:])
    timed = self.stepping_s > 0
    return {"refreshes": len(self.refreshes), "refresh_steps": list(self.refreshes),
            "seconds": list(self.seconds),
            "switches": sum(1 for e in self.events if e["event"] == SWITCH_EVENT),
            "next_refresh": self.next_refresh, "stepping_s": self.stepping_s,
            "ahead_s": self.ahead_s, "waiting_since": self.deferred_since,
            "share": spent / (spent + self.stepping_s) if timed else None,
            "share_after_first": (later / (later + self.stepping_s)
                                  if timed and len(self.seconds) > 1 else None)}


def _reservoir_dtype(state):
  """The dtype reservoirs keep in `state` (the sown operands' compute dtype)."""
  for site in state["sites"].values():
    for name, buffer in (site.get("reservoir") or {}).items():
      if name != "seen":
        return buffer.dtype
  return jax.numpy.bfloat16


def run_valve(spec, config, source, workdir: str, batch_size: int,
              log: Callable[[str], None] = print) -> DriftValve:
  """The valve of a run with precision 'loka', a plan and `drift_every` N (the report:
  `drift_report`, else the one named in the plan's provenance)."""
  if spec.precision != "loka" or not spec.plan:
    raise PlanError("drift.every needs run.precision=loka and a run.plan: the valve "
                    "guards a plan")
  plan = as_plan(spec.plan)
  report_path = spec.drift_report or (plan.get("provenance") or {}).get("report_path")
  if not report_path:
    raise PlanError(f"{spec.plan}: its provenance names no probe report; pass "
                    "drift.report=PROBE_REPORT.json (the report it was selected on)")
  features = source.features
  build = lambda kernel_plan: build_model(config, features, SiteConfig.for_precision(
      "loka", plan=kernel_plan))
  try:
    valve_config = ValveConfig(cadence=spec.drift_every, max_overhead=spec.drift_max_overhead,
                               compile_ahead=spec.drift_compile_ahead)
  except ValueError as e:
    raise PlanError(f"drift.every={spec.drift_every}, drift.max_overhead="
                    f"{spec.drift_max_overhead}: {e}") from e
  try:
    return DriftValve(build, plan, load_report(report_path), source, batch_size, workdir,
                      valve_config, log=log)
  except ValueError as e:  # a bad report file, or a plan/report mismatch
    raise PlanError(f"drift.every: {e}") from e


def run(spec, workdir: str, train_config, log: Callable[[str], None] = print):
  """`train.experiment.run` with the drift valve when `spec.drift_every` asks for one; then
  `log` gets one line on what the valve's refreshes cost, and the returned final metrics
  their `DriftValve.overhead` under "drift"."""
  made: List[DriftValve] = []

  def hook(*args):
    made.append(run_valve(*args, log=log))
    return made[-1]

  try:
    final = experiment.run(spec, workdir, train_config, hook=hook)
  finally:
    for valve in made:
      valve.close()
  if made:
    o = made[-1].overhead()
    pct = lambda share: "-" if share is None else f"{100 * share:.2f}%"
    done = (f"{len(o['seconds'])} refreshes in this process ({sum(o['seconds']):.1f} s; the "
            f"first {o['seconds'][0]:.1f} s)" if o["seconds"] else "no refresh in this process")
    log(f"[drift] {done}, {o['switches']} switches: {pct(o['share'])} of its training time "
        f"({pct(o['share_after_first'])} without the first); next "
        f"refresh at step {o['next_refresh'] or 'the next multiple of ' + str(spec.drift_every)}"
        + ("" if o["waiting_since"] is None else
           f"; a refresh due since step {o['waiting_since']} was still waiting for the "
           "statistics pass's compile ahead"))
    final = {**final, "drift": o}
  return final
