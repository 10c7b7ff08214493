"""From evaluated sites to a ProbeReport: each site's entry, the timing of every candidate
(measured on a GPU, else read from a committed timing table), and the report itself. Both
ways of probing share it: `loka_jax.probe` / `Probe` on any model and `run_probe` on the
project's own training runs."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax

from loka_jax.probe import timing_table as tables_lib
from loka_jax.kernels import EinsumSpec
from loka_jax.probe import candidates as candidates_lib
from loka_jax.probe import chain_timing, evaluate, kernel_timing, plots
from loka_jax.probe import report as report_lib
from loka_jax.probe import stats_report, summarize
from loka_jax.probe import timing_needs as needs_lib
from loka_jax.probe.options import ProbeOptions, timing_plan

REPORT_JSON = "probe_report.json"
REPORT_MD = "probe_report.md"
PLOTS_DIR = "plots"
SKIPPED = needs_lib.SKIPPED   # a pass not timed (below `min_timing_gflops`, or not needed)


def _log(message: str) -> None:
  print(f"[probe] {message}", flush=True)


def shape_gflops(layout) -> float:
  """GFLOP of a site's forward product (2 x the product of every index size)."""
  return EinsumSpec.parse(str(layout.spec)).flops(layout.lhs.shape, layout.rhs.shape) / 1e9


def below_timing_floor(layout, options: ProbeOptions) -> bool:
  """Whether the site's shape is too small to be timed (`ProbeOptions.min_timing_gflops`)."""
  return options.min_timing_gflops > 0 and shape_gflops(layout) < options.min_timing_gflops


def skipped_timings(passes: Mapping[str, Mapping[str, Any]], options: ProbeOptions
                    ) -> Dict[str, Dict[str, Dict]]:
  """{pass: {kernel: timing}} of a site whose shape is not timed: no speed, and why."""
  note = f"not timed: the shape is below min_timing_gflops={options.min_timing_gflops:g}"
  return {p: {k: needs_lib.skipped_info(note) for k in per_kernel}
          for p, per_kernel in passes.items()}


def distinct_shapes(sites: Mapping[str, Any]) -> Dict[Tuple, Tuple[str, Any]]:
  """{(spec, lhs shape, rhs shape): (first site, its layout)} in call order: what timing
  measures (timings depend on shapes only)."""
  out: Dict[Tuple, Tuple[str, Any]] = {}
  for name, site in sites.items():
    layout = site.layout
    out.setdefault((str(layout.spec), layout.lhs.shape, layout.rhs.shape), (name, layout))
  return out


# ----------------------------------------------------------------------------- sites


def eval_config(options: ProbeOptions) -> evaluate.EvalConfig:
  return evaluate.EvalConfig(samples=options.samples, reservoir_samples=options.reservoir_samples,
                             max_eval_elements=options.max_eval_elements,
                             chunk_elements=options.chunk_elements, seed=options.seed)


def evaluation_info(site, ev: evaluate.SiteEvaluation) -> Dict[str, Any]:
  """How a site was evaluated: slices, reservoir, shapes, chunking."""
  return {"slices": ev.slices, "of": site.layout.num_slices,
          "slice_index": site.layout.slice_label,
          "row_subsampled": bool(ev.slices and ev.slices < site.layout.num_slices),
          "reservoir": ev.reservoir,
          "evaluated_shapes": {k: list(v) for k, v in ev.layout.shapes().items()},
          "chunk_samples": ev.chunk,
          "delayed_warmup_on_others": evaluate.warmup_excludes_self(ev.chunk)}


