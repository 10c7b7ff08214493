"""What a failing check backs off and to which kernel: the more precise kernel or fused op
a site steps down to (`more_precise_kernel`, `more_precise_fused_op`, `back_off_site`), and,
past `max_measured_sites`, the sites ranked from the probe report instead of measured
(`report_scores`, `worst_by_report`)."""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from loka_jax.plan.file import FALLBACK, Plan, back_off
from loka_jax.dispatch.validate.config import ValidationConfig, ValidationContext
from loka_jax.kernels import FUSED_OP, PASSES, PER_PASS, KernelChoice
from loka_jax.kernels import registry


def _site_criteria(plan: Plan, site: str):
  """The site's budget recorded in the plan's provenance (default Criteria without one)."""
  from loka_jax.dispatch.selection import Budget
  from loka_jax.probe.eligibility import Criteria
  budget = (plan.get("provenance") or {}).get("budget")
  if not budget:
    return Criteria()
  per_site = tuple((p["pattern"], Criteria(**p["criteria"])) for p in budget.get("per_site", []))
  return Budget(Criteria(**budget["default"]), per_site).for_site(site)


def _accuracy(verdict, metric: str) -> float:
  if metric == "mere":
    return -math.inf if verdict.mere_hi is None else -float(verdict.mere_hi)
  return -math.inf if verdict.sqnr_lo is None else float(verdict.sqnr_lo)


def _site_verdicts(report: Mapping, plan: Plan, site: str):
  """({pass: {kernel: Verdict}} of the site under its budget, with the report's timings),
  the site's effective report entry, the report's kernel metadata."""
  from loka_jax.dispatch import selection
  from loka_jax.probe import eligibility
  try:
    source = selection.resolve_timing(report)
  except ValueError:
    source = selection.TimingSource("none", {"kind": "none", "reason": "no usable timings"})
  effective, _ = selection.effective_site(report, site, source)
  info = selection.kernels_info(report)
  verdicts = eligibility.assess_site({"kernels": info, "sites": {site: effective}}, site,
                                     _site_criteria(plan, site))
  return verdicts, effective, info


def more_precise_kernel(report: Optional[Mapping], plan: Plan, site: str, pass_name: str,
                        current: str) -> Tuple[str, str]:
  """(kernel, why): the fastest candidate of the report for this pass that is eligible under
  the site's budget and more accurate than `current`; else xla_bf16."""
  if report is None or site not in report.get("sites", {}):
    return FALLBACK, "no probe report entry for the site"
  from loka_jax.dispatch import selection
  criteria = _site_criteria(plan, site)
  all_verdicts, _, info = _site_verdicts(report, plan, site)
  verdicts = all_verdicts.get(pass_name, {})
  if current not in verdicts:
    return FALLBACK, f"{current} was not evaluated by the probe for this pass"
  floor = _accuracy(verdicts[current], criteria.metric)
  better = [v for k, v in verdicts.items()
            if k not in (current, FALLBACK) and v.eligible
            and info.get(k, {}).get("sort") == PER_PASS and k in registry.names()
            and _accuracy(v, criteria.metric) > floor]
  if not better:
    return FALLBACK, "no eligible candidate more accurate than " + current
  best = sorted(better, key=lambda v: selection.rank_key(v, criteria.metric))[0]
  return best.kernel, f"fastest eligible candidate more accurate than {current}"


def more_precise_fused_op(report: Optional[Mapping], plan: Plan, site: str, current: str,
                          must_improve: Sequence[str] = PASSES) -> Tuple[str, str]:
  """(kernel, why): the fastest fused op of the report that is eligible at the site, at least
  as accurate as the fused op `current` in every pass and more accurate in one of
  `must_improve`; else xla_bf16.

  The delayed-scaling ops share one forward and quantize fewer and fewer gradients
  (`flax_fp8_delayed` -> `flax_fp8_delayed_grad_lhs` -> `flax_fp8_delayed_fwd`): a site that
  training found too rough steps down one gradient at a time and keeps its FP8 forward, while
  a forward that held-out loss found too rough (must_improve=("fwd",)) goes to bf16. A pass
  two ops compute alike (`Kernel.pass_numerics`) counts as equally accurate: the probe's
  estimates of a shared forward differ by its samples, and reading them as a difference sent
  a held-out back-off to an op with the same forward."""
  if report is None or site not in report.get("sites", {}):
    return FALLBACK, "no probe report entry for the site"
  from loka_jax.probe import eligibility
  metric = _site_criteria(plan, site).metric
  verdicts, effective, info = _site_verdicts(report, plan, site)
  if any(current not in verdicts.get(p, {}) for p in PASSES):
    return FALLBACK, f"{current} was not evaluated by the probe in every pass"
  floor = {p: _accuracy(verdicts[p][current], metric) for p in PASSES}

  def accuracy(k: str, p: str) -> float:
    # A pass computed as `current` computes it is as accurate, whatever the probe's samples
    # estimated for each (`Kernel.pass_numerics`).
    same = registry.get(k).pass_numerics(p) == registry.get(current).pass_numerics(p)
    return floor[p] if same else _accuracy(verdicts[p][k], metric)

  better = {}
  for k, meta in info.items():
    if k == current or meta.get("sort") != FUSED_OP or k not in registry.names():
      continue
    v = {p: verdicts.get(p, {}).get(k) for p in PASSES}
    if any(x is None or not x.eligible for x in v.values()):
      continue
    if (all(accuracy(k, p) >= floor[p] for p in PASSES)
        and any(accuracy(k, p) > floor[p] for p in must_improve)):
      better[k] = eligibility.fused_site_speedup(effective.get("passes", {}), k) or 0.0
  if not better:
    return FALLBACK, (f"no eligible fused op as accurate as {current} in every pass and more "
                      f"accurate in {'/'.join(must_improve)}")
  best = max(sorted(better), key=lambda k: better[k])
  improved = [p for p in must_improve if accuracy(best, p) > floor[p]]
  return best, (f"{best}: as accurate as {current} in every pass, more in "
                f"{'/'.join(improved)}, site {better[best]:.2f}x over bf16")


