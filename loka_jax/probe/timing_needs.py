"""Which kernel passes a GPU probe must time at a site shape, and which it can do without.

Timing is most of a probe's wall time on a GPU (each shape compiles every candidate's passes
and autotunes their GEMMs: 20-150 s a shape on an H200), yet most of it cannot change the
plan. Before a shape is timed, each (kernel, pass) it would time is sorted into one of four:

  measure    timed here, in one interleaving with the bf16 baseline (the protocol)
  reused     an exact entry of the committed table of this card, measured with this jax
             minor version, beside its own baseline: its time and speedup are read from it
  not safe   no site of this shape admits the kernel in this pass on accuracy (SQNR,
             underflow; a fused op must be safe in every pass of a site): no speedup can
             make it eligible, so it is not timed
  dominated  on this card at least `DOMINANCE_SHAPES` shapes of the same size class
             (forward FLOPs within `CLASS_RATIO` of this one) were timed for the kernel's
             pass, in the committed table or in this probe's timing cache (shapes timed
             earlier in this run or by an earlier run in the workdir), and at none of them
             did it reach the speed bar: the pass is not timed. On a card without a
             committed table the probe so stops timing a kernel once it has lost at three
             shapes of a class, where it would otherwise time it at every shape.

Passes not timed carry `timing: "skipped"` and a `timing_note` saying why, so a reader sees
that nothing was measured; selection keeps them off FP8 on speed (no speedup is known). A
probe made with `ProbeOptions.time_all` times everything, as a report that is to be selected
with looser criteria later should be.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import jax

from loka_jax.kernels import FUSED_OP, PASSES, registry
from loka_jax.probe import chain_timing, eligibility
from loka_jax.probe import timing_table as tables_lib
from loka_jax.probe.candidates import BASELINE
from loka_jax.probe.kernel_timing import pass_problem
from loka_jax.probe.layout import site_layout

SKIPPED = "skipped"
REUSED = "table"
DOMINANCE_SHAPES = 3
CLASS_RATIO = 10.0

Pair = Tuple[str, str]  # (kernel, pass)


@dataclasses.dataclass
class ShapeNeeds:
  """What one site shape's timing does with each (kernel, pass) it could time."""
  measure: Set[Pair]
  reused: Set[Pair]
  skipped: Dict[Pair, str]   # pair -> why it is not timed

  def not_measured(self) -> Dict[str, Dict[str, str]]:
    """{pass: {kernel: why}} of every pair this shape does not time, in the form the timing
    functions take their `unsupported` passes."""
    out: Dict[str, Dict[str, str]] = {}
    for k, p in self.reused:
      out.setdefault(p, {})[k] = "reused from the committed table"
    for (k, p), why in self.skipped.items():
      out.setdefault(p, {})[k] = why
    return out


def unsupported_passes(entry: Mapping) -> Dict[str, Dict[str, str]]:
  """{pass: {kernel: reason}} of what one report site entry's kernels do not support."""
  return {p: {k: x["error"] for k, x in ks.items() if x.get("unsupported")}
          for p, ks in entry["passes"].items()}


def unsupported_everywhere(entries: Sequence[Mapping]) -> Dict[str, Dict[str, str]]:
  """{pass: {kernel: reason}} of what no site among `entries` (one shape's) supports: a
  fused-epilogue kernel runs at the shape's fused Mods chains only (`probe.chains`)."""
  each = [unsupported_passes(e) for e in entries]
  return {p: {k: why for k, why in ks.items() if all(k in u.get(p, {}) for u in each)}
          for p, ks in each[0].items()}


def same_card_table(directory: str) -> Optional[Tuple[str, Dict]]:
  """(path, table) committed for this process's device kind, entries measured with this jax
  minor version only; None when there is none."""
  device = jax.devices()[0].device_kind
  tables = tables_lib.committed_tables(directory)
  if device not in tables:
    return None
  path, table = tables[device]
  return path, of_jax_minor(table, jax.__version__)


def of_jax_minor(table: Mapping, version: str) -> Dict:
  """`table` with only the entries measured under `version`'s jax minor version (another
  minor compiles other code)."""
  minor = ".".join(str(version).split(".")[:2])
  return {**table, "entries": [e for e in table["entries"]
                               if ".".join(str(e.get("jax", "")).split(".")[:2]) == minor]}