def evaluated_passes(site, state, kernels: Sequence, compute_dtype: str,
                     options: ProbeOptions, eval_config: evaluate.EvalConfig
                     ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """({pass: {kernel: entry}}, evaluation info) of one site: each kernel's error on operands
  drawn from the site's statistics `state`, with bootstrap CIs."""
  ev = evaluate.evaluate_site(site, state, kernels, compute_dtype, eval_config)
  passes = summarize.site_passes(ev, [k.name for k in kernels], n_boot=options.bootstrap,
                                 seed=options.seed)
  return passes, evaluation_info(site, ev)


def site_entry(site, stats: Mapping[str, Any], info: Mapping[str, Any],
               passes: Mapping[str, Any]) -> Dict[str, Any]:
  """A site's entry in the report (its timings are added by `attach_timings`)."""
  layout = site.layout
  entry = {"kind": site.kind, "spec": site.spec,
           "shapes": {k: list(v) for k, v in layout.shapes().items()},
           "flops": int(layout.spec.flops(layout.lhs.shape, layout.rhs.shape)),
           "modes": site.describe(), "stats": stats, "evaluation": info, "passes": passes}
  if site.chain is not None:  # a fused Mods layer: what follows its product
    entry["chain"] = dataclasses.asdict(site.chain)
  return entry


# ----------------------------------------------------------------------------- timing


class Pace:
  """Whether the next unit of work (a site's evaluation, a shape's timing) may start: asks the
  caller's `should_stop` with the longest such unit so far in this call (the first asks with
  0). A process killed mid-shape saves none of that shape's timings, and one shape's compiles
  and samples take 20-150 s at Wukong `large`'s shapes on an H200, so the caller's limit is
  asked about the whole unit, not its start."""

  def __init__(self, should_stop: Optional[Callable[[float], bool]]):
    self.should_stop = should_stop
    self.longest = 0.0

  def may_start(self) -> bool:
    return self.should_stop is None or not self.should_stop(self.longest)

  def record(self, seconds: float) -> None:
    """One unit done, taking `seconds`."""
    self.longest = max(self.longest, seconds)


@dataclasses.dataclass
class Timing:
  """Where the report's timings came from and whether dispatch may trust them."""
  source: Dict[str, Any]
  valid: bool
  pending: List[str]


def _merged(*passes: Mapping[str, Mapping[str, str]]) -> Dict[str, Dict[str, str]]:
  out: Dict[str, Dict[str, str]] = {}
  for per_pass in passes:
    for p, kernels in per_pass.items():
      out.setdefault(p, {}).update(kernels)
  return out


def attach_timings(site_entries: Dict[str, Dict], sites: Mapping[str, Any], kernels: Sequence,
                   compute_dtype: str, options: ProbeOptions, workdir: Optional[str]) -> Timing:
  """Adds each candidate's time and speedup to every pass of `site_entries`: measured here
  on a GPU (each distinct shape once, through the on-disk timing cache; only the passes that
  can change the plan, `timing_needs`, the others reused from this card's committed table or
  marked skipped), else read from the committed timing table of `options.timing_table` (then
  marked not valid for dispatch unless the table is for the target device:
  `selection.resolve_timing` decides)."""
  # What can still win is chosen by each pass's errors, underflow included: the kernels that
  # expose no quantized operands (Flax's delayed scaling) get theirs from the statistics,
  # here rather than with the report, or no such kernel would pass on accuracy and none would
  # ever be timed.
  fill_stats_underflow(site_entries, sites, kernels)
  measure, timing_valid = timing_plan(options)
  device = jax.devices()[0].device_kind
  kind = kernel_timing.device_kind()
  source: Dict[str, Any] = {"kind": "none"}
  pending: List[str] = []
  timings: Dict[str, Dict] = {}
  if measure:
    cache_dir = options.timing_cache or os.path.join(workdir or os.curdir, "timing_cache")
    cache = kernel_timing.TimingCache(kernel_timing.default_cache_path(cache_dir, kind), kind)
    source = {"kind": "measured", "device_kind": device, "cache": cache.path}
    same_card = None if options.time_all else needs_lib.same_card_table(options.table_dir)
    if not options.time_all:  # what was timed depends on them (`timing_needs`)
      source["timed_for"] = options.criteria.to_dict()
    if same_card is not None:
      source["reused_table"] = same_card[0]
    pace = Pace(options.should_stop)
    if options.min_timing_gflops > 0:
      source["min_timing_gflops"] = options.min_timing_gflops
    counts = {"measured": 0, "reused": 0, "not_safe": 0, "dominated": 0,
              "baseline_unneeded": 0}
    by_shape: Dict[Tuple, List[str]] = {}
    for name in site_entries:
      layout = sites[name].layout
      by_shape.setdefault((str(layout.spec), layout.lhs.shape, layout.rhs.shape), []).append(name)
    if same_card is None and not options.time_all:
      n = len(by_shape)
      _log(f"no committed kernel timings for {device} in {options.table_dir}: timing {n} "
           f"site shape{'' if n == 1 else 's'} here, each compiling its kernels' passes")
    for shape_index, names in enumerate(by_shape.values(), 1):
      layout = sites[names[0]].layout
      if below_timing_floor(layout, options):
        for name in names:
          timings[name] = skipped_timings(site_entries[name]["passes"], options)
        continue
      unsupported = needs_lib.unsupported_everywhere([site_entries[n] for n in names])
      # What this card timed so far (earlier shapes, earlier runs in the workdir) counts
      # towards dominance beside its committed table.
      measured = {**tables_lib.empty_table(device),
                  "entries": kernel_timing.table_entries(list(cache.entries.values()))}
      needs = needs_lib.shape_needs(
          layout, [site_entries[n] for n in names], kernels, compute_dtype, unsupported,
          options.criteria, same_card[1] if same_card else None, options.time_all,
          measured=measured)
      for (kernel, _), why in needs.skipped.items():
        counts["baseline_unneeded" if kernel == candidates_lib.BASELINE else
               "dominated" if "dominated" in why else "not_safe"] += 1
      counts["reused"] += len(needs.reused)
      counts["measured"] += len(needs.measure)
      not_measured = _merged(unsupported, needs.not_measured())
      if needs.measure and pace.may_start():
        t0 = time.time()
        got = chain_timing.measure_site(layout, kernels, compute_dtype, cache,
                                         unsupported=not_measured, repeats=options.repeats,
                                         compile_workers=options.timing_compile_workers)
        if got:
          pace.record(time.time() - t0)
          _log(f"timed {names[0]} ({len(got)} kernel passes; shape {shape_index}/"
               f"{len(by_shape)}) in {time.time() - t0:.1f}s")
      shape_timings = chain_timing.site_timings(layout, kernels, compute_dtype, cache,
                                                unsupported=not_measured)
      if needs.reused:
        from_table = chain_timing.table_timings(layout, kernels, compute_dtype, same_card[1],
                                                unsupported=unsupported)
        for k, p in needs.reused:
          shape_timings.setdefault(p, {})[k] = {**from_table[p][k], "timing": needs_lib.REUSED,
                                                "timing_note": "reused from " + same_card[0]}
      for (k, p), why in needs.skipped.items():
        shape_timings.setdefault(p, {})[k] = needs_lib.skipped_info(why)
      for name in names:
        timings[name] = shape_timings
    source["kernel_passes"] = counts
    _log("timing: {measured} kernel passes measured, {reused} reused from this card's "
         "committed table, {not_safe} not timed (no site of their shape admits them on "
         "accuracy), {dominated} not timed (dominated on this card), {baseline_unneeded} "
         "bf16 baseline passes not timed (no kernel of their pass is)".format(**counts))
    write = timing_valid if options.write_table is None else options.write_table
    if write and cache.entries:
      rows = kernel_timing.table_entries(list(cache.entries.values()))
      table_file = tables_lib.table_path(device, options.table_dir)
      tables_lib.update_file(table_file, device, rows)
      source["table"] = table_file
      if workdir is not None:
        local = tables_lib.table_path(device, os.path.join(workdir, "timing_table"))
        tables_lib.update_file(local, device, rows)
        source["table_copy"] = local
      _log(f"timing table: {table_file}")
  else:
    chosen = tables_lib.choose_table(options.timing_table, options.table_dir)
    if chosen is not None:
      path, table = chosen
      source = {"kind": "table", "device_kind": table["device_kind"], "path": path}
      for name, entry in site_entries.items():
        timings[name] = chain_timing.table_timings(
            sites[name].layout, kernels, compute_dtype, table,
            unsupported=needs_lib.unsupported_passes(entry))
  missing_timing = False
  for name, entry in site_entries.items():
    for p, per_kernel in entry["passes"].items():
      for k, e in per_kernel.items():
        t = timings.get(name, {}).get(p, {}).get(k)
        if t is None or e.get("unsupported"):  # (timed at another site of its shape)
          e.update(time_us=None, speedup=None, backend=None, timing=None)
          continue
        e.update(t)
        if t.get("timing") == "missing":
          missing_timing = True
  if measure and missing_timing:
    pending.append("timings (budget reached)")
    timing_valid = False
  return Timing(source, timing_valid, pending)


# ----------------------------------------------------------------------------- the report


def kernels_info(kernels: Sequence) -> Dict[str, Dict[str, Any]]:
  return {k.name: {"sort": k.sort, "backend": k.backend, "fp8": k.fp8, "stateful": k.stateful,
                   "granularity": candidates_lib.granularity_of(k),
                   "description": k.description} for k in kernels}


def fill_stats_underflow(site_entries: Dict[str, Dict], sites: Mapping[str, Any],
                         kernels: Sequence) -> None:
  """Each FP8 pass without measured operands gets its underflow from the site's statistics
  (`stats_report.underflow_from_stats`; a pass that has it already is left as it is)."""
  info = kernels_info(kernels)
  for name, entry in site_entries.items():
    stats_report.underflow_from_stats(entry, info, sites[name].layout)


def finish_report(site_entries: Dict[str, Dict], sites: Mapping[str, Any], kernels: Sequence,
                  excluded: Mapping[str, str], options: ProbeOptions, eval_config,
                  compute_dtype: str, timing: Timing, *, model: str, preset: Optional[str],
                  run: Mapping[str, Any], probe_config: Mapping[str, Any],
                  overhead: Mapping[str, Any], pending: Sequence[str],
                  extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
  """The `loka.probe/2` report of evaluated and timed sites (`attach_timings`, which also
  filled in the underflow the statistics give), with each site's best kernel per pass under
  `options.criteria`."""
  info = kernels_info(kernels)
  report = report_lib.new_report(
      model=model, preset=preset, device=jax.devices()[0].device_kind,
      device_kind=kernel_timing.device_kind(), platform=jax.default_backend(),
      jax_version=jax.__version__, timing_valid=timing.valid, timing_source=timing.source,
      run=dict(run), probe_config=dict(probe_config),
      evaluation={**eval_config.to_dict(), "reservoir_samples": eval_config.num_reservoir,
                  "kernels": [k.name for k in kernels], "compute_dtype": compute_dtype,
                  "bootstrap": options.bootstrap, "sites_regex": options.sites,
                  "reference": "fp32 HIGHEST product of the original operands",
                  "evaluator": evaluate.EVALUATOR_VERSION},
      criteria=options.criteria.to_dict(), overhead=dict(overhead),
      kernels=info, excluded_kernels=dict(excluded))
  report.update(extra or {})
  report["sites"] = site_entries
  report["complete"] = not pending
  report["pending"] = list(pending)
  report_lib.attach_best(report, options.criteria)
  return report


def write_report(report: Mapping[str, Any], workdir: str, options: ProbeOptions
                 ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """(the report as saved, its paths): JSON, markdown summary and plots in `workdir`."""
  os.makedirs(workdir, exist_ok=True)
  paths: Dict[str, Any] = {"json": os.path.join(workdir, REPORT_JSON),
                           "markdown": os.path.join(workdir, REPORT_MD)}
  saved = report_lib.save_report(report, paths["json"])
  with open(paths["markdown"], "w") as f:
    f.write(report_lib.markdown(saved))
  if options.plots and saved.get("sites"):
    paths["plots"] = plots.write_plots(saved, os.path.join(workdir, PLOTS_DIR),
                                       sites=options.site_plots)
  return saved, paths
