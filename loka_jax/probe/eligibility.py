"""Which kernel may run which pass of which site: the rule Probe reports and Dispatch selects by.

Default, always on the pessimistic end of each 95% CI:
  accurate   SQNR lower bound >= 25 dB (fwd) / >= 20 dB (grad_lhs, grad_rhs; the weight
             gradient's bar can be set apart, `min_sqnr_wgrad_db`);
             or, with metric='mere' (paper parity), MERE upper bound < 0.2
  no flush   underflow upper bound <= 1% for every quantized operand
  fast       speedup lower bound vs xla_bf16 > 1.05x (min_speedup=None: accuracy only)
A kernel is *safe* when accurate with no flush, *eligible* when safe and fast. A fused-op
kernel runs all passes or none, so it must be safe in every pass, and it is fast when the whole
site is: its pessimistic site speedup (the baseline's time of every timed scope over the op's
time at each scope's speedup lower bound) exceeds `min_speedup`. A pass it keeps in bf16 by
design (the gradients of `flax_fp8_delayed_fwd`) thus costs the site nothing but its share.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

from loka_jax.kernels import PASSES
from loka_jax.probe.candidates import BASELINE

METRICS = ("sqnr", "mere")


@dataclasses.dataclass(frozen=True)
class Criteria:
  """Thresholds of eligibility (see the module docstring)."""
  metric: str = "sqnr"
  min_sqnr_fwd_db: float = 25.0
  min_sqnr_grad_db: float = 20.0
  # The weight gradient's (grad_rhs) bar, where it should differ from the input gradient's;
  # None: `min_sqnr_grad_db`. An input gradient's error travels down every layer below and
  # into the embeddings; a weight gradient's stays in one matrix's Adam update. At Wukong
  # `large`, Flax's FP8 weight gradients everywhere (down to -4.8 dB pessimistic) trained
  # 500 steps as well as bf16 at one seed, while FP8 input gradients at 32 sites stopped
  # training from the probe's state, which sits on a plateau runs leave at their own times,
  # as did the same plan trained from initialization (H200).
  min_sqnr_wgrad_db: Optional[float] = None
  max_mere: float = 0.2
  max_underflow: float = 0.01
  min_speedup: Optional[float] = 1.05

  def __post_init__(self):
    if self.metric not in METRICS:
      raise ValueError(f"metric={self.metric!r}; use one of {METRICS}")

  def to_dict(self):
    return dataclasses.asdict(self)

  def replaced(self, **fields) -> "Criteria":
    """A copy with `fields` changed; a name that is no field is an error listing them."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      raise TypeError(f"unknown criteria {unknown}; Criteria fields are "
                      f"{sorted(f.name for f in dataclasses.fields(self))}")
    return dataclasses.replace(self, **fields)

  def sqnr_bar(self, pass_name: str) -> float:
    """The pessimistic SQNR a kernel needs in `pass_name` (dB)."""
    if pass_name == "fwd":
      return self.min_sqnr_fwd_db
    if pass_name == "grad_rhs" and self.min_sqnr_wgrad_db is not None:
      return self.min_sqnr_wgrad_db
    return self.min_sqnr_grad_db


def criteria_for_error(max_error: Optional[float] = None, metric: str = "sqnr",
                       min_speedup: Optional[float] = Criteria.min_speedup,
                       **bars: Optional[float]) -> Criteria:
  """The budget of one error bound: with metric 'mere' the MERE bound, with 'sqnr' a relative
  RMS error, i.e. SQNR >= -20 log10(max_error) dB in every pass (None: the default bars).
  `bars` (Criteria fields such as min_sqnr_wgrad_db; None ones left out) set the rest, over
  the bound's. ValueError for a bound <= 0 or a name that is no field."""
  fields: Dict[str, object] = {"metric": metric, "min_speedup": min_speedup}
  if max_error is not None:
    if max_error <= 0:
      raise ValueError(f"max_error={max_error}: must be > 0")
    if metric == "mere":
      fields["max_mere"] = max_error
    else:
      bar = -20.0 * math.log10(max_error)
      fields.update(min_sqnr_fwd_db=bar, min_sqnr_grad_db=bar)
  try:
    return Criteria(**fields).replaced(**{k: v for k, v in bars.items() if v is not None})
  except TypeError as e:
    raise ValueError(str(e)) from None


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


