"""The whole probe of one run: train (or resume) while collecting statistics, evaluate every
candidate kernel on every site, time them, and write the ProbeReport, its markdown summary
and plots. `experiments/probe.py` and the notebooks call `run_probe`.

Every phase resumes: training from its checkpoints (which carry the statistics), evaluation
from `WORKDIR/probe_eval.jsonl` (one line per finished site and batch of candidates, keyed
by the statistics and settings it used: a rerun with one more candidate evaluates that one
alone), timing from the on-disk timing cache. With a time budget, a phase that runs out
stops cleanly; the report then says what is pending and rerunning finishes it.

Once every site is evaluated, what the report takes from the trained statistics (each site's
summary, the probe's overhead, the run's final metrics and the statistics' fingerprint) is
saved in `WORKDIR/probe_trained.json`. A rerun whose evaluations are all in the cache under
that fingerprint builds its report from the two files and does not train again: a machine
without the checkpoint (a fresh GPU host, where only small files travel) finishes a probe
that ran out of time in its timing phase in the time the timings take.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np

from loka_jax import jsonio
from loka_jax.probe import assemble
from loka_jax.probe.assemble import below_timing_floor, distinct_shapes
from loka_jax.probe.options import ProbeOptions, ProbeSetupError
from loka_jax.probe import candidates as candidates_lib
from loka_jax.probe import collector as collector_lib
from loka_jax.probe import evaluate, executables, kernel_timing, memory
from loka_jax.probe import report as report_lib
from loka_jax.probe import stats_report
from loka_jax.probe.collector import ProbeConfig
from loka_jax.probe.training import META_KEY, STATS_KEY, ProbeCollector, probe_sites
from loka_jax.train import experiment, run_files
from loka_jax.train.checkpoint import Checkpointer
from loka_jax.train.loop import TrainConfig, restore_run, train

REPORT_JSON, REPORT_MD, PLOTS_DIR = assemble.REPORT_JSON, assemble.REPORT_MD, assemble.PLOTS_DIR
EVAL_CACHE = "probe_eval.jsonl"
TRAINED_JSON = "probe_trained.json"


@dataclasses.dataclass
class ProbeResult:
  report: Dict[str, Any]
  paths: Dict[str, Any]
  complete: bool


def _log(message: str) -> None:
  print(f"[probe] {message}", flush=True)


def _saved_statistics(workdir: str) -> Tuple[Any, Any]:
  """(statistics, meta) of the newest checkpoint of the probe run in `workdir`, or (None,
  None). The state is left to the training loop, which reads it next: reading it here too
  would hold two copies on the device."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None, None
  found = Checkpointer(directory).restore_extras()
  if found is None:
    return None, None
  return found[1].get(STATS_KEY), found[1].get(META_KEY)


def _fingerprint(collector: ProbeCollector) -> str:
  return f"{collector.observations}:{collector.last_observed_step()}"


def _eval_cache_key(key: Mapping) -> str:
  """A cache row's lookup key: everything it was evaluated under but the kernel list, so a
  probe with one more candidate evaluates that one alone."""
  return json.dumps({k: v for k, v in report_lib.json_ready(key).items() if k != "kernels"},
                    sort_keys=True)


def _read_eval_cache(path: str) -> Dict[str, List[Dict]]:
  """{lookup key: the rows evaluated under it, in file order}."""
  out: Dict[str, List[Dict]] = {}
  if not os.path.exists(path):
    return out
  for _, row, error in jsonio.jsonl_rows(path):
    try:
      key = None if error else _eval_cache_key(row["key"])
    except (KeyError, TypeError, AttributeError):
      key = None
    if key is not None:  # else a line torn by a killed run (or not a row): measured again
      out.setdefault(key, []).append(row)
  return out


def _cached_passes(rows: List[Mapping], names: List[str]):
  """(passes {pass: {kernel: entry}} of `names` found in `rows`, evaluation info or None,
  the names no row evaluated); a later row's entry wins."""
  found: Dict[str, Dict[str, Dict]] = {}
  evaluated, info = set(), None
  for row in rows:
    evaluated.update(row["key"].get("kernels") or ())
    info = row["evaluation"]
    for p, entries in row["passes"].items():
      for k, e in entries.items():
        if k in names:
          found.setdefault(p, {})[k] = e
  return found, info, [n for n in names if n not in evaluated]


