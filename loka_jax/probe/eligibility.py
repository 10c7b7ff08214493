"""Which kernel may run which pass of which site: the rule Probe reports and Dispatch selects by.

Default (DESIGN.md "Numerics conventions"), always on the pessimistic end of each 95% CI:
  accurate   SQNR lower bound >= 25 dB (fwd) / >= 20 dB (grad_lhs, grad_rhs);
             or, with metric='mere' (paper parity), MERE upper bound < 0.2
  no flush   underflow upper bound <= 1% for every quantized operand
  fast       speedup lower bound vs xla_bf16 > 1.05x (min_speedup=None: accuracy only)
A kernel is *safe* when accurate with no flush, *eligible* when safe and fast. A fused-op
kernel runs all passes or none, so it is eligible only where every pass is.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

from loka_jax.kernels import PASSES
from loka_jax.probe.candidates import BASELINE

METRICS = ("sqnr", "mere")


@dataclasses.dataclass(frozen=True)
class Criteria:
  """Thresholds of eligibility (see the module docstring)."""
  metric: str = "sqnr"
  min_sqnr_fwd_db: float = 25.0
  min_sqnr_grad_db: float = 20.0
  max_mere: float = 0.2
  max_underflow: float = 0.01
  min_speedup: Optional[float] = 1.05

  def __post_init__(self):
    if self.metric not in METRICS:
      raise ValueError(f"metric={self.metric!r}; use one of {METRICS}")

  def to_dict(self):
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The judgement of one kernel on one pass of one site."""
  kernel: str
  pass_name: str
  safe: bool
  fast: Optional[bool]          # None: no speedup known (or none required)
  eligible: bool
  reasons: Tuple[str, ...]      # why not safe / not fast
  sqnr_lo: Optional[float] = None
  mere_hi: Optional[float] = None
  underflow_hi: Optional[float] = None
  speedup_lo: Optional[float] = None
  speedup_mid: Optional[float] = None

  def to_dict(self):
    out = dataclasses.asdict(self)
    out["reasons"] = list(self.reasons)
    return out


def _lo(v):
  return None if v is None else v[0]


def _hi(v):
  return None if v is None else v[-1]


def assess(entry: Mapping, pass_name: str, criteria: Criteria = Criteria(),
           fp8: bool = True) -> Verdict:
  """Verdict for one report entry (`report['sites'][s]['passes'][p][kernel]`)."""
  kernel = entry.get("kernel", "?")
  reasons = []
  sqnr_lo = _lo(entry.get("sqnr_db"))
  mere_hi = _hi(entry.get("mere"))
  if entry.get("error"):
    reasons.append(entry["error"])
  if criteria.metric == "sqnr":
    bar = criteria.min_sqnr_fwd_db if pass_name == "fwd" else criteria.min_sqnr_grad_db
    if sqnr_lo is None:
      reasons.append("no SQNR")
    elif sqnr_lo < bar:
      reasons.append(f"SQNR {sqnr_lo:.1f} dB < {bar:g} dB")
  else:
    if mere_hi is None:
      reasons.append("no MERE")
    elif mere_hi >= criteria.max_mere:
      reasons.append(f"MERE {mere_hi:.3g} >= {criteria.max_mere:g}")
  underflow_hi = None
  if fp8:
    operands = entry.get("operands") or {}
    values = {name: _hi(o.get("underflow")) for name, o in operands.items()}
    known = {n: v for n, v in values.items() if v is not None}
    if not known:
      reasons.append("underflow not measured")
    else:
      underflow_hi = max(known.values())
      for name, v in sorted(known.items()):
        if v > criteria.max_underflow:
          reasons.append(f"{name} underflow {100 * v:.1f}% > {100 * criteria.max_underflow:g}%")
  safe = not reasons
  speed = entry.get("speedup")
  speedup_lo, speedup_mid = _lo(speed), (None if speed is None else speed[1])
  if criteria.min_speedup is None:
    fast = None
  elif speedup_lo is None:
    fast = None
    reasons.append("no timing")
  else:
    fast = speedup_lo > criteria.min_speedup
    if not fast:
      reasons.append(f"speedup {speedup_lo:.2f}x <= {criteria.min_speedup:g}x")
  eligible = safe and (fast is True or criteria.min_speedup is None)
  return Verdict(kernel, pass_name, safe, fast, eligible, tuple(reasons), sqnr_lo, mere_hi,
                 underflow_hi, speedup_lo, speedup_mid)


def assess_site(report: Mapping, site: str, criteria: Criteria = Criteria()
                ) -> Dict[str, Dict[str, Verdict]]:
  """{pass: {kernel: Verdict}} of one site of a ProbeReport."""
  info = report.get("kernels", {})
  entry = report["sites"][site]
  verdicts: Dict[str, Dict[str, Verdict]] = {}
  for p, kernels in entry.get("passes", {}).items():
    verdicts[p] = {}
    for name, e in kernels.items():
      fp8 = info.get(name, {}).get("fp8", name != BASELINE)
      verdicts[p][name] = assess({**e, "kernel": name}, p, criteria, fp8=fp8)
  for name, meta in info.items():
    if meta.get("sort") != "fused_op":
      continue
    per_pass = [verdicts.get(p, {}).get(name) for p in PASSES]
    if all(v is not None for v in per_pass) and not all(v.eligible for v in per_pass):
      for p in PASSES:
        v = verdicts[p][name]
        if v.eligible:
          verdicts[p][name] = dataclasses.replace(
              v, eligible=False, reasons=v.reasons + ("fused op: not every pass is eligible",))
  return verdicts


def best_kernel(verdicts: Mapping[str, Verdict]) -> Verdict:
  """The best kernel of one pass: the eligible one with the highest pessimistic speedup
  (then SQNR); else, where speed is unknown (no timing), the safe FP8 kernel with the
  highest pessimistic SQNR (its verdict says eligible=False, fast=None); else xla_bf16."""
  eligible = [v for k, v in verdicts.items() if v.eligible and k != BASELINE]
  sqnr = lambda v: v.sqnr_lo if v.sqnr_lo is not None else -1e9
  if eligible:
    return max(eligible, key=lambda v: (v.speedup_lo if v.speedup_lo is not None else -1.0,
                                        sqnr(v)))
  untimed = [v for k, v in verdicts.items() if k != BASELINE and v.safe and v.fast is None]
  if untimed:
    return max(untimed, key=sqnr)
  if BASELINE in verdicts:
    return verdicts[BASELINE]
  pass_name = next(iter(verdicts.values())).pass_name if verdicts else "fwd"
  return Verdict(BASELINE, pass_name, True, None, False, ("baseline not evaluated",))


def summarize_report(report: Mapping, criteria: Criteria = Criteria()) -> Dict[str, Dict]:
  """{site: {pass: best Verdict}} over a report."""
  out = {}
  for site in report["sites"]:
    verdicts = assess_site(report, site, criteria)
    out[site] = {p: best_kernel(v) for p, v in verdicts.items()}
  return out