def _safe_pairs(entries: Sequence[Mapping[str, Any]], kernels: Sequence, criteria
                ) -> Set[Pair]:
  """(kernel, pass) pairs that some site among `entries` admits on accuracy."""
  accuracy = dataclasses.replace(criteria, min_speedup=None)
  safe: Set[Pair] = set()
  for entry in entries:
    for kernel in kernels:
      per_pass = {p: (entry["passes"].get(p) or {}).get(kernel.name) for p in PASSES}
      verdicts = {p: eligibility.assess({**e, "kernel": kernel.name}, p, accuracy,
                                        fp8=kernel.fp8).safe
                  for p, e in per_pass.items() if e is not None}
      if kernel.sort == FUSED_OP:  # all passes or none
        if verdicts and all(verdicts.values()):
          safe |= {(kernel.name, p) for p in verdicts}
      else:
        safe |= {(kernel.name, p) for p, ok in verdicts.items() if ok}
  return safe


def _exact(table: Mapping, kernel: str, layout, pass_name: str, dtype: str
           ) -> Optional[Dict[str, Any]]:
  spec, a, b = pass_problem(layout, pass_name)
  hit = tables_lib.lookup(table, kernel, pass_name, spec, a, b, dtype,
                          baseline=chain_timing.exact_baseline(kernel))
  return hit if hit is not None and not hit["estimated"] else None


def _dominated(table: Mapping, kernel: str, layout, pass_name: str, dtype: str,
               min_speedup: float) -> Optional[str]:
  """Why the table says this pass cannot reach `min_speedup` at this size, or None."""
  spec, a, b = pass_problem(layout, pass_name)
  flops = tables_lib._flops(tables_lib.problem_sizes(spec, a, b))
  best, shapes = 0.0, 0
  for e in table["entries"]:
    if e["kernel"] != kernel or e["pass"] != pass_name or e.get("dtype", dtype) != dtype:
      continue
    f = tables_lib._flops(tables_lib.problem_sizes(e["spec"], e["lhs_shape"], e["rhs_shape"]))
    if not 1 / CLASS_RATIO <= f / flops <= CLASS_RATIO:
      continue
    hit = tables_lib.lookup(table, kernel, pass_name, e["spec"], e["lhs_shape"],
                            e["rhs_shape"], dtype)
    if hit is None or hit["estimated"]:
      continue
    shapes += 1
    best = max(best, hit["speedup_range"][2])
  if shapes >= DOMINANCE_SHAPES and best <= min_speedup:
    return (f"dominated on this card: at {shapes} timed shapes within {CLASS_RATIO:g}x of "
            f"this one's FLOPs its best speedup was {best:.2f}x <= {min_speedup:g}x")
  return None


def _of_revisions(table: Optional[Mapping], by_name: Mapping) -> Optional[Dict]:
  """`table` without entries of kernels not in `by_name` or of another revision of their
  kernel (they timed other code)."""
  if table is None:
    return None
  return {**table, "entries": [e for e in table["entries"] if e["kernel"] in by_name and
                               e.get("revision", 1) == by_name[e["kernel"]].revision]}


def _combined(table: Optional[Mapping], measured: Optional[Mapping]) -> Optional[Dict]:
  """The committed table with the timing cache's entries merged in as a newer run of this
  card (`timing_table.merge_entries`: each speedup still divides times of one run)."""
  if measured is None:
    return table
  if table is None:
    return dict(measured)
  return tables_lib.merge_entries(table, measured["entries"])