def _merged_passes(old: Mapping, new: Mapping, names: List[str]) -> Dict[str, Dict]:
  """{pass: {kernel: entry}} of both, the kernels in `names` order."""
  passes = {}
  for p in ("fwd", "grad_lhs", "grad_rhs"):
    both = {**old.get(p, {}), **new.get(p, {})}
    if both:
      passes[p] = {k: both[k] for k in names if k in both}
  return passes


def append_eval_rows(path: str, rows) -> None:
  """Appends evaluation cache rows to `path`, one line each, after any line a killed run left
  torn (`jsonio.append_lines`)."""
  jsonio.append_lines(path, (json.dumps(report_lib.json_ready(row), allow_nan=False)
                             for row in rows))


class _CompileAhead:
  """Keeps the evaluation functions of the next `lookahead` sites to evaluate queued on a
  Precompiler, in evaluation order. A site has about 8 functions (samplers, references, a
  few kernels): half as many sites ahead as threads keeps every thread busy without
  compiling far past a budget's end."""

  def __init__(self, precompiler: executables.Precompiler, order: List[str], jobs_of):
    self.precompiler, self.order, self.jobs_of = precompiler, order, jobs_of
    self.lookahead = max(2, precompiler.workers // 2)
    self.submitted = 0

  def reach(self, name: str) -> None:
    """`name` is evaluated next: queue it and the sites after it up to the lookahead."""
    upto = min(self.order.index(name) + self.lookahead, len(self.order))
    for ahead in self.order[self.submitted:upto]:
      self.precompiler.submit(self.jobs_of(ahead))
    self.submitted = max(self.submitted, upto)


class _EarlyEvaluationCompiles:
  """Every site's evaluation functions compiled while the probe trains
  (`ProbeOptions.compile_evaluation_while_training`), on half the compile threads, from the
  collector's statistics as shapes: the evaluation phase then takes them instead of
  compiling. The jobs are worked out on a thread of their own, so training starts at once."""

  def __init__(self, compile_workers: Optional[int]):
    workers = executables.default_workers() if compile_workers is None else compile_workers
    self.workers = max(1, workers // 2)
    self.precompiler: Optional[executables.Precompiler] = None

  @staticmethod
  def wanted(options: ProbeOptions, cached: Mapping) -> bool:
    """Only for a fresh probe: with an evaluation cache, which candidates a site still needs
    is known after training (from the statistics' fingerprint)."""
    early = options.compile_evaluation_while_training
    if early is None:
      early = jax.default_backend() != "cpu"
    return early and options.compile_workers != 0 and not cached

  def start(self, sites, kernels, compute_dtype: str, eval_config,
            collector: ProbeCollector) -> None:
    self.precompiler = executables.Precompiler(self.workers)
    state = collector.state
    self.precompiler.submit_from_thread(
        functools.partial(evaluate.compile_jobs, site,
                          collector_lib.site_state(state, sites, name), kernels,
                          compute_dtype, eval_config)
        for name, site in sites.items())
    _log(f"compiling {len(sites)} sites' evaluation functions while training, on "
         f"{self.workers} threads")

  def close(self) -> None:
    """Waits for the compiles running, drops the queued ones."""
    if self.precompiler is not None:
      self.precompiler.close()
      self.precompiler = None


@dataclasses.dataclass
class _Setup:
  model: Any
  source: Any
  abstract: Any          # the model's variables as ShapeDtypeStructs
  sites: Dict[str, Any]  # the selected sites' SiteProbes, in call order
  kernels: List[Any]
  excluded: Dict[str, str]
  names: List[str]


def _setup(spec: experiment.RunSpec, batch_size: int, probe_config: ProbeConfig,
           options: ProbeOptions, build=None) -> _Setup:
  """The model, its selected sites and the candidate kernels; settings errors surface here,
  before any training or timing."""
  model, source, _ = (build or experiment.build_run)(spec)
  batch = source.train_batch(0, batch_size)
  abstract = jax.eval_shape(lambda b: model.init({"params": jax.random.PRNGKey(0),
                                                  "dropout": jax.random.PRNGKey(1)}, b,
                                                 train=False), batch)
  sites = probe_sites(model, abstract, batch, probe_config)
  try:
    kernels, excluded = candidates_lib.candidate_kernels(options.kernels or None,
                                                         jax.default_backend())
  except ValueError as e:
    raise ProbeSetupError(f"the probe's candidate kernels: {e}") from e
  selected = [n for n in sites if options.sites is None or re.search(options.sites, n)]
  if not selected:
    raise ProbeSetupError(f"the probe's sites regex {options.sites!r} matches none of the sites: "
                          f"{list(sites)}")
  return _Setup(model, source, abstract, {n: sites[n] for n in selected}, list(kernels),
                dict(excluded), [k.name for k in kernels])


def describe_probe(spec: experiment.RunSpec, train_config: TrainConfig,
                   probe_config: ProbeConfig = ProbeConfig(),
                   options: ProbeOptions = ProbeOptions(), build=None) -> Dict[str, Any]:
  """What probing the spec's model will hold, without training or a GPU (abstract shapes):
  sites, distinct GEMM shapes (what timing measures), the bytes of the training state
  (parameters and optimizer state) and of the statistics, which together make the probe's
  checkpoint, for planning a run on a card and disk of known size; and the distinct
  functions the error evaluation compiles for `options.kernels`, with the number of sites
  that bring new ones; the functions the statistics pass compiles; and the distinct shapes
  timing measures at
  `options.min_timing_gflops` (`shapes_to_time`)."""
  setup = _setup(spec, train_config.batch_size, probe_config, options, build)
  stats = _abstract_statistics(spec, probe_config, setup)
  # The functions the error evaluation compiles (`evaluate.compile_jobs`), and the sites that
  # bring new ones: the sites whose evaluation waits on compiles.
  seen, compiling = set(), 0
  for name, site in setup.sites.items():
    jobs = evaluate.compile_jobs(site, collector_lib.site_state(stats, setup.sites, name),
                                 setup.kernels, str(np.dtype(site_config_dtype(spec))),
                                 assemble.eval_config(options))
    keys = {(fn, executables.signature(args)) for fn, args in jobs}
    compiling += bool(keys - seen)
    seen |= keys
  layouts = [layout for _, layout in distinct_shapes(setup.sites).values()]
  return {"sites": len(setup.sites), "distinct_shapes": len(layouts),
          "shapes_to_time": sum(not below_timing_floor(l, options) for l in layouts),
          **_standing_bytes(spec, train_config, probe_config, setup, stats),
          "evaluation_functions": len(seen), "sites_compiling": compiling,
          "statistics_functions": collector_lib.statistics_functions(setup.sites, probe_config)}


def _abstract_statistics(spec: experiment.RunSpec, probe_config: ProbeConfig, setup: _Setup):
  """The statistics' shapes (`jax.ShapeDtypeStruct`s): nothing is allocated."""
  dtype = site_config_dtype(spec)
  return jax.eval_shape(lambda: collector_lib.init_state(setup.sites, probe_config, dtype))


def _standing_bytes(spec: experiment.RunSpec, train_config: TrainConfig,
                    probe_config: ProbeConfig, setup: _Setup, stats=None) -> Dict[str, int]:
  """{"state_bytes", "statistics_bytes"}: what a probe holds on the device all run, from
  abstract shapes."""
  from loka_jax.train.optim import make_optimizer
  from loka_jax.train.state import state_bytes, tree_bytes
  if stats is None:
    stats = _abstract_statistics(spec, probe_config, setup)
  batch = setup.source.train_batch(0, train_config.batch_size)
  return {"state_bytes": state_bytes(setup.model, make_optimizer(train_config.optim), batch,
                                     train_config.seed),
          "statistics_bytes": tree_bytes(stats)}


def time_site_shapes(spec: experiment.RunSpec, batch_size: int, cache_dir: str,
                     probe_config: ProbeConfig = ProbeConfig(),
                     options: ProbeOptions = ProbeOptions(), build=None) -> Dict[str, Any]:
  """Times every candidate kernel and pass on every distinct site shape of the spec's model
  into the timing cache under `cache_dir`, with no training and no statistics.

  The timings depend on shapes only, so they can be measured ahead, on any machine of the
  target kind: a later probe whose `ProbeOptions.timing_cache` is this directory finds them
  and skips its own timing phase (Wukong large: 17 shapes, most of a GPU call). Resumable,
  and it leaves shapes pending when `options.should_stop` asks; shapes below
  `options.min_timing_gflops` are left out.
  Returns {"cache", "device_kind", "shapes", "timed", "pending", "skipped"}.
  """
  if not kernel_timing.on_gpu():
    raise ProbeSetupError("timing kernels needs a GPU (CPU timings say nothing about GPU "
                          "kernels)")
  setup = _setup(spec, batch_size, probe_config, options, build)
  kind = kernel_timing.device_kind()
  cache = kernel_timing.TimingCache(kernel_timing.default_cache_path(cache_dir, kind), kind)
  dtype = str(np.dtype(site_config_dtype(spec)))
  layouts = distinct_shapes(setup.sites)
  timed = pending = skipped = 0
  pace = assemble.Pace(options.should_stop)
  for i, (name, layout) in enumerate(layouts.values()):
    if below_timing_floor(layout, options):
      skipped += 1
      continue
    t0 = time.time()
    # The same (kernel, pass) set the probe's timing phase will look up.
    unsupported = evaluate.unsupported_passes(layout, setup.kernels)
    got = []
    if pace.may_start():
      got = kernel_timing.measure_site(layout, setup.kernels, dtype, cache,
                                       unsupported=unsupported, repeats=options.repeats,
                                       compile_workers=options.timing_compile_workers)
    if got:
      pace.record(time.time() - t0)
    done = kernel_timing.site_timings(layout, setup.kernels, dtype, cache,
                                      unsupported=unsupported)
    if any(t.get("timing") == "missing" for per in done.values() for t in per.values()):
      pending += 1
      continue
    timed += 1
    if got:
      _log(f"timed shape {i + 1}/{len(layouts)} of {name} ({len(got)} kernel passes) in "
           f"{time.time() - t0:.1f}s")
  return {"cache": cache.path, "device_kind": kind, "shapes": len(layouts), "timed": timed,
          "pending": pending, "skipped": skipped}


def _trained_key(spec: experiment.RunSpec, train_config: TrainConfig,
                 probe_config: ProbeConfig) -> Dict[str, Any]:
  """What the trained statistics are a function of: the run, its training (not the loop's
  logging or checkpointing) and the probe's statistics settings."""
  t = train_config
  return report_lib.json_ready({
      "run": spec.run_info(), "steps": t.steps, "batch_size": t.batch_size, "seed": t.seed,
      "nan_policy": t.nan_policy,
      "optim": run_files.without_added_defaults(dataclasses.asdict(t.optim)),
      "probe_config": probe_config.statistics_settings()})


def _read_trained(path: str, key: Mapping) -> Optional[Dict[str, Any]]:
  """The saved summary of the trained statistics (TRAINED_JSON) when it is this run's;
  otherwise None (a missing or corrupt file loses nothing: the probe trains and remakes it)."""
  if not os.path.exists(path):
    return None
  try:
    saved = jsonio.read_json(path, "probe's summary of its trained statistics",
                             "the probe trains again and rewrites it", ValueError)
    fields = {k: saved[k] for k in ("key", "fingerprint", "observations", "overhead", "final",
                                    "stats")}
  except (ValueError, KeyError, TypeError) as e:
    _log(f"ignoring {path}: {e}")
    return None
  return fields if jsonio.same_json(fields["key"], key) else None


def _train_with_statistics(spec: experiment.RunSpec, workdir: str, train_config: TrainConfig,
                           probe_config: ProbeConfig, setup: _Setup, start: float,
                           compile_workers: Optional[int] = None,
                           on_collector: Optional[Callable[[ProbeCollector], None]] = None
                           ) -> Tuple[ProbeCollector, Dict[str, Any]]:
  """Trains (resuming from the workdir's checkpoint) with the statistics pass; returns the
  collector, holding every observation, and the run's final metrics. `compile_workers`:
  threads compiling the statistics pass's functions side by side (None: CPUs up to 16; 0:
  each on its first call, in turn). `on_collector` is called with the collector before
  training starts."""
  limit = memory.device_limit()
  if limit is not None:  # on a GPU: stop now a run that cannot fit, warn one that may not
    standing = _standing_bytes(spec, train_config, probe_config, setup)
    note = memory.standing_memory_note(standing["state_bytes"], standing["statistics_bytes"],
                                       limit)
    if note:
      _log(note)
  saved_stats, saved_meta = _saved_statistics(workdir)
  collector = ProbeCollector(setup.model, setup.source, train_config.batch_size, setup.sites,
                             probe_config, state=saved_stats, meta=saved_meta,
                             example_variables=setup.abstract)
  _log(f"{spec.model}/{spec.preset}: {len(setup.sites)} sites; training to step "
       f"{train_config.steps} with a statistics pass every {probe_config.cadence} steps")
  if on_collector is not None:
    on_collector(collector)
  try:
    if compile_workers != 0:
      # The statistics pass's functions compile side by side on threads from the loop's
      # first step on; at InterFormer `large` its first call had compiled them in turn, 58 s.
      collector.compile_ahead_after_first_step(compile_workers)
    final = train(setup.model, setup.source, workdir, train_config, run_info=spec.run_info(),
                  extras=collector.extras, step_callback=collector.on_step)
    final_step = int(final.get("steps") or 0)
    _log(f"trained to step {final_step} ({time.time() - start:.0f}s into the probe)")
    # The final checkpoint holds the observation at the final step (the loop runs its
    # callback before it saves); one it lacks is made here (a pure function of the
    # parameters, the batch and the step), then observations are topped up to the minimum.
    catch_up = collector.due(final_step)
    needed = max(probe_config.min_observations - collector.observations - int(catch_up), 0)
    if catch_up or needed:
      # The collector holds the statistics already: the state alone is read.
      state, _ = restore_run(workdir, setup.model, setup.source, train_config,
                             array_extras=False)
      if compile_workers != 0 and not collector.pass_compiled:
        collector.try_compile_ahead(state, compile_workers)
      if catch_up:
        collector.observe(state.variables(), state.rng, final_step)
      if needed:
        _log(f"{collector.observations} observations; making {needed} more on the final "
             f"parameters (batches {final_step + 1}..{final_step + needed})")
      for i in range(needed):
        collector.observe(state.variables(), state.rng, final_step + 1 + i)
  finally:
    collector.close()
  return collector, {k: final.get(k) for k in ("steps", "ne", "auc", "logloss")}


def run_probe(spec: experiment.RunSpec, workdir: str, train_config: TrainConfig,
              probe_config: ProbeConfig = ProbeConfig(),
              options: ProbeOptions = ProbeOptions(), build=None) -> ProbeResult:
  """Trains (resuming) with the statistics pass, evaluates, times and writes the report.
  Does not train when every site's evaluation is cached under the trained statistics
  summarized in TRAINED_JSON (see the module docstring).

  `build(spec) -> (model, source, config)` replaces `experiment.build_run` for models that
  are not presets (e.g. the benchmark's MLP towers)."""
  start = time.time()
  os.makedirs(workdir, exist_ok=True)
  setup = _setup(spec, train_config.batch_size, probe_config, options, build)
  sites, kernels, excluded, names = setup.sites, setup.kernels, setup.excluded, setup.names
  selected = list(sites)
  compute_dtype = str(np.dtype(site_config_dtype(spec)))
  eval_config = assemble.eval_config(options)
  pending: List[str] = []

  # ---- training, unless its statistics are summarized and every evaluation is cached
  early_compiles = _EarlyEvaluationCompiles(options.compile_workers)
  cache_path = os.path.join(workdir, EVAL_CACHE)
  cached = _read_eval_cache(cache_path)
  key_of = lambda name, fingerprint: {
      "site": name, "fingerprint": fingerprint, "kernels": names, "dtype": compute_dtype,
      "eval": eval_config.to_dict(), "bootstrap": options.bootstrap,
      "evaluator": evaluate.EVALUATOR_VERSION}
  # (passes found, evaluation info, candidates missing) of every site, from the cache.
  lookup = lambda fingerprint: {
      name: _cached_passes(cached.get(_eval_cache_key(key_of(name, fingerprint)), []), names)
      for name in selected}
  trained_path = os.path.join(workdir, TRAINED_JSON)
  trained_key = _trained_key(spec, train_config, probe_config)
  trained = _read_trained(trained_path, trained_key)
  summarized = trained is not None and all(n in trained["stats"] for n in selected)
  cached_of = lookup(trained["fingerprint"]) if summarized else {}
  collector = None
  if summarized and not any(missing for _, _, missing in cached_of.values()):
    fingerprint, observations = trained["fingerprint"], trained["observations"]
    overhead, final = trained["overhead"], trained["final"]
    _log(f"{spec.model}/{spec.preset}: {len(sites)} sites, every one evaluated before on the "
         f"statistics summarized in {trained_path}: not training again")
  else:
    try:
      collector, final = _train_with_statistics(
          spec, workdir, train_config, probe_config, setup, start, options.compile_workers,
          on_collector=(functools.partial(early_compiles.start, sites, kernels, compute_dtype,
                                          eval_config)
                        if early_compiles.wanted(options, cached) else None))
    except BaseException:
      early_compiles.close()
      raise
    fingerprint, observations = _fingerprint(collector), collector.observations
    overhead = collector.overhead()
    cached_of = lookup(fingerprint)

  # ---- errors
  site_entries: Dict[str, Dict] = {}
  to_evaluate = [name for name in selected if cached_of[name][2]]
  todo_of = lambda name: [k for k in kernels if k.name in cached_of[name][2]]
  # Compiles for the sites ahead run on a thread pool while the current one evaluates.
  precompiler = (executables.Precompiler(options.compile_workers)
                 if options.compile_workers != 0 and to_evaluate else None)
  jobs_of = lambda name: evaluate.compile_jobs(
      sites[name], collector_lib.site_state(collector.state, sites, name), todo_of(name),
      compute_dtype, eval_config)
  ahead = _CompileAhead(precompiler, to_evaluate, jobs_of) if precompiler else None
  evaluated, counts_before, t_eval = 0, executables.counts(), time.time()
  pace = assemble.Pace(options.should_stop)
  try:
    for i, name in enumerate(selected):
      site = sites[name]
      found, evaluation_info, missing = cached_of[name]
      passes = _merged_passes(found, {}, names)
      if missing and not pace.may_start():
        pending.append(f"evaluation of {name}")
        continue
      # Without a collector every site is cached: its statistics come from the summary.
      state = (None if collector is None else
               jax.device_get(collector_lib.site_state(collector.state, sites, name)))
      if missing:
        # Only the candidates no earlier run evaluated here (same statistics and settings).
        t0 = time.time()
        if ahead:
          ahead.reach(name)
        new, evaluation_info = assemble.evaluated_passes(site, state, todo_of(name),
                                                         compute_dtype, options, eval_config)
        append_eval_rows(cache_path, [{"key": {**key_of(name, fingerprint),
                                               "kernels": missing},
                                       "passes": new, "evaluation": evaluation_info}])
        passes = _merged_passes(found, new, names)
        pace.record(time.time() - t0)
        evaluated += 1
        reused = len(names) - len(missing)
        _log(f"evaluated {i + 1}/{len(selected)} {name} in {time.time() - t0:.1f}s"
             + (f" ({len(missing)} new candidates, {reused} from the cache)" if reused else ""))
      site_entries[name] = assemble.site_entry(
          site, (trained["stats"][name] if collector is None
                 else stats_report.site_stats(site, state, observations)),
          evaluation_info, passes)
  finally:
    if precompiler is not None:
      precompiler.close()
    early_compiles.close()
  if precompiler is not None:
    counts = {k: v - counts_before[k] for k, v in executables.counts().items()}
    _log(f"evaluation phase: {evaluated} sites in {time.time() - t_eval:.0f}s, "
         f"compiled ahead on {precompiler.workers} threads: {counts['ahead']} calls took a "
         f"function compiled ahead, {counts['inline']} went through jit")
  if collector is not None and len(site_entries) == len(selected):
    # Every site evaluated: a rerun needs the statistics no more (only these summaries).
    kept = (trained["stats"] if trained and trained["fingerprint"] == fingerprint else {})
    jsonio.write_json_atomic(trained_path, report_lib.json_ready({
        "key": trained_key, "fingerprint": fingerprint, "observations": observations,
        "overhead": overhead, "final": final,
        "stats": {**kept, **{n: e["stats"] for n, e in site_entries.items()}}}))

  # ---- timing, then the report
  timing = assemble.attach_timings(site_entries, sites, kernels, compute_dtype, options,
                                   workdir)
  pending.extend(timing.pending)
  report = assemble.finish_report(
      site_entries, sites, kernels, excluded, options, eval_config, compute_dtype, timing,
      model=spec.model, preset=spec.preset,
      run={**spec.run_info(), "steps": final.get("steps"), "batch_size": train_config.batch_size,
           "final": {k: final.get(k) for k in ("ne", "auc", "logloss")}},
      probe_config=probe_config.to_dict(), overhead=overhead, pending=pending)
  report, paths = assemble.write_report(report, workdir, options)
  _log(f"report: {paths['json']} ({time.time() - start:.0f}s"
       f"{'' if not pending else ', incomplete: ' + '; '.join(pending[:3])})")
  return ProbeResult(report, paths, not pending)


def site_config_dtype(spec: experiment.RunSpec):
  """The compute dtype of the run's sites."""
  from loka_jax.models import SiteConfig
  if spec.precision == "loka":
    return SiteConfig().policy.compute_dtype
  return SiteConfig.for_precision(spec.precision, kernel=spec.kernel).policy.compute_dtype