FUSED_SCOPE = "grad_lhs+grad_rhs"  # a fused op's backward, timed as one (probe/kernel_timing.py)
UNRESOLVED = "unresolved"  # a timing that says nothing of the kernel's speed (`timing_note`)


def _lo(v):
  return None if v is None else v[0]


def _hi(v):
  return None if v is None else v[-1]


def _accuracy_reasons(entry: Mapping, pass_name: str, criteria: Criteria, fp8: bool):
  """(reasons it is not safe, SQNR lower bound, MERE upper bound, worst underflow upper bound)."""
  reasons = []
  sqnr_lo = _lo(entry.get("sqnr_db"))
  mere_hi = _hi(entry.get("mere"))
  if entry.get("error"):
    reasons.append(entry["error"])
  if criteria.metric == "sqnr":
    bar = criteria.sqnr_bar(pass_name)
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
  return reasons, sqnr_lo, mere_hi, underflow_hi


def _speed_reason(speedup_lo: Optional[float], criteria: Criteria, what: str = "speedup",
                  unknown: str = "no timing"):
  """(fast, reason or None): None when no speedup is required or none is known (`unknown`
  says why)."""
  if criteria.min_speedup is None:
    return None, None
  if speedup_lo is None:
    return None, unknown
  if speedup_lo > criteria.min_speedup:
    return True, None
  return False, f"{what} {speedup_lo:.2f}x <= {criteria.min_speedup:g}x"


def assess(entry: Mapping, pass_name: str, criteria: Criteria = Criteria(),
           fp8: bool = True) -> Verdict:
  """Verdict for one report entry (`report['sites'][s]['passes'][p][kernel]`)."""
  kernel = entry.get("kernel", "?")
  reasons, sqnr_lo, mere_hi, underflow_hi = _accuracy_reasons(entry, pass_name, criteria, fp8)
  safe = not reasons
  speed = entry.get("speedup")
  speedup_lo, speedup_mid = _lo(speed), (None if speed is None else speed[1])
  note = entry.get("timing_note")
  fast, why = _speed_reason(speedup_lo, criteria, unknown=note or "no timing")
  if why:
    reasons.append(why)
  eligible = safe and (fast is True or criteria.min_speedup is None)
  return Verdict(kernel, pass_name, safe, fast, eligible, tuple(reasons), sqnr_lo, mere_hi,
                 underflow_hi, speedup_lo, speedup_mid)


def site_times(passes: Mapping[str, Mapping], kernel: str,
               scopes: Sequence[str] = PASSES) -> Optional[Tuple[float, float]]:
  """(baseline us, kernel us) of a whole site (every pass on `kernel`; the passes `scopes`
  only, when given), pessimistic for the kernel, or None if a pass is untimed.

  Each timed scope (the forward; the backward once when timed as one, `FUSED_SCOPE`, else
  each gradient pass) contributes the baseline's time, `time_us * speedup` at the medians,
  and the kernel's time at the scope's speedup lower bound.
  """
  base_total = op_total = 0.0
  for p in scopes:
    e = passes.get(p, {}).get(kernel) or {}
    if p == "grad_rhs" and ((passes.get("grad_lhs", {}).get(kernel) or {}).get("time_scope")
                            == FUSED_SCOPE):
      continue  # its backward was timed once, under both gradient passes
    t, s = e.get("time_us"), e.get("speedup")
    if not t or not s or s[0] is None or s[0] <= 0:
      return None
    base = float(t[1]) * float(s[1])
    base_total += base
    op_total += base / float(s[0])
  return base_total, op_total