def shape_needs(layout, entries: Sequence[Mapping[str, Any]], kernels: Sequence, dtype: str,
                unsupported: Mapping[str, Mapping[str, str]], criteria,
                table: Optional[Mapping] = None, time_all: bool = False,
                measured: Optional[Mapping] = None) -> ShapeNeeds:
  """Sorts every supported (kernel, pass) of one site shape (see the module docstring).
  `entries`: the report entries of every site of this shape (their passes' errors);
  `table`: this card's committed table (`same_card_table`), or None; `measured`: the
  probe's timing cache as a table of this card, or None. The cache's entries count towards
  dominance only (what they hold of this shape is read from the cache, never re-timed), and
  a pass the cache holds for this shape is never skipped as dominated, so a rerun reports
  what the first run measured."""
  pairs = [(k.name, p) for k in kernels for p in PASSES
           if k.name not in unsupported.get(p, {})]
  if time_all:
    return ShapeNeeds(set(pairs), set(), {})
  by_name = {k.name: k for k in kernels}
  table = _of_revisions(table, by_name)
  measured = _of_revisions(measured, by_name)
  dominance = _combined(table, measured)
  safe = _safe_pairs(entries, [k for k in kernels if k.name != BASELINE], criteria)
  skipped: Dict[Pair, str] = {}
  reused: Set[Pair] = set()
  for k, p in pairs:
    if k == BASELINE:
      continue
    if (k, p) not in safe:
      skipped[(k, p)] = "not timed: no site of this shape admits it on accuracy"
      continue
    if (dominance is not None and criteria.min_speedup is not None
        and by_name[k].sort != FUSED_OP
        and not (measured is not None and _exact(measured, k, layout, p, dtype))):
      why = _dominated(dominance, k, layout, p, dtype, criteria.min_speedup)
      if why:
        skipped[(k, p)] = "not timed: " + why
  if table is not None:
    for k in {k for k, _ in pairs if k != BASELINE}:
      mine = [(k, p) for k2, p in pairs if k2 == k and (k, p) not in skipped]
      if not mine:
        continue
      # A fused op's passes share one timing of its backward: all of them, or none.
      if by_name[k].sort == FUSED_OP:
        if all(_exact(table, k, layout, p, dtype) for _, p in mine):
          reused |= set(mine)
      else:
        reused |= {(k, p) for _, p in mine if _exact(table, k, layout, p, dtype)}
  measure = {kp for kp in pairs if kp not in skipped and kp not in reused}
  # The baseline is timed in a pass only beside a kernel that is; else the table's (or none).
  passes_measured = {p for k, p in measure if k != BASELINE}
  for p in PASSES:
    if (BASELINE, p) in measure and p not in passes_measured:
      measure.discard((BASELINE, p))
      if table is not None and _exact(table, BASELINE, layout, p, dtype):
        reused.add((BASELINE, p))
      else:
        skipped[(BASELINE, p)] = "not timed: no kernel of this pass is"
  return ShapeNeeds(measure, reused, skipped)


def report_needs(report: Mapping[str, Any], table: Optional[Mapping]) -> Dict[str, Any]:
  """What a probe with the errors of `report` (a probe report: its sites, its candidate
  kernels and the criteria it timed for) would time on its card against `table` (the card's
  timing table, entries of the report's jax minor version only; None: none): {"counts":
  {measured, reused, not_safe, dominated, baseline_unneeded}, "measure": {site: sorted
  [(kernel, pass)]}}, one site named for each shape that would time something. What the
  probe's own timing cache holds is left out: this is a fresh workdir's probe."""
  kernels = [registry.get(name) for name in report["kernels"]]
  timed_for = (report.get("timing_source") or {}).get("timed_for") or report["criteria"]
  criteria = eligibility.Criteria(**timed_for)
  dtype = (report.get("evaluation") or {}).get("compute_dtype", "bfloat16")
  by_shape: Dict[Tuple, List[str]] = {}
  for name, site in report["sites"].items():
    key = (site["spec"], site["kind"], tuple(site["shapes"]["lhs"]),
           tuple(site["shapes"]["rhs"]))
    by_shape.setdefault(key, []).append(name)
  counts = dict.fromkeys(("measured", "reused", "not_safe", "dominated", "baseline_unneeded"),
                         0)
  measure: Dict[str, List[Pair]] = {}
  for (spec, kind, lhs, rhs), names in by_shape.items():
    entries = [report["sites"][n] for n in names]
    needs = shape_needs(site_layout(spec, kind, lhs, rhs), entries, kernels, dtype,
                        unsupported_everywhere(entries), criteria, table)
    counts["measured"] += len(needs.measure)
    counts["reused"] += len(needs.reused)
    for (kernel, _), why in needs.skipped.items():
      counts["baseline_unneeded" if kernel == BASELINE else
             "dominated" if "dominated" in why else "not_safe"] += 1
    if needs.measure:
      measure[names[0]] = sorted(needs.measure)
  return {"counts": counts, "measure": measure}


def skipped_info(why: str) -> Dict[str, Any]:
  """A report pass entry's timing fields for a pass not timed."""
  return {"time_us": None, "speedup": None, "backend": None, "timing": SKIPPED,
          "timing_note": why}
