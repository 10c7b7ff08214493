"""Selection: a ProbeReport and error budgets -> a Plan (per site and pass, the fastest
eligible kernel, else xla_bf16).

For every site and separately for fwd, grad_lhs and grad_rhs:
  1. eligibility (`loka_jax/probe/eligibility.py`, on the pessimistic end of every CI) under
     the site's budget: the global Criteria, or the first per-site override whose regex
     fullmatches the site name;
  2. among eligible per-pass kernels, the fastest: highest pessimistic speedup, then highest
     median speedup, then the most accuracy headroom (pessimistic SQNR, or lowest pessimistic
     MERE with metric='mere'), then the kernel name (alphabetical), so ties are deterministic;
  3. nothing eligible: the high-precision fallback xla_bf16, with the reason.
A fused-op kernel (Flax's delayed scaling) runs all three passes or none: it replaces the
per-pass choice only when it is eligible (safe in every pass, and its pessimistic site speedup
over bf16 above `min_speedup`: `eligibility.py`) and its pessimistic whole-site time
(forward + backward, upper CI ends) beats the per-pass choice's; on a tie the stateless
per-pass choice stays. A fused-epilogue kernel (GEMM + BlockNorm + activation) replaces either
where its whole chain saves more (`chain_selection`); serving plans leave it out (the export).

A serving plan (`objective="serve"`) is for inference, which runs forwards only: per site,
the fastest eligible forward judged on the forward pass alone (its SQNR, underflow and
speedup), among per-pass kernels and fused ops alike, since a fused op's backward never runs
there. Ranking as above, except that on a speed tie the candidate whose gradients would be
the most accurate comes first (per-pass kernels leave them to bf16; Flax's delayed ops share
one forward, and the one with bf16 gradients wins). Its gradient passes say so; where the
forward is a fused op they name it too (a fused op runs all passes or none).
`dispatch.export` serves it; training refuses it (`train.experiment.load_plan`).

Timings: the report's own when `timing_valid` (and the target device is the report's);
otherwise a committed timing table of the target device (nearest measured shape, marked
`estimated`); otherwise none, and then no FP8 kernel is fast enough to choose (unless the
criteria ask for accuracy only: `min_speedup=None`). `fill_from_table` takes the passes a
valid report left untimed from its device's table (`timing_source`).
`provenance.timing_source` says which.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax

from loka_jax.probe import timing_table as tables_lib
from loka_jax.plan.file import FALLBACK, SCHEMA, Plan, as_plan
from loka_jax.kernels import FUSED_OP, PASSES, PER_PASS, registry
from loka_jax.dispatch import chain_selection
from loka_jax.dispatch.timing_source import TimingSource, resolve_timing
from loka_jax.probe import eligibility
from loka_jax.probe.eligibility import FUSED_SCOPE, UNRESOLVED, Criteria, Verdict
from loka_jax.probe.report import load_report, validate_report


TRAIN, SERVE = "train", "serve"  # a plan's objective: every pass, or forwards only
OBJECTIVES = (TRAIN, SERVE)


# ----------------------------------------------------------------------------- budgets

@dataclasses.dataclass(frozen=True)
class Budget:
  """The error budget of every site: `default`, or the first `per_site` (regex, Criteria)
  whose pattern fullmatches the site name."""
  default: Criteria = Criteria()
  per_site: Tuple[Tuple[str, Criteria], ...] = ()

  def for_site(self, site: str) -> Criteria:
    for pattern, criteria in self.per_site:
      if re.fullmatch(pattern, site):
        return criteria
    return self.default

  def to_dict(self) -> Dict[str, Any]:
    return {"default": self.default.to_dict(),
            "per_site": [{"pattern": p, "criteria": c.to_dict()} for p, c in self.per_site]}


def make_budget(criteria: Criteria = Criteria(), budget_per_site=None) -> Budget:
  """Budget from the global criteria and per-site overrides: {regex: Criteria | {field:
  value}} or [(regex, Criteria | {field: value})]; dicts override fields of `criteria`."""
  if not isinstance(criteria, Criteria):
    raise TypeError(f"criteria must be an eligibility.Criteria, got {type(criteria).__name__}")
  items = budget_per_site or ()
  if isinstance(items, Mapping):
    items = list(items.items())
  per_site = []
  for pattern, value in items:
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"budget pattern {pattern!r} is not a regex ({e})") from None
    if isinstance(value, Criteria):
      per_site.append((pattern, value))
    elif isinstance(value, Mapping):
      unknown = sorted(set(value) - {f.name for f in dataclasses.fields(Criteria)})
      if unknown:
        raise ValueError(f"budget for {pattern!r}: unknown field(s) {unknown}; Criteria has "
                         f"{[f.name for f in dataclasses.fields(Criteria)]}")
      per_site.append((pattern, dataclasses.replace(criteria, **value)))
    else:
      raise TypeError(f"budget for {pattern!r}: expected Criteria or a dict of its fields, "
                      f"got {type(value).__name__}")
  return Budget(criteria, tuple(per_site))


# ----------------------------------------------------------------------------- timings

def _kernel_object(name: str):
  try:
    return registry.get(name)
  except KeyError:
    return None


def _site_layout(site: Mapping):
  """The site's layout at its full shapes (ValueError where the report's entry is off)."""
  from loka_jax.probe.layout import site_layout
  return site_layout(site["spec"], site["kind"], site["shapes"]["lhs"], site["shapes"]["rhs"])


def _unresolve_report_timings(site: Mapping, passes: Dict[str, Dict[str, Dict]]) -> None:
  """Takes back speedups a measured report holds that no timing resolves (an outer product;
  a chained call under a kernel's own cost): reports made before the probe judged them."""
  from loka_jax.probe import kernel_timing
  if not site.get("spec"):
    return
  try:
    layout = _site_layout(site)
  except (ValueError, KeyError):
    return
  median = lambda times: (times or [None, None])[1]  # noqa: E731
  for p, ks in passes.items():
    for k, e in ks.items():
      if k == FALLBACK or not e.get("speedup"):
        continue
      whole_backward = bool(e.get("time_scope"))  # compared with the baseline's one-call bwd
      base = e.get("baseline_us") if whole_backward else ks.get(FALLBACK, {}).get("time_us")
      kernel_timing.mark_unresolved(e, kernel_timing.unresolved_reason(
          layout, p, median(e.get("time_us")), median(base), whole_backward=whole_backward))


def _table_timings(site: Mapping, name: str, kernels: Sequence, dtype: str,
                   table: Mapping) -> Tuple[Dict[str, Dict[str, Dict]], Optional[str]]:
  """({pass: {kernel: timing fields}}, problem) from a table, at the site's full shapes."""
  from loka_jax.probe import chain_timing
  if not site.get("spec"):
    return {}, f"site {name} has no 'spec' in the report: no table lookup"
  try:
    layout = _site_layout(site)
  except ValueError as e:
    return {}, f"site {name}: {e}"
  unsupported = {p: {k: e.get("error", "unsupported") for k, e in ks.items()
                     if e.get("unsupported")} for p, ks in site.get("passes", {}).items()}
  return chain_timing.table_timings(layout, kernels, dtype, table, unsupported=unsupported), None


TIMING_FIELDS = ("time_us", "speedup", "timing", "time_scope", "backend", "estimated_from",
                 "timing_note")


def effective_site(report: Mapping, name: str, source: TimingSource) -> Tuple[Dict, List[str]]:
  """The site's report entry with every kernel entry's timing fields taken from `source`,
  and notes on what could not be timed."""
  site = report["sites"][name]
  notes: List[str] = []
  passes = {p: {k: dict(e) for k, e in ks.items()} for p, ks in site.get("passes", {}).items()}
  if source.kind == "report":
    for ks in passes.values():
      for e in ks.values():
        e.setdefault("timing", "measured" if e.get("speedup") else "missing")
    _unresolve_report_timings(site, passes)
    if source.table is not None:  # fill_from_table: the passes the probe left untimed
      untimed = {(p, k) for p, ks in passes.items() for k, e in ks.items()
                 if k != FALLBACK and not e.get("speedup") and not e.get("unsupported")
                 and e.get("timing") != UNRESOLVED}
      # bf16 is looked up too: each filled speedup is against the table's own baseline.
      timings = _timings_of(report, site, name, {FALLBACK} | {k for _, k in untimed}, source,
                            notes)
      for p, k in untimed:
        if timings.get(p, {}).get(k, {}).get("speedup"):
          for f in TIMING_FIELDS:
            passes[p][k].pop(f, None)
          passes[p][k].update(timings[p][k])
    return {**site, "passes": passes}, notes
  names = {k for ks in passes.values() for k in ks}
  timings = (_timings_of(report, site, name, names, source, notes)
             if source.kind == "table" else {})
  for p, ks in passes.items():
    for k, e in ks.items():
      for f in TIMING_FIELDS:
        e.pop(f, None)
      t = timings.get(p, {}).get(k)
      e.update(t if t else {"time_us": None, "speedup": None, "timing": "missing"})
  return {**site, "passes": passes}, notes


def _timings_of(report: Mapping, site: Mapping, name: str, names, source: TimingSource,
                notes: List[str]) -> Dict[str, Dict[str, Dict]]:
  """{pass: {kernel: timing fields}} of the named kernels from `source`'s table."""
  kernels = [k for k in (_kernel_object(n) for n in sorted(names))
             if k and chain_selection.timed(k)]
  dtype = (report.get("evaluation") or {}).get("compute_dtype", "bfloat16")
  timings, problem = _table_timings(site, name, kernels, dtype, source.table)
  if problem:
    notes.append(problem)
  return timings


# ----------------------------------------------------------------------------- ranking

def _num(x: Optional[float]) -> float:
  return -math.inf if x is None else float(x)


def _accuracy(v: Verdict, metric: str) -> float:
  """Higher is more accurate: pessimistic SQNR, or minus pessimistic MERE."""
  if metric == "mere":
    return -math.inf if v.mere_hi is None else -float(v.mere_hi)
  return _num(v.sqnr_lo)


def rank_key(v: Verdict, metric: str):
  """Sort key of eligible kernels, best first (see the module docstring)."""
  return (-_num(v.speedup_lo), -_num(v.speedup_mid), -_accuracy(v, metric), v.kernel)


def _lead(entry: Mapping, criteria: Criteria, what: str) -> str:
  """How a choice's reason starts; on accuracy alone the fastest safe kernel can be slower
  than bf16 (median speedup below 1), and the reason says so."""
  speedup = entry.get("speedup")
  return (f"fastest eligible{what}" if criteria.min_speedup is not None else
          f"most accurate safe{what} (accuracy only, speed unknown)" if not speedup else
          f"safe{what}, chosen on accuracy only, slower than bf16" if speedup[1] < 1 else
          f"fastest safe{what} (accuracy only)")


def _speed_text(entry: Mapping) -> str:
  s = entry.get("speedup")
  if not s:
    if entry.get("timing") == UNRESOLVED:
      return "speed unresolved"
    return entry.get("timing_note") or "speed unknown"
  text = f"{s[1]:.2f}x [{s[0]:.2f}, {s[-1]:.2f}]"
  if entry.get("timing") in ("estimated", "table"):
    text += f" ({entry['timing']})"
  return text


def _accuracy_text(v: Verdict, metric: str) -> str:
  if metric == "mere":
    return "MERE -" if v.mere_hi is None else f"MERE {v.mere_hi:.3g}"
  return "SQNR -" if v.sqnr_lo is None else f"{v.sqnr_lo:.1f} dB"


def _details(v: Verdict, entry: Mapping) -> Dict[str, Any]:
  return {"speedup": entry.get("speedup"), "timing": entry.get("timing"),
          "sqnr_db_lo": v.sqnr_lo, "mere_hi": v.mere_hi, "underflow_hi": v.underflow_hi}


def _time_hi(entry: Optional[Mapping]) -> Optional[float]:
  t = None if entry is None else entry.get("time_us")
  return None if not t else float(t[-1])


# ----------------------------------------------------------------------------- one site

def select_site(report: Mapping, name: str, criteria: Criteria, source: TimingSource,
                info: Mapping[str, Mapping]) -> Dict[str, Dict[str, Any]]:
  """{pass: {"kernel", "reason", details}} of one site."""
  site, notes = effective_site(report, name, source)
  verdicts = eligibility.assess_site({"kernels": info, "sites": {name: site}}, name,
                                     criteria)
  no_timing = source.kind == "none" and criteria.min_speedup is not None
  out: Dict[str, Dict[str, Any]] = {}
  for p in PASSES:
    entries = site["passes"].get(p, {})
    pass_verdicts = verdicts.get(p, {})
    if not pass_verdicts:
      out[p] = {"kernel": FALLBACK, "reason": f"pass {p} not evaluated in the report"}
      continue
    usable, skipped = {}, []
    for k, v in pass_verdicts.items():
      if k == FALLBACK:
        continue
      meta = info.get(k, {})
      if _kernel_object(k) is None:
        skipped.append(f"{k} not registered here")
      elif meta.get("sort") == PER_PASS:
        usable[k] = v
    eligible = sorted((v for v in usable.values() if v.eligible),
                      key=lambda v: rank_key(v, criteria.metric))
    if eligible:
      best = eligible[0]
      e = entries[best.kernel]
      lead = _lead(e, criteria, "")
      speed = f"{_speed_text(e)}, " if e.get("speedup") else ""
      out[p] = {"kernel": best.kernel,
                "reason": f"{lead}: {speed}{_accuracy_text(best, criteria.metric)}",
                **_details(best, e)}
      continue
    out[p] = {"kernel": FALLBACK, "reason": _no_eligible_reason(
        usable, entries, criteria, no_timing, source, notes + skipped)}
  _consider_fused(out, site, verdicts, criteria, info)
  chain_selection.consider_chains(out, site, verdicts, criteria)
  return out


def _no_eligible_reason(usable: Mapping[str, Verdict], entries: Mapping, criteria: Criteria,
                        no_timing: bool, source: TimingSource, notes: Sequence[str]) -> str:
  if not usable:
    text = "no FP8 candidate evaluated for this pass"
    return text + (f" ({'; '.join(notes)})" if notes else "")
  closest = sorted(usable.values(), key=lambda v: (not v.safe,) + rank_key(v, criteria.metric))[0]
  if no_timing:
    safe = sorted((v for v in usable.values() if v.safe),
                  key=lambda v: (-_accuracy(v, criteria.metric), v.kernel))
    text = f"no FP8 without timings: {source.reason}"
    if safe:
      text += "; safe: " + ", ".join(f"{v.kernel} ({_accuracy_text(v, criteria.metric)})"
                                     for v in safe[:3])
    return text
  speed = _speed_text(entries.get(closest.kernel, {}))
  text = f"no eligible kernel: best {closest.kernel} {speed}: {'; '.join(closest.reasons)}"
  return text + (f" ({'; '.join(notes)})" if notes else "")


def _consider_fused(out: Dict[str, Dict], site: Mapping, verdicts: Mapping,
                    criteria: Criteria, info: Mapping) -> None:
  """Swaps the per-pass choice for an eligible fused op whose pessimistic site time wins."""
  passes = site["passes"]

  def site_time(choice: Mapping[str, str], fused: bool) -> Optional[float]:
    total = 0.0
    for p in PASSES:
      entry = passes.get(p, {}).get(choice[p])
      if fused and p == "grad_rhs" and (passes.get("grad_lhs", {}).get(choice[p]) or {}).get(
          "time_scope") == FUSED_SCOPE:
        continue  # its backward was timed once, under both gradient passes
      t = _time_hi(entry)
      if t is None:
        return None
      total += t
    return total

  mix = {p: out[p]["kernel"] for p in PASSES}
  mix_passes = site_time(mix, fused=False)

  def mix_time(fused_kernel: str) -> Optional[float]:
    # A per-pass choice with bf16 gradients runs the baseline's backward: where the fused op's
    # timing holds that backward timed as one call, as its own was, compare with that rather
    # than with two gradient passes timed apart (each paying a call's fixed cost).
    bwd = (passes.get("grad_lhs", {}).get(fused_kernel) or {}).get("baseline_us")
    t = mix_passes
    if t is None or not bwd or {mix["grad_lhs"], mix["grad_rhs"]} != {FALLBACK}:
      return t
    return _time_hi(passes.get("fwd", {}).get(mix["fwd"])) + float(bwd[-1])

  best = None
  for k, meta in sorted(info.items()):
    if meta.get("sort") != FUSED_OP or _kernel_object(k) is None or \
        chain_selection.is_chain_kernel(k):
      continue
    vs = [verdicts.get(p, {}).get(k) for p in PASSES]
    if not all(v is not None and v.eligible for v in vs):
      continue
    t, against = site_time({p: k for p in PASSES}, fused=True), mix_time(k)
    if t is None or against is None or not t < against:
      continue
    if best is None or t < best[1]:
      best = (k, t, against)
  if best is None:
    return
  k, t, against = best
  for p in PASSES:
    v = verdicts[p][k]
    e = passes[p][k]
    out[p] = {"kernel": k,
              "reason": f"fused op safe in every pass and faster: site time {t:.1f} us vs "
                        f"{against:.1f} us per-pass (pessimistic); {p} {_speed_text(e)}, "
                        f"{_accuracy_text(v, criteria.metric)}",
              **_details(v, e)}


def select_serving_site(report: Mapping, name: str, criteria: Criteria, source: TimingSource,
                        info: Mapping[str, Mapping]) -> Dict[str, Dict[str, Any]]:
  """{pass: {"kernel", "reason", details}} of one site for inference (module docstring)."""
  site, notes = effective_site(report, name, source)
  entries = site["passes"].get("fwd", {})
  no_backward = "serving plan: inference runs no backward"
  if not entries:
    return {p: {"kernel": FALLBACK, "reason": "pass fwd not evaluated in the report"
                if p == "fwd" else no_backward} for p in PASSES}
  usable, skipped = {}, []
  for k, e in entries.items():
    if k == FALLBACK:
      continue
    if _kernel_object(k) is None:
      skipped.append(f"{k} not registered here")
    elif info.get(k, {}).get("sort") in (PER_PASS, FUSED_OP) and \
        not chain_selection.is_chain_kernel(k):
      usable[k] = eligibility.assess({**e, "kernel": k}, "fwd", criteria,
                                     fp8=info.get(k, {}).get("fp8", True))
  def gradient_accuracy(kernel: str) -> float:
    # The three delayed ops share one measured forward: on a speed tie, prefer the op whose
    # (never run) gradients are the most accurate, so the plan does not read as FP8
    # gradients; a per-pass kernel leaves them to bf16.
    if info.get(kernel, {}).get("sort") != FUSED_OP:
      return math.inf
    passes = site["passes"]
    return min((_accuracy(eligibility.assess({**passes[p][kernel], "kernel": kernel}, p,
                                             criteria), criteria.metric)
                for p in PASSES[1:] if kernel in passes.get(p, {})), default=-math.inf)

  eligible = sorted((v for v in usable.values() if v.eligible),
                    key=lambda v: (-_num(v.speedup_lo), -_num(v.speedup_mid),
                                   -gradient_accuracy(v.kernel),
                                   -_accuracy(v, criteria.metric), v.kernel))
  if not eligible:
    no_timing = source.kind == "none" and criteria.min_speedup is not None
    return {p: {"kernel": FALLBACK, "reason": _no_eligible_reason(
        usable, entries, criteria, no_timing, source, notes + skipped) if p == "fwd"
        else no_backward} for p in PASSES}
  best = eligible[0]
  e = entries[best.kernel]
  lead = _lead(e, criteria, " forward (serving)")
  speed = f"{_speed_text(e)}, " if e.get("speedup") else ""
  out = {"fwd": {"kernel": best.kernel,
                 "reason": f"{lead}: {speed}{_accuracy_text(best, criteria.metric)}",
                 **_details(best, e)}}
  fused = info.get(best.kernel, {}).get("sort") == FUSED_OP
  for p in PASSES[1:]:
    out[p] = {"kernel": best.kernel if fused else FALLBACK,
              "reason": no_backward + (f" (the fused op {best.kernel} names every pass)"
                                       if fused else "")}
  return out


# ----------------------------------------------------------------------------- the plan

def report_hash(report: Mapping) -> str:
  """sha256 of the report's canonical JSON (sorted keys, no spaces)."""
  text = json.dumps(report, sort_keys=True, separators=(",", ":"), allow_nan=False)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def kernels_info(report: Mapping) -> Dict[str, Dict[str, Any]]:
  """The report's kernel metadata, completed from the registry for unlisted kernels."""
  info = {k: dict(v) for k, v in (report.get("kernels") or {}).items()}
  names = {k for s in report["sites"].values() for ks in s.get("passes", {}).values()
           for k in ks}
  for n in sorted(names):
    kernel = _kernel_object(n)
    if kernel is None:
      info.setdefault(n, {"sort": None, "fp8": n != FALLBACK})
      continue
    info.setdefault(n, {})
    info[n].setdefault("sort", kernel.sort)
    info[n].setdefault("fp8", kernel.fp8)
  return info


def select(report: Union[Mapping, str], criteria: Optional[Criteria] = None, *,
           budget_per_site=None, timing_table=None, target_device: Optional[str] = None,
           table_dir: str = tables_lib.TIMINGS_DIR, objective: str = TRAIN,
           fill_from_table: bool = False, **criteria_fields) -> Plan:
  """The Plan for a ProbeReport (a loaded report or its path) under the error budget.

  Args:
    report: a `loka.probe/2` report or the path of one.
    criteria: the global budget (eligibility.Criteria; metric='mere' for paper parity).
    **criteria_fields: Criteria fields that replace the default's (or `criteria`'s), e.g.
      `select(report, min_sqnr_fwd_db=30, min_speedup=None)`.
    budget_per_site: per-site budgets, {regex: Criteria | {field: value}} or a list of pairs;
      the first regex that fullmatches a site name wins.
    timing_table: a committed table (path, device kind or loaded dict) to use when the
      report's timings are not valid for the target (or, with `fill_from_table`, to fill the
      passes a valid report left untimed).
    target_device: the device kind the plan is for (default: the report's device).
    table_dir: where committed tables live.
    objective: "train" (every pass) or "serve" (forwards only, for `dispatch.export`).
    fill_from_table: with a valid report, its untimed kernel passes from its device's table
      (`timing_source.resolve_timing`).
  """
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
  criteria = (Criteria() if criteria is None else criteria).replaced(**criteria_fields)
  path = None
  if isinstance(report, (str, os.PathLike)):
    path = os.fspath(report)
    report = load_report(path)
  else:
    validate_report(report, "<report>")
  budget = make_budget(criteria, budget_per_site)
  source = resolve_timing(report, timing_table=timing_table, target_device=target_device,
                          table_dir=table_dir, fill_from_table=fill_from_table)
  info = kernels_info(report)
  select_one = select_serving_site if objective == SERVE else select_site
  sites = {name: select_one(report, name, budget.for_site(name), source, info)
           for name in report["sites"]}
  provenance = {
      "report_sha256": report_hash(report), "report_path": path,
      "report_device": report.get("device"), "report_created": report.get("created"),
      "report_complete": report.get("complete", True),
      "device": source.info.get("device"), "jax": report.get("jax"),
      "selected_with_jax": jax.__version__,
      "created": datetime.datetime.now().isoformat(timespec="seconds"),
      "budget": budget.to_dict(), "timing_source": source.info, "objective": objective}
  if report.get("pending"):
    provenance["report_pending"] = list(report["pending"])
  return Plan({"schema": SCHEMA, "model": report.get("model"), "preset": report.get("preset"),
               "provenance": provenance, "sites": sites, "rules": [],
               "default": {p: FALLBACK for p in PASSES}, "validation": []})


# ----------------------------------------------------------------------------- serving promotion

def serving_proposal(report: Mapping, selected: Plan, criteria: Criteria = Criteria(), *,
                     budget_per_site=None, timing_table=None,
                     target_device: Optional[str] = None,
                     table_dir: str = tables_lib.TIMINGS_DIR,
                     fill_from_table: bool = False) -> Tuple[Plan, List[str]]:
  """(the serving plan `selected` with more FP8 forwards, the sites it changed): each site
  `selected` serves in xla_bf16 takes the serving choice of the same budget without its speed
  bar (`min_speedup=None`: the fastest forward safe on accuracy alone) when the export serves
  that kernel as a static-scale e4m3 dot (`export.serves_static_fp8`: tensorwise or rowwise).

  Why a proposal: selection judges a serving forward on the probe's timing of the kernel
  itself, which quantizes its weight and reduces an activation amax on every call. The export
  does neither (weights stored in e4m3, activation scales static), so a forward the probe
  timed at 1.03x alone can serve much faster: at the 8192x2048x8 tower the delayed
  forward's per-site speedup read 1.08x in one probe and 1.03x in the next, the serving plan
  went from 8 FP8 forwards to none, and this proposal's export then served 1.58x faster than
  that plan's (H200). Only the served
  step can tell; `bench.suite` times both exports in one interleaving."""
  from loka_jax.dispatch.export import serves_static_fp8
  accuracy_only = dataclasses.replace(criteria, min_speedup=None)
  relaxed = select(report, accuracy_only, budget_per_site=budget_per_site,
                   timing_table=timing_table, target_device=target_device,
                   table_dir=table_dir, objective=SERVE, fill_from_table=fill_from_table)
  data = as_plan(selected).to_dict()
  changed = []
  for name, entry in relaxed["sites"].items():
    current = data["sites"].get(name)
    kernel = entry["fwd"]["kernel"]
    if (current is None or current["fwd"]["kernel"] != FALLBACK or kernel == FALLBACK
        or not serves_static_fp8(kernel)):
      continue
    data["sites"][name] = {
        p: {**e, "reason": f"serving promotion from {FALLBACK}: {e['reason']}",
            "promoted_from": FALLBACK} for p, e in entry.items()}
    changed.append(name)
  return Plan(data), changed