def fused_site_speedup(passes: Mapping[str, Mapping], kernel: str) -> Optional[float]:
  """Pessimistic whole-site speedup of a fused op over the baseline (`site_times`), or None
  if untimed."""
  times = site_times(passes, kernel)
  return times[0] / times[1] if times and times[1] > 0 else None


def choice_savings_us(passes: Mapping[str, Mapping], choice: Mapping[str, str]
                      ) -> Optional[float]:
  """Microseconds a site's choice ({pass: kernel}) saves against bf16, pessimistic as
  `site_times`: each scope's baseline time less the kernel's time at the speedup's lower
  bound, over the passes not in bf16; one kernel in every pass over its whole site (a fused
  op's backward once; a fused-epilogue kernel's against the bf16 chain it is timed beside).
  None where a time it needs is missing."""
  if len(set(choice.values())) == 1:
    kernel = next(iter(choice.values()))
    times = None if kernel == BASELINE else site_times(passes, kernel)
    return 0.0 if kernel == BASELINE else None if times is None else times[0] - times[1]
  saved = 0.0
  for p, kernel in choice.items():
    if kernel != BASELINE:
      times = site_times({p: passes.get(p, {})}, kernel, (p,))
      if times is None:
        return None
      saved += times[0] - times[1]
  return saved


def assess_fused(passes: Mapping[str, Mapping], kernel: str, criteria: Criteria = Criteria(),
                 fp8: bool = True) -> Dict[str, Verdict]:
  """{pass: Verdict} of a fused op: accuracy judged per pass, speed on the whole site
  (`fused_site_speedup`); eligible only if every pass is evaluated and safe and the site fast."""
  entries = {p: passes.get(p, {}).get(kernel) for p in PASSES}
  missing = [p for p, e in entries.items() if e is None]
  site_speedup = None if missing else fused_site_speedup(passes, kernel)
  fast, why = _speed_reason(site_speedup, criteria, "fused op: site speedup")
  accuracy = {p: _accuracy_reasons(e, p, criteria, fp8) for p, e in entries.items() if e}
  all_safe = not missing and not any(reasons for reasons, *_ in accuracy.values())
  out = {}
  for p, (reasons, sqnr_lo, mere_hi, underflow_hi) in accuracy.items():
    safe = not reasons
    if missing:
      reasons = reasons + [f"fused op: {', '.join(missing)} not evaluated"]
    elif why:
      reasons = reasons + [why]
    if safe and not missing and not all_safe:
      reasons = reasons + ["fused op: not every pass is safe"]
    speed = entries[p].get("speedup")
    out[p] = Verdict(kernel, p, safe, fast, all_safe and (fast is True or
                                                           criteria.min_speedup is None),
                     tuple(reasons), sqnr_lo, mere_hi, underflow_hi, _lo(speed),
                     None if speed is None else speed[1])
  return out


def assess_site(report: Mapping, site: str, criteria: Criteria = Criteria()
                ) -> Dict[str, Dict[str, Verdict]]:
  """{pass: {kernel: Verdict}} of one site of a ProbeReport."""
  info = report.get("kernels", {})
  entry = report["sites"][site]
  verdicts: Dict[str, Dict[str, Verdict]] = {}
  passes = entry.get("passes", {})
  fused = {name for name, meta in info.items() if meta.get("sort") == "fused_op"}
  for p, kernels in passes.items():
    verdicts[p] = {}
    for name, e in kernels.items():
      if name not in fused:
        fp8 = info.get(name, {}).get("fp8", name != BASELINE)
        verdicts[p][name] = assess({**e, "kernel": name}, p, criteria, fp8=fp8)
  for name in sorted(fused):
    for p, v in assess_fused(passes, name, criteria, info[name].get("fp8", True)).items():
      verdicts[p][name] = v
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