def back_off_site(plan: Plan, ctx: ValidationContext, site: str, reason: str, step: str, *,
                  to_fallback: bool = False, must_improve: Sequence[str] = PASSES) -> Plan:
  """Every FP8 pass of `site` moved to a more precise kernel (or straight to xla_bf16 with
  `to_fallback`). A fused op moves to a more precise fused op (`more_precise_fused_op`, which
  must improve one of `must_improve`) or to xla_bf16."""
  choice = plan.choice_for(site)
  kernels = {p: choice.for_pass(p) for p in PASSES}
  if to_fallback:
    return back_off(plan, site, None, reason, to=FALLBACK, step=step)
  fused = sorted({k for k in kernels.values() if registry.get(k).sort == FUSED_OP})
  if fused:
    target, why = more_precise_fused_op(ctx.report, plan, site, fused[0], must_improve)
    return back_off(plan, site, None, f"{reason}; {why}", to=target, step=step)
  for p, current in kernels.items():
    if not registry.get(current).fp8:
      continue
    target, why = more_precise_kernel(ctx.report, plan, site, p, current)
    plan = back_off(plan, site, p, f"{reason}; {why}", to=target, step=step)
  return plan


# ----------------------------------------------------------------------------- ranking


def _ranked_by_report(ctx: ValidationContext, config: ValidationConfig,
                      candidates: Mapping[str, KernelChoice], one_program: bool) -> bool:
  """Whether this round ranks its back-off candidates from the probe report. Never when the
  round measures its sites in one compiled program (`one_program`): the cap is there for a
  whole-model compile per site, and the report's ranking can miss the site that moves the
  loss (Wukong large, H200: three held-out rounds ranked by forward error backed off 18 MLP
  sites while `head/dense_0` alone carried +0.053% of the +0.054%)."""
  return (not one_program and config.max_measured_sites is not None
          and ctx.report is not None and len(candidates) > config.max_measured_sites)


def recorded_scores(scores: Mapping[str, float]) -> Dict[str, Optional[float]]:
  """`report_scores` as a validation record holds them: JSON has no infinity, so a site that
  cannot move the check (-inf) is recorded as null."""
  return {site: (float(v) if math.isfinite(v) else None) for site, v in scores.items()}


def report_scores(report: Mapping, plan: Plan, candidates: Mapping[str, KernelChoice],
                  what: str, passes: Sequence[str] = PASSES) -> Dict[str, float]:
  """{site: score} from the probe report alone, higher = back off sooner.

  what='error': minus the lowest accuracy (pessimistic SQNR in dB, or minus MERE under the
  budget's `metric='mere'`) over the site's FP8 `passes`; -inf for a site with none of them
  on FP8 (it cannot move that check). what='time': the site's GEMM time with its plan minus with
  xla_bf16, summed over `passes` (microseconds; 0 where the report has no timing), so the
  site that saves least goes first.
  """
  from loka_jax.dispatch import selection
  from loka_jax.probe import eligibility
  if what not in ("error", "time"):
    raise ValueError(f"report_scores: what must be 'error' or 'time', got {what!r}")
  try:
    source = selection.resolve_timing(report)
  except ValueError:
    source = selection.TimingSource("none", {"kind": "none", "reason": "no usable timings"})
  info = selection.kernels_info(report)
  scores = {}
  for site, choice in candidates.items():
    if site not in report.get("sites", {}):
      scores[site] = -math.inf
      continue
    effective, _ = selection.effective_site(report, site, source)
    if what == "time":
      total = 0.0
      for p in passes:
        entries = effective["passes"].get(p, {})
        b = entries.get(FALLBACK, {}).get("time_us")
        k = entries.get(choice.for_pass(p), {}).get("time_us")
        if b and k:
          total += float(k[1]) - float(b[1])
      scores[site] = total
      continue
    criteria = _site_criteria(plan, site)
    verdicts = eligibility.assess_site({"kernels": info, "sites": {site: effective}}, site,
                                       criteria)
    accuracies = [_accuracy(verdicts[p][choice.for_pass(p)], criteria.metric)
                  for p in passes
                  if registry.get(choice.for_pass(p)).quantizes(p)
                  and choice.for_pass(p) in verdicts.get(p, {})]
    scores[site] = -min(accuracies) if accuracies else -math.inf
  return scores


def worst_by_report(scores: Mapping[str, float]) -> List[str]:
  """The quarter of the sites (at least one) with the highest scores: ranking from the report
  is cheap but coarse, so a round backs off several sites rather than compile once per site.
  Sites scored -inf (nothing on FP8 that this check sees) come last, and only when no other
  site is left."""
  movable = {s: v for s, v in scores.items() if v != -math.inf} or dict(scores)
  count = max(1, math.ceil(len(movable) / 4))
  return sorted(movable, key=lambda s: (movable[s], s), reverse=True)[:count]
