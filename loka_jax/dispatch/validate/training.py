"""The training checks: shadow training from the checkpoint (`check_shadow`) and training
from a fresh initialization (`check_from_init`), plan vs bf16+Mods on the same batches. A
round fails when the plan's loss climbs above the baseline's beyond its bound (one-sided), or,
from initialization with `from_init_quality_bound`, when the quality rule's verdict on its
held-out log loss is missed (`held_out_gate`); then the site whose plan moves the gradient
most steps down, or, when the last back-off moved no loss, every site with an FP8 gradient
pass (`stalled_back_off`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from loka_jax.plan.file import Plan, add_validation, as_plan
from loka_jax.dispatch.validate.backoff import (_ranked_by_report, back_off_site, recorded_scores,
                                                report_scores, worst_by_report)
from loka_jax.dispatch.validate.config import (BASELINE, NOISE_FLOOR_JITTER, ValidationConfig,
                                               ValidationContext, fp8_sites,
                                               ruled_out_by_config)
from loka_jax.dispatch.validate.gradients import gradient_change
from loka_jax.dispatch.validate.records import (Progress, _final, _live_records,
                                                _rounds_done, is_back_off, measure_sites)
from loka_jax.dispatch.validate.runs import (BASELINE_ARM, CHECKPOINT, INIT, NOISE_ARM,
                                             PLAN_ARM, _training_runs)
from loka_jax.train.optim import OptimConfig
from loka_jax.train.verdict import MISSED, paired_quality


def _rel(value: float, base: float) -> float:
  return (value - base) / base if base else math.inf


def shadow_diverged(rel_train: float, rel_eval: float, bound: float,
                    eval_bound: Optional[float] = None) -> bool:
  """One-sided: the plan's training-loss window is above bf16+Mods' by more than `bound`, or
  its held-out log loss by more than `eval_bound` (default `bound`; both relative). Ending
  below the baseline is drift, not divergence."""
  return rel_train > bound or rel_eval > (bound if eval_bound is None else eval_bound)


def stalled_back_off(previous: Mapping[str, Any], current: Mapping[str, Any],
                     bounds: Mapping[str, float], fraction: float,
                     backed_off: Sequence[str]) -> Optional[str]:
  """Why the previous training round's back-off left the run where it was, or None.

  `previous` and `current`: two consecutive rounds' verdicts (finite, with
  `rel_train_loss` and `rel_logloss_change`); `bounds`: each of those keys' bound;
  `backed_off`: the sites the previous round backed off. Stalled: `current` fails too, and
  for every loss the previous round had above its bound, the back-off took back less than
  `fraction` of that excess (a loss that grew took back nothing). `fraction` 0: never."""
  if fraction <= 0 or current.get("passed", True) or not backed_off:
    return None
  keys = ("rel_train_loss", "rel_logloss_change")
  if not all(k in previous and k in current for k in keys):
    return None   # a non-finite round reads no losses
  over = {k: previous[k] - bounds[k] for k in keys if previous[k] > bounds[k]}
  if not over or any(previous[k] - current[k] >= fraction * excess
                     for k, excess in over.items()):
    return None
  names = {"rel_train_loss": "training loss", "rel_logloss_change": "held-out"}
  moved = ", ".join(f"{names[k]} {100 * previous[k]:+.3f}% -> {100 * current[k]:+.3f}% "
                    f"({100 * excess:.3f} points over its bound)" for k, excess in over.items())
  sites = ", ".join(backed_off)
  return (f"the last back-off ({sites}) moved no loss by {100 * fraction:g}% of its excess "
          f"({moved}): the ranking has not found the cause, so every site with an FP8 "
          "gradient pass (or, with none left, every FP8 site) steps down one")


def shadow_noise_bounds(config: ValidationConfig, noise_runs: Sequence[Mapping[str, Any]],
                        bases: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
  """The shadow check's bounds read from its noise-floor runs (`shadow_noise_floor`): per
  data window, the jittered bf16+Mods run's relative change from bf16+Mods' in training
  loss and held-out log loss; each bound is max(`shadow_max_rel_loss`, 2 x their RMS /
  sqrt(windows)), two standard errors of a mean over the windows of changes that size."""
  if len(noise_runs) != len(bases) or not bases:
    raise ValueError(f"{len(noise_runs)} noise-floor runs for {len(bases)} data windows")
  trains = [_rel(n["window_loss"], b["window_loss"]) for n, b in zip(noise_runs, bases)]
  evals = [_rel(n["logloss"], b["logloss"]) for n, b in zip(noise_runs, bases)]
  def bound(changes):
    rms = float(np.sqrt(np.mean(np.square(changes))))
    return max(config.shadow_max_rel_loss, 2 * rms / math.sqrt(len(changes)))
  return {"jitter": NOISE_FLOOR_JITTER, "rel_train_loss": trains, "rel_logloss_change": evals,
          "train_bound": bound(trains), "held_out_bound": bound(evals)}


def held_out_gate(config: ValidationConfig, plan_loglosses: Mapping[int, float],
                  baseline_loglosses: Mapping[int, float],
                  applicable: bool = True) -> Dict[str, Any]:
  """The check from initialization's held-out gate (`from_init_quality_bound`): the quality
  rule, `paired_quality` of the plan's held-out log loss against bf16+Mods' by seed ({seed:
  loss}, both arms trained from that seed's initialization and data order), bound
  `max_rel_logloss`. Its `verdict`, `n`, `mean`, `ci`, `bound` (and `pairs_to_resolve` or
  `why` where it has them), plus `passed`: False when the verdict is missed, and with one
  seed (no interval) when that seed's change is above the bound. An unresolved verdict of
  two or more seeds passes, recorded as unresolved; `applicable=False` (no FP8 site) passes."""
  q = paired_quality(plan_loglosses, baseline_loglosses, config.max_rel_logloss, applicable)
  if q["n"] == 1 and q["ci"] is None and applicable:
    passed = q["mean"] is not None and q["mean"] <= q["bound"]
  else:
    passed = q["verdict"] != MISSED
  kept = ("verdict", "n", "mean", "ci", "bound", "pairs_to_resolve", "why", "error")
  return {**{k: q[k] for k in kept if k in q}, "passed": passed}


def check_shadow(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                 progress: Optional[Progress] = None) -> Plan:
  """Shadow training, plan vs bf16+Mods from the same checkpoint; backs off the site that
  moves the gradient most while the runs diverge (bound: `shadow_max_rel_loss`)."""
  return _check_training(plan, ctx, config, progress, "quality_shadow", CHECKPOINT,
                         config.shadow_steps)


def check_from_init(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                    progress: Optional[Progress] = None) -> Plan:
  """Training from a fresh initialization, plan vs bf16+Mods (`from_init_steps`); backs off
  as the shadow check does while the runs diverge (bound: `shadow_max_rel_loss`) and, with
  `from_init_quality_bound`, while `held_out_gate` fails."""
  recipe = {k: v for k, v in (("warmup_steps", config.from_init_warmup_steps),
                              ("clip_norm", config.from_init_clip_norm)) if v is not None}
  optim = dataclasses.replace(ctx.optim, **recipe) if recipe else None
  return _check_training(plan, ctx, config, progress, "quality_from_init", INIT,
                         config.from_init_steps, optim)


_TRAINING = {CHECKPOINT: "shadow training", INIT: "training from initialization"}


def _previous_round(plan: Plan, step: str, round_: int
                    ) -> Tuple[Optional[Dict[str, Any]], List[str]]:
  """(the `step` check's live verdict of round `round_` - 1 or None, the sites backed off
  after it)."""
  live = _live_records(plan, step)
  at = [i for i, r in enumerate(live) if r.get("round") == round_ - 1]
  if not at:
    return None, []
  later = live[at[-1] + 1:]
  until = next((i for i, r in enumerate(later) if "round" in r), len(later))
  return live[at[-1]], [r["site"] for r in later[:until] if is_back_off(r)]


def _check_training(plan, ctx: ValidationContext, config: ValidationConfig,
                    progress: Optional[Progress], step: str, start: str, steps: int,
                    optim: Optional[OptimConfig] = None) -> Plan:
  """The shadow check and the check from initialization: `steps` training steps from
  `start`, plan vs bf16+Mods, backing off while the plan's loss climbs above the baseline's."""
  plan = as_plan(plan)
  progress = progress or Progress()
  why = ruled_out_by_config(step, config)
  if why is not None:
    return _final(plan, {"step": step, "skipped": True, "reason": why})
  size = config.eval_batch_size
  window = min(config.shadow_window, steps)
  # From initialization each seed is a start; from the checkpoint each is a data window.
  seeds = [config.seed + i for i in range(config.from_init_seeds if start == INIT
                                          else config.shadow_windows)]
  trains_with = optim or ctx.optim
  recipe = {"steps": steps, "start": start, "window": window,
            "warmup_steps": trains_with.warmup_steps,
            # Only a clipped recipe names its norm, so records from before the knob still
            # match the runs they describe.
            **({"clip_norm": trains_with.clip_norm} if trains_with.clip_norm is not None
               else {}),
            # Likewise only a re-warmed shadow check names its warm-up after the switch.
            **({"warmup_after_switch": config.shadow_warmup_steps}
               if start == CHECKPOINT and config.shadow_warmup_steps else {})}
  plan, bases = _training_runs(plan, ctx, progress, step, BASELINE_ARM, BASELINE, seeds,
                               recipe, size, optim)
  if not all(b["finite"] for b in bases):
    raise FloatingPointError(
        f"the bf16+Mods run of the {step} check itself produced a non-finite loss: "
        + ("the checkpoint or " if start == CHECKPOINT else "") + "the learning rate is at "
        "fault, not the plan")
  base_windows = [b["window_loss"] for b in bases]
  gated = start == INIT and config.from_init_quality_bound
  noise = None
  if start == CHECKPOINT and config.shadow_noise_floor:
    plan, noise_runs = _training_runs(plan, ctx, progress, step, NOISE_ARM, BASELINE, seeds,
                                      {**recipe, "jitter": NOISE_FLOOR_JITTER}, size, optim)
    if not all(n["finite"] for n in noise_runs):
      raise FloatingPointError(
          f"the jittered bf16+Mods run of the {step} check (its noise floor) produced a "
          "non-finite loss: the checkpoint or the learning rate is at fault, not the plan")
    noise = shadow_noise_bounds(config, noise_runs, bases)
  train_bound = noise["train_bound"] if noise else config.shadow_max_rel_loss
  eval_bound = noise["held_out_bound"] if noise else config.shadow_max_rel_loss
  first = _rounds_done(plan, step)
  # What each loss is judged against (with the held-out gate, its bound is the tighter
  # held-out one): a stall is read against these.
  bounds = {"rel_train_loss": train_bound,
            "rel_logloss_change": (min(eval_bound, config.max_rel_logloss) if gated
                                   else eval_bound)}
  for round_ in range(first, config.max_rounds + 1):
    progress.checkpoint(plan, f"{step} round {round_}")
    previous, backed_off = _previous_round(plan, step, round_)
    candidates = fp8_sites(plan, ctx.site_names())
    plan, runs = _training_runs(
        plan, ctx, progress, step, PLAN_ARM, plan.kernel_plan(), seeds,
        {**recipe, "sites": {s: c.to_dict() for s, c in sorted(candidates.items())}}, size,
        optim)
    finite = all(r["finite"] for r in runs)
    record: Dict[str, Any] = {"step": step, "round": round_, "start": start,
                              "steps": steps, "window": window,
                              **{k: recipe[k] for k in ("warmup_steps", "clip_norm",
                                                        "warmup_after_switch")
                                 if k in recipe},
                              "bound": config.shadow_max_rel_loss, "finite": finite,
                              "train_loss_bf16": float(np.mean(base_windows)),
                              # The worst step of each run: an early spike shows here.
                              "peak_loss_bf16": max(b["peak_loss"] for b in bases)}
    if len(seeds) > 1:
      record["seeds"] = seeds
    if noise is not None:
      record["noise_floor"] = noise
    if finite:
      windows = [r["window_loss"] for r in runs]
      rel_trains = [_rel(w, bw) for w, bw in zip(windows, base_windows)]
      rel_evals = [_rel(r["logloss"], b["logloss"]) for r, b in zip(runs, bases)]
      # The mean over seeds of each seed's relative difference (one seed: that difference).
      rel_train, rel_eval = float(np.mean(rel_trains)), float(np.mean(rel_evals))
      climbed = shadow_diverged(rel_train, rel_eval, train_bound, eval_bound)
      if gated:
        record["held_out_quality"] = held_out_gate(
            config, {s: r["logloss"] for s, r in zip(seeds, runs)},
            {s: b["logloss"] for s, b in zip(seeds, bases)}, applicable=bool(candidates))
      diverged = climbed or (gated and not record["held_out_quality"]["passed"])
      record.update(train_loss=float(np.mean(windows)), rel_train_loss=rel_train,
                    peak_loss=max(r["peak_loss"] for r in runs),
                    logloss=float(np.mean([r["logloss"] for r in runs])),
                    logloss_bf16=float(np.mean([b["logloss"] for b in bases])),
                    rel_logloss_change=rel_eval)
      # Reported, not judged: runs recorded before it was measured have none.
      rel_bf16_forwards = ([_rel(r["logloss_bf16_forward"], b["logloss"])
                            for r, b in zip(runs, bases)]
                           if all("logloss_bf16_forward" in r for r in runs) else None)
      if rel_bf16_forwards is not None:
        record["rel_logloss_change_bf16_forward"] = float(np.mean(rel_bf16_forwards))
      if len(seeds) > 1:
        record["per_seed"] = [{"seed": seed, "rel_train_loss": t, "rel_logloss_change": e}
                              for seed, t, e in zip(seeds, rel_trains, rel_evals)]
        for entry, rel in zip(record["per_seed"], rel_bf16_forwards or ()):
          entry["rel_logloss_change_bf16_forward"] = rel
    else:
      diverged = True
    record["passed"] = not diverged
    if not diverged or not candidates or round_ == config.max_rounds:
      if diverged:
        record["note"] = ("no FP8 site left to back off" if not candidates
                          else f"stopped after {config.max_rounds} back-offs")
      return progress.note(_final(plan, record), -1)
    # The verdict shows before the sites are measured (minutes at a large preset); the
    # record itself is added after, with their values.
    progress.note_records([record])
    if not finite:
      what = "non-finite loss"
    elif climbed and noise is not None:
      what = (f"losses diverge beyond their noise-floor bounds (train "
              f"{100 * record['rel_train_loss']:+.3f}% against {100 * train_bound:.3f}%, "
              f"held-out {100 * record['rel_logloss_change']:+.3f}% against "
              f"{100 * eval_bound:.3f}%)")
    elif climbed:
      what = (f"losses diverge beyond {100 * config.shadow_max_rel_loss:g}% (train "
              f"{100 * record['rel_train_loss']:+.3f}%, held-out "
              f"{100 * record['rel_logloss_change']:+.3f}%)")
    else:
      what = ""
    gate = record.get("held_out_quality")
    if gate is not None and not gate["passed"]:   # the quality rule's verdict
      from loka_jax.train.report import held_out_gate_text   # matplotlib: only when needed
      what = "; ".join(w for w in (what, held_out_gate_text(gate)) if w)
    stalled = (stalled_back_off(previous, record, bounds, config.stalled_fraction,
                                backed_off) if previous is not None else None)
    if stalled is not None:
      record["stalled"] = stalled
      # The held-out check passed these forwards, so the gradient passes step down first.
      worst = sorted(fp8_sites(plan, sorted(candidates), ("grad_lhs", "grad_rhs"))
                     or candidates)
      reasons = {s: f"{_TRAINING[start]}: {what}; {stalled}" for s in worst}
    elif _ranked_by_report(ctx, config, candidates, config.gradient_one_program):
      scores = report_scores(ctx.report, plan, candidates, "error")
      worst = worst_by_report(scores)
      record["report_scores"] = recorded_scores(scores)
      reasons = {s: f"{_TRAINING[start]}: {what}; ranked by the probe report's error (all "
                    "passes)" for s in worst}
    else:
      wanted = candidates if config.gradient_one_program else None
      # The bf16 gradient, once a site is left to measure: a tree on the device (12 GB at
      # Wukong `large`), so it lives for this round's measurements only (cleared below),
      # not beside the next round's training runs. A later round measures on another
      # board anyway.
      reference = {}
      # Each site's record also names the parameters it moves most, relatively
      # (`gradient_distance`): what the whole-gradient ranking can read small.
      measure = lambda site, choice: gradient_change(ctx, site, choice, config.grad_batches,
                                                     wanted, reference, largest_leaves=3)
      # Recorded under the shadow check's name in either check: the value (this site's
      # gradient change on the trained state) is the same, so neither measures it twice.
      try:
        plan, current = measure_sites(plan, "quality_shadow", round_, candidates, measure,
                                      progress, one_program=config.gradient_one_program)
      finally:
        reference.clear()
      # JSON has no infinity: a site whose gradient is not finite reads null.
      record["gradient_contributions"] = {s: (v if math.isfinite(v) else None)
                                          for s, v in current.items()}
      site = max(current, key=lambda s: (current[s], s))
      worst = [site]
      reasons = {site: f"{_TRAINING[start]}: {what}; this site moves the gradient most "
                       f"({current[site]:.3g} relative)"}
    since = len(plan["validation"]) + 1   # the round's verdict was noted above
    plan = add_validation(plan, record)
    for site in worst:
      plan = back_off_site(plan, ctx, site, reasons[site], step=step)
    plan = progress.note(plan, since)
  return plan
