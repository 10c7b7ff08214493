"""The speed promotion (first, on a GPU only): selection judges each site alone, which is
pessimistic for FP8 in a whole step, so for each kernel sort the FP8 kernel that loses least
alone is put at every xla_bf16 site where it is safe in every pass (`promotions`), each such
plan is timed against the plan, and the fastest that pays in the whole step is kept."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax

from loka_jax.plan.file import FALLBACK, Plan, as_plan, promote
from loka_jax.dispatch.validate.backoff import _site_verdicts
from loka_jax.dispatch.validate.config import (CHECK_STEPS, PROMOTION, ValidationConfig,
                                               ValidationContext, ruled_out_by_config)
from loka_jax.dispatch.validate.records import Progress, _final, is_back_off, take_in_turn
from loka_jax.dispatch.validate.speed import STEP_PASSES, measure_steps
from loka_jax.kernels import PASSES
from loka_jax.kernels import registry


def promotable_sites(plan: Plan, names: Sequence[str]) -> List[str]:
  """The sites promotion may change: xla_bf16 in every pass, and never backed off by
  validation (a site sent back for quality or speed stays where validation put it)."""
  backed_off = {r["site"] for r in plan["validation"] if is_back_off(r)}
  out = []
  for name in names:
    choice = plan.choice_for(name)
    if (name not in backed_off and choice is not None
        and all(choice.for_pass(p) == FALLBACK for p in PASSES)):
      out.append(name)
  return out


@dataclasses.dataclass(frozen=True)
class Promotion:
  """One kernel put at every promotable site where it is safe in every pass."""
  kernel: str
  sites: Tuple[str, ...]
  alone: float  # pessimistic speedup over xla_bf16 of those sites timed alone (the probe's)


def promotions(report: Mapping, plan: Plan, names: Sequence[str],
               per_sort: int = 1) -> List[Promotion]:
  """Per kernel sort (per-pass kernels, fused ops), the `per_sort` FP8 kernels whose promotion
  loses least alone: the highest pessimistic speedup over the sites where each is safe in
  every pass under the site's budget (accuracy only: selection has already found none of
  them fast enough), more sites first at a tie.

  A site timed alone is a pessimistic witness for per-pass kernels: each pass quantizes its
  own operands, where a whole step shares them (the gradient quantized once for both gradient
  passes, the forward's FP8 activation reused), and bf16's passes alone can be faster than the
  same passes in the step (on a Hopper GPU, XLA tensorwise at 8192x2048x8 is 0.78x bf16 per
  site alone and about 1.13x in the step). Only the whole step can tell, so this only
  proposes; `check_promotion` measures."""
  from loka_jax.probe import eligibility
  per_kernel: Dict[str, List[Tuple[str, float, float]]] = {}
  sort_of: Dict[str, str] = {}
  for site in promotable_sites(plan, names):
    if site not in report.get("sites", {}):
      continue
    verdicts, effective, info = _site_verdicts(report, plan, site)
    for kernel, meta in info.items():
      if not meta.get("fp8", kernel != FALLBACK) or kernel not in registry.names():
        continue
      v = [verdicts.get(p, {}).get(kernel) for p in PASSES]
      times = eligibility.site_times(effective.get("passes", {}), kernel)
      if times is None or not all(x is not None and x.safe for x in v):
        continue
      per_kernel.setdefault(kernel, []).append((site, *times))
      sort_of[kernel] = meta.get("sort")
  by_sort: Dict[str, List[Promotion]] = {}
  for kernel, rows in sorted(per_kernel.items()):
    alone = sum(r[1] for r in rows) / sum(r[2] for r in rows)
    by_sort.setdefault(sort_of[kernel], []).append(
        Promotion(kernel, tuple(r[0] for r in rows), alone))
  return [p for sort in sorted(by_sort)
          for p in sorted(by_sort[sort], key=lambda p: (-p.alone, -len(p.sites), p.kernel))
          [:per_sort]]


def promotion_pays(summaries: Mapping[str, Mapping[str, dict]], name: str) -> bool:
  """Whether variant `name` beats the plan it was timed against: its train step provably
  faster (speedup CI lower bound above 1) and its inference step not provably slower (CI
  upper bound at least 1)."""
  return (summaries["train"][name]["speedup_ci"][0] > 1.0
          and summaries["infer"][name]["speedup_ci"][1] >= 1.0)


PROPOSAL = "speed_promotion_proposal"


def _timed_proposals(plan: Plan, ctx: ValidationContext, config: ValidationConfig,
                     proposals: Sequence[Promotion], promoted: Mapping[str, Plan],
                     progress: Progress) -> Tuple[Plan, Dict[str, Dict[str, Any]]]:
  """(plan, {kernel: its PROPOSAL record: pays, train, infer}): each proposal (`promoted`:
  {kernel: the plan with it}) timed against the plan in an interleaving of its own and
  recorded at once (`take_in_turn`), so a promotion that outlasts a call resumes with the
  proposals it lacks: each pair compiles two whole models (InterFormer `small`: 40-84 s a
  compile on an H200), and several proposals of a large preset outlast one call. Its pace
  is its own, not the site measurements'."""
  def timed(kernel: str) -> Dict[str, Any]:
    name = f"promote {kernel}"
    got = measure_steps(ctx, {"plan": plan.kernel_plan(), name: promoted[kernel].kernel_plan()},
                        "plan", config.speed_repeats, config.seed, config.speed_min_sample_s)
    return {"pays": promotion_pays(got, name),
            **{m: {"speedup": got[m][name]["speedup"], "speedup_ci": got[m][name]["speedup_ci"]}
               for m in STEP_PASSES}}

  done = {r["kernel"] for r in plan["validation"] if r.get("step") == PROPOSAL}
  pending = [(f"the speed promotion, proposal {p.kernel}", {"kernel": p.kernel},
              functools.partial(timed, p.kernel)) for p in proposals if p.kernel not in done]
  plan = take_in_turn(plan, Progress(save=progress.save, should_stop=progress.should_stop),
                      PROPOSAL, pending)
  return plan, {r["kernel"]: r for r in plan["validation"] if r.get("step") == PROPOSAL}


def check_promotion(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                    progress: Optional[Progress] = None) -> Plan:
  """Promotes xla_bf16 sites to FP8 where the whole step says so: each proposal of
  `promotions` is timed against the plan in an interleaving of its own (train and inference
  steps; `_timed_proposals`, resumable proposal by proposal), and the one with the fastest
  train step among those that pay (`promotion_pays`) is kept. The
  quality checks that follow judge the promoted sites like any other, and back them off if
  they must."""
  plan = as_plan(plan)
  progress = progress or Progress()
  why = ruled_out_by_config(PROMOTION, config)
  if why is not None:
    return _final(plan, {"step": PROMOTION, "skipped": True, "reason": why})
  if ctx.report is None:
    return _final(plan, {"step": PROMOTION, "skipped": True,
                         "reason": "no probe report to propose kernels from"})
  later = {step for step in CHECK_STEPS if step != PROMOTION}
  begun = sorted({r["step"] for r in plan["validation"] if r.get("step") in later})
  if begun:  # a validation resumed from before promotion existed: its rounds stand
    return _final(plan, {"step": PROMOTION, "skipped": True,
                         "reason": f"{', '.join(begun)} already judged this plan; promotion "
                                   "comes first or not at all"})
  proposals = promotions(ctx.report, plan, ctx.site_names(), config.promotion_per_sort)
  if not proposals:
    return _final(plan, {"step": PROMOTION, "skipped": True,
                         "reason": "no xla_bf16 site has an FP8 kernel safe in every pass"})
  progress.checkpoint(plan, "the speed promotion")
  def promoted(base: Plan, p: Promotion) -> Plan:
    return promote(base, p.sites, p.kernel, f"{p.kernel} is safe in every pass here and "
                   f"{p.alone:.2f}x bf16 over its {len(p.sites)} sites timed alone; promoted "
                   "if the whole step pays")
  plan, timed = _timed_proposals(plan, ctx, config, proposals,
                                 {p.kernel: promoted(plan, p) for p in proposals}, progress)
  record: Dict[str, Any] = {"step": PROMOTION, "device": jax.devices()[0].device_kind,
                            "why": why, "repeats": config.speed_repeats, "proposals": {}}
  for p in proposals:
    record["proposals"][p.kernel] = {"sites": len(p.sites), "alone": p.alone,
                                     **{k: timed[p.kernel][k] for k in ("pays", *STEP_PASSES)}}
  paying = [p for p in proposals if record["proposals"][p.kernel]["pays"]]
  if not paying:
    record["promoted"] = None
    return _final(plan, record)
  chosen = max(paying, key=lambda p: (record["proposals"][p.kernel]["train"]["speedup"],
                                      p.kernel))
  record["promoted"] = chosen.kernel
  record["sites"] = list(chosen.sites)
  return _final(promoted(plan, chosen), record)   # the plan, its proposals' records kept
