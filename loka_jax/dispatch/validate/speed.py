"""The speed check (on a GPU only): whole jitted train and inference steps, plan vs
bf16+Mods, interleaved, with a bootstrap CI of the speedup; while a lower bound is below
`min_speedup`, the site slowest in context goes to xla_bf16 with every other site whose
reversion alone clearly speeds the failing steps up."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from loka_jax import timing
from loka_jax.plan.file import Plan, add_validation, as_plan
from loka_jax.dispatch.validate.backoff import (_ranked_by_report, back_off_site, recorded_scores,
                                                report_scores, worst_by_report)
from loka_jax.dispatch.validate.config import (BASELINE, ValidationConfig, ValidationContext,
                                               fp8_sites, ruled_out_by_config, without_site)
from loka_jax.dispatch.validate.records import (SPEED_STEPS, Progress, _final, _rounds_done,
                                                matching_records, measure_sites, site_records,
                                                take_in_turn)
from loka_jax.dispatch.validate.state import _fresh_copy, model_and_meta, working_state
from loka_jax.kernels import PASSES, KernelPlan
from loka_jax.train.loop import compiled_steps


# The passes each timed step runs: a plan's gradient-only FP8 sites cannot change inference.
STEP_PASSES = {"train": PASSES, "infer": ("fwd",)}


def _step_calls(ctx: ValidationContext, kplan: KernelPlan, shared: Dict[str, Any]):
  """(train_call, infer_call): argument-less whole steps on a fixed real batch. Every plan's
  train call threads the same parameters and optimizer state (`shared`: the context's own
  copy, consumed; a plan changes kernels only) and its own fp8_meta, so timing any number of
  plans costs no extra copy of the state however large the model."""
  model, meta0 = model_and_meta(ctx, kplan)  # cached by measure_steps before the state moved
  train_step, eval_step = compiled_steps(model, ctx.optim, "stop")
  batch = jax.device_put(ctx.batch())
  meta = {"value": _fresh_copy(meta0)}

  def train_call():
    new, m = train_step(shared["state"].replace(fp8_meta=meta["value"]), batch)
    meta["value"] = new.fp8_meta
    shared["state"] = new.replace(fp8_meta={})
    return m["loss"]

  def infer_call():
    return eval_step(shared["state"].replace(fp8_meta=meta["value"]), batch)

  return train_call, infer_call


def measure_steps(ctx: ValidationContext, plans: Mapping[str, KernelPlan], baseline: str,
                  repeats: int = 20, seed: int = 0, min_sample_s: float = 0.01
                  ) -> Dict[str, Dict[str, dict]]:
  """{mode: timing.summarize(...)} of whole train and inference steps of `plans`,
  interleaved, with speedups vs `baseline` (baseline time / variant time). A sample runs as
  many steps back to back as make `min_sample_s` on the baseline (the same count for every
  plan; `inner` in the summaries)."""
  for kplan in plans.values():
    model_and_meta(ctx, kplan)  # first: making fp8_meta reads the context's state
  out = {}
  with working_state(ctx) as state:
    shared = {"state": state.replace(fp8_meta={})}
    del state
    calls = {name: _step_calls(ctx, kplan, shared) for name, kplan in plans.items()}
    for mode, index in (("train", 0), ("infer", 1)):
      per_sample = (timing.calls_for(calls[baseline][index], min_sample_s)
                    if min_sample_s > 0 else 1)
      timings = timing.time_calls({n: c[index] for n, c in calls.items()}, repeats=repeats,
                                  calls_per_sample=per_sample)
      out[mode] = timing.summarize(timings, baseline, seed=seed)
    del calls, shared
  return out


def clearly_slow_sites(ci_lows: Mapping[str, float], slowdowns: Mapping[str, float]
                       ) -> List[str]:
  """The sites a speed round backs off, slowest first: the one with the largest in-context
  slowdown, and every other whose reversion alone makes each failing step faster with the
  speedup's CI lower bound above 1 (`ci_lows`: per site, the lowest over the failing steps
  of that bound, "without SITE" against the plan)."""
  worst = max(slowdowns, key=lambda s: (slowdowns[s], s))
  clear = [s for s in slowdowns if s != worst and ci_lows[s] > 1.0]
  return [worst] + sorted(clear, key=lambda s: (-slowdowns[s], s))


def in_context_slowdown(ctx: ValidationContext, plan: Plan, site: str, failing: Sequence[str],
                        config: ValidationConfig) -> Tuple[float, Dict[str, Any]]:
  """(the time `site` costs the failing steps in context, extras): the plan and the plan
  without the site timed in one interleaving; the slowdown is the product over `failing` of
  the speedup of "without SITE" against the plan, and `ci_low` the lowest CI lower bound of
  those speedups. One pair per site, so a round over many sites of a large preset (DHEN
  large: about 80 s to compile a plan's steps) is saved site by site (`measure_sites`)."""
  got = measure_steps(ctx, {"plan": plan.kernel_plan(), "without": without_site(plan, site)},
                      "plan", config.speed_repeats, config.seed, config.speed_min_sample_s)
  return (float(np.prod([got[m]["without"]["speedup"] for m in failing])),
          {"ci_low": float(min(got[m]["without"]["speedup_ci"][0] for m in failing))})


def _round_steps(plan: Plan, ctx: ValidationContext, config: ValidationConfig,
                 progress: Progress, round_: int, device: str
                 ) -> Tuple[Plan, Dict[str, Dict[str, dict]]]:
  """(plan, `measure_steps`' {mode: {"bf16", "plan": summary}}) of a speed round: its
  whole train and inference steps, plan against bf16+Mods, as a `speed_steps` record of
  this round, device and FP8 sites holds them, or timed now and recorded at once
  (`take_in_turn`: paced by the slowest recorded). A round compiles both models' train and
  inference steps (minutes at Wukong `large`); a call that stops while the round's sites
  are measured must not time them again, nor let a new reading of which step fails set
  aside the sites measured for the old one."""
  fields = {"round": round_, "device": device,
            "sites": {s: c.to_dict() for s, c in sorted(fp8_sites(plan, ctx.site_names()).items())}}
  if not matching_records(plan, SPEED_STEPS, fields):
    timed = lambda: {"steps": measure_steps(
        ctx, {"bf16": BASELINE, "plan": plan.kernel_plan()}, "bf16", config.speed_repeats,
        config.seed, config.speed_min_sample_s)}
    plan = take_in_turn(plan, progress, SPEED_STEPS,
                        [(f"speed round {round_}'s timed steps", fields, timed)])
  return plan, matching_records(plan, SPEED_STEPS, fields)[-1]["steps"]


def check_speed(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                progress: Optional[Progress] = None) -> Plan:
  """Backs off the site with the largest in-context slowdown, and every site clearly slow in
  context (`clearly_slow_sites`), while the plan's train or inference step is not provably at
  least `min_speedup` x bf16+Mods (CI lower bound)."""
  plan = as_plan(plan)
  progress = progress or Progress()
  why = ruled_out_by_config("speed", config)
  if why is not None:
    return _final(plan, {"step": "speed", "skipped": True, "reason": why})
  device = jax.devices()[0].device_kind
  first = _rounds_done(plan, "speed")
  for round_ in range(first, config.max_rounds + 1):
    progress.checkpoint(plan, f"speed round {round_}")
    plan, got = _round_steps(plan, ctx, config, progress, round_, device)
    below = [m for m in STEP_PASSES if got[m]["plan"]["speedup_ci"][0] < config.min_speedup]
    # A step that runs no FP8 pass of the plan runs bf16+Mods' kernels: its CI is noise, and
    # backing sites off cannot move it (an inference step of a plan with FP8 gradients only).
    same_kernels = [m for m in below if not fp8_sites(plan, ctx.site_names(), STEP_PASSES[m])]
    failing = [m for m in below if m not in same_kernels]
    passes = tuple(p for p in PASSES if any(p in STEP_PASSES[m] for m in failing))
    candidates = fp8_sites(plan, ctx.site_names(), passes or PASSES)
    record: Dict[str, Any] = {
        "step": "speed", "round": round_, "device": device, "why": why,
        "repeats": config.speed_repeats, "min_speedup": config.min_speedup,
        "passed": not failing}
    for m in STEP_PASSES:
      p = got[m]["plan"]
      record[m] = {"speedup": p["speedup"], "speedup_ci": p["speedup_ci"],
                   "plan_median_us": p["median_us"],
                   "bf16_median_us": got[m]["bf16"]["median_us"]}
    if same_kernels:
      record["same_kernels_as_bf16_mods"] = same_kernels
    if not failing or not candidates or round_ == config.max_rounds:
      if failing:
        record["note"] = ("no FP8 site left to back off" if not candidates
                          else f"stopped after {config.max_rounds} back-offs")
      return progress.note(_final(plan, record), -1)
    lower = min(got[m]["plan"]["speedup_ci"][0] for m in failing)
    excess = (f"{'/'.join(failing)} step speedup CI lower bound {lower:.3f} < "
              f"{config.min_speedup:g}")
    record["failing"] = failing
    if _ranked_by_report(ctx, config, candidates, one_program=False):
      scores = report_scores(ctx.report, plan, candidates, "time", passes)
      worst = worst_by_report(scores)
      record["report_scores"] = recorded_scores(scores)
      reasons = {s: f"{excess}; ranked by the probe report's GEMM time vs xla_bf16 "
                    f"({scores[s]:+.1f} us)" for s in worst}
    else:
      # Each site's cost in context depends on the rest of the plan, on which steps fail and
      # on the card, so a saved value is reused only in this round, for these steps, there.
      scope = {"round": round_, "device": device, "failing": failing}
      round_plan = plan
      plan, slowdowns = measure_sites(
          plan, "speed", round_, candidates,
          lambda site, choice: in_context_slowdown(ctx, round_plan, site, failing, config),
          progress, scope)
      ci_lows = {r["site"]: r["ci_low"] for r in site_records(plan, "speed", scope)}
      record["in_context_slowdown"] = slowdowns
      record["in_context_ci_low"] = {s: ci_lows[s] for s in candidates}
      worst = clearly_slow_sites(ci_lows, slowdowns)
      reasons = {s: f"{excess}; this site's in-context slowdown {slowdowns[s]:.3f}x"
                    + ("" if s == worst[0] else " (its reversion alone speeds the step up, CI "
                       "above 1)") for s in worst}
    since = len(plan["validation"])
    plan = add_validation(plan, record)
    for site in worst:
      plan = back_off_site(plan, ctx, site, reasons[site], step="speed", to_fallback=True)
    plan = progress.note(plan, since)
  return plan
