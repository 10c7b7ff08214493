"""Drift valve: when a site's statistics shift during training, re-evaluate its kernels.

The probe refreshes every site's statistics at its cadence (the report's `stats`). Between an
old and a new refresh, per operand (lhs, rhs, grad), the shift measures are:

  crest_log2      |log2(crest_new / crest_old)|, crest = amax / typical magnitude (`std.median`
                  of an activation or gradient, `rms` of a weight). Scaling maps amax to the
                  top of the FP8 range, so a crest that grows pushes typical values toward
                  underflow. Bound 1.0: a factor of two, one binade.
  spread_log2     |log2(spread_new / spread_old)|, spread = `std_max_over_median` (activation,
                  gradient) or `col_rms_max_over_median` (weight): outlier channels along the
                  contraction, the hazard that output SQNR alone misses. Bound 1.0.
  underflow       the largest increase, over passes, formats and granularities, of the mean
                  fraction of values current scaling flushes to zero (`flush`). Bound 0.005,
                  half of the 1% eligibility bar.
  saturation      increase of `amax.delayed_saturation_mean` (what delayed scaling clips).
                  Bound 0.01.

A site with any measure beyond its bound has shifted. `reselect_drifted` then judges each pass
of its current kernel on the new report: a kernel that is no longer safe is switched to the
new fastest eligible one (else xla_bf16); a safe one stays (speed does not drift). Each
decision is appended to the plan's `validation` as a `drift` step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Tuple

from loka_jax.dispatch import selection
from loka_jax.probe import timing_table as tables_lib
from loka_jax.plan.file import FALLBACK, Plan, add_validation, as_plan
from loka_jax.kernels import PASSES, KernelChoice
from loka_jax.probe import eligibility
from loka_jax.probe.eligibility import Criteria

OPERANDS = ("lhs", "rhs", "grad")


@dataclasses.dataclass(frozen=True)
class DriftBound:
  """How far statistics may move before a site is re-evaluated (module docstring)."""
  max_crest_log2: float = 1.0
  max_spread_log2: float = 1.0
  max_underflow_increase: float = 0.005
  max_saturation_increase: float = 0.01


@dataclasses.dataclass(frozen=True)
class SiteDrift:
  """The shift of one site between two refreshes."""
  site: str
  shifted: bool
  measures: Dict[str, float]
  reasons: Tuple[str, ...]

  def to_dict(self):
    return {"site": self.site, "shifted": self.shifted, "measures": dict(self.measures),
            "reasons": list(self.reasons)}


def _typical(op: Mapping) -> Optional[float]:
  if "rms" in op:
    return op.get("rms")
  return (op.get("std") or {}).get("median")


def _amax(op: Mapping) -> Optional[float]:
  amax = (op.get("amax") or {}).get("last")
  if amax is None and "abs_max" in op:
    amax = op["abs_max"]
  return amax


def _spread(op: Mapping) -> Optional[float]:
  return op.get("std_max_over_median", op.get("col_rms_max_over_median"))


def _log2_ratio(new: Optional[float], old: Optional[float]) -> Optional[float]:
  if not new or not old or new <= 0 or old <= 0:
    return None
  return abs(math.log2(new / old))


def _flush_increase(old: Mapping, new: Mapping) -> Optional[float]:
  """Largest increase of a mean flush fraction over uses, formats and granularities."""
  worst = None
  for use, by_stat in (new.get("flush") or {}).items():
    before = ((old.get("flush") or {}).get(use) or {}).get("mean") or {}
    for fmt, grans in (by_stat.get("mean") or {}).items():
      for gran, value in grans.items():
        prev = (before.get(fmt) or {}).get(gran)
        if value is None or prev is None:
          continue
        d = float(value) - float(prev)
        worst = d if worst is None else max(worst, d)
  return worst


def site_drift(site: str, old_stats: Mapping, new_stats: Mapping,
               bound: DriftBound = DriftBound()) -> SiteDrift:
  """The shift measures of one site (its report `stats`, old and new) against `bound`."""
  measures: Dict[str, float] = {}
  reasons: List[str] = []

  def check(name: str, value: Optional[float], limit: float, text: str):
    if value is None:
      return
    measures[name] = value
    if value > limit:
      reasons.append(f"{name} {value:.3g} > {limit:g} ({text})")

  for op in OPERANDS:
    old, new = old_stats.get(op), new_stats.get(op)
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
      continue
    crest_old = (_amax(old) / _typical(old)) if _amax(old) and _typical(old) else None
    crest_new = (_amax(new) / _typical(new)) if _amax(new) and _typical(new) else None
    check(f"{op}.crest_log2", _log2_ratio(crest_new, crest_old), bound.max_crest_log2,
          "amax relative to typical values moved")
    check(f"{op}.spread_log2", _log2_ratio(_spread(new), _spread(old)), bound.max_spread_log2,
          "outlier channels along the contraction changed")
    check(f"{op}.underflow", _flush_increase(old, new), bound.max_underflow_increase,
          "more values flush to zero")
    sat_old = (old.get("amax") or {}).get("delayed_saturation_mean")
    sat_new = (new.get("amax") or {}).get("delayed_saturation_mean")
    if sat_old is not None and sat_new is not None:
      check(f"{op}.saturation", float(sat_new) - float(sat_old), bound.max_saturation_increase,
            "delayed scaling clips more")
  return SiteDrift(site, bool(reasons), measures, tuple(reasons))


def _site_stats(source: Mapping) -> Dict[str, Mapping]:
  """{site: stats} of a report or of such a dict."""
  if "sites" in source and isinstance(source["sites"], Mapping):
    return {n: s.get("stats", {}) for n, s in source["sites"].items()}
  return dict(source)


def drifted_sites(old: Mapping, new: Mapping, bound: DriftBound = DriftBound()
                  ) -> Dict[str, SiteDrift]:
  """{site: SiteDrift} of the sites in both (reports, or {site: stats} dicts)."""
  before, after = _site_stats(old), _site_stats(new)
  return {n: site_drift(n, before[n], after[n], bound) for n in after if n in before}


def reselect_drifted(plan, new_report: Mapping, drifts: Mapping[str, SiteDrift],
                     criteria: Criteria = Criteria(), *, budget_per_site=None,
                     timing_table=None, target_device: Optional[str] = None,
                     table_dir: str = tables_lib.TIMINGS_DIR) -> Tuple[Plan, List[Dict]]:
  """(new plan, drift steps): each shifted site's current kernels judged on `new_report`;
  unsafe ones switched to the new selection (a fused op runs all passes or none)."""
  plan = as_plan(plan)
  budget = selection.make_budget(criteria, budget_per_site)
  source = selection.resolve_timing(new_report, timing_table=timing_table,
                                    target_device=target_device, table_dir=table_dir)
  info = selection.kernels_info(new_report)
  data = plan.to_dict()
  steps: List[Dict] = []
  for name, drift in drifts.items():
    if not drift.shifted:
      continue
    if name not in new_report["sites"]:
      steps.append({"step": "drift", "site": name, "measures": drift.measures,
                    "reasons": list(drift.reasons), "action": "not in the new report: kept"})
      continue
    site_criteria = budget.for_site(name)
    current = plan.choice_for(name) or KernelChoice.uniform(FALLBACK)
    site, _ = selection.effective_site(new_report, name, source)
    verdicts = eligibility.assess_site({"kernels": info, "sites": {name: site}}, name,
                                       site_criteria)
    unsafe = {}
    for p in PASSES:
      k = current.for_pass(p)
      v = verdicts.get(p, {}).get(k)
      if k == FALLBACK:
        continue
      if v is None:
        unsafe[p] = f"{k} not evaluated in the new report"
      elif not v.safe:
        unsafe[p] = f"{k}: {'; '.join(r for r in v.reasons if not r.startswith('speedup'))}"
    fresh = selection.select_site(new_report, name, site_criteria, source, info)
    fused = {p for p in PASSES if info.get(current.for_pass(p), {}).get("sort") == "fused_op"}
    switch = set(unsafe) | (set(PASSES) if fused & set(unsafe) else set())
    # A new fused op replaces all passes or none: keep its per-pass equivalents apart.
    fresh_fused = {p for p in PASSES if info.get(fresh[p]["kernel"], {}).get("sort") == "fused_op"}
    if fresh_fused and switch != set(PASSES):
      fresh = {p: fresh[p] if p not in fresh_fused else
               {"kernel": FALLBACK, "reason": "the new fused-op choice needs every pass"}
               for p in PASSES}
    entry = data["sites"].get(name) or {
        p: {"kernel": current.for_pass(p), "reason": "from a rule or the default"}
        for p in PASSES}
    switched = {}
    for p in sorted(switch, key=PASSES.index):
      new_entry = dict(fresh[p])
      new_entry["reason"] = (f"drift: {unsafe.get(p, 'fused op switched as a whole')}; now "
                             f"{new_entry['reason']}")
      switched[p] = [entry[p]["kernel"], new_entry["kernel"]]
      entry[p] = new_entry
    data["sites"][name] = entry
    steps.append({"step": "drift", "site": name, "measures": drift.measures,
                  "reasons": list(drift.reasons), "switched": switched,
                  "kept": [p for p in PASSES if p not in switched],
                  "action": "switched" if switched else "kernels still safe: kept"})
  out = Plan(data)
  for step in steps:
    out = add_validation(out, step)
  return out, steps
