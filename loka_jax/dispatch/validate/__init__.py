"""End-to-end validation of a plan. Per-op errors and timings miss how errors propagate
through the tower and how kernels fuse with their neighbours, so after selection the whole
model is checked on the probe's trained bf16+Mods state (a plan changes kernels, never
weights), and the worst sites are backed off until every check holds. The checks, in order
(`CHECKS`):

  speed promotion (`promotion`; on a GPU, or `promote=True`): selection judges each site
    alone, which is pessimistic for FP8 in a whole step (on a Hopper GPU no XLA tensorwise
    pass cleared 1.05x alone at 8192x2048x8, yet tensorwise everywhere trains 1.05x faster).
    Per kernel sort, the FP8 kernel that loses least alone goes to every xla_bf16 site where
    it is safe in every pass; the fastest such plan whose train step is provably faster and
    whose inference is not provably slower is kept. Backed-off sites are never promoted.
  held-out (`held_out_check`): the planned model's held-out log loss against bf16+Mods'.
    While the relative change is above `max_rel_logloss` (a lower loss passes), the site
    whose plan alone raises it most gets a more accurate forward
    (`backoff.more_precise_kernel`), or xla_bf16.
  shadow training (`training.check_shadow`): `shadow_steps` steps from the checkpoint, plan
    vs bf16+Mods on the same batches, over `shadow_windows` data windows. The runs diverge
    when the plan's loss is not finite or its training-loss window or held-out log loss ends
    above bf16+Mods' by more than `shadow_max_rel_loss` (0.5%). One-sided: ending below is
    drift, not damage (a Wukong `large` plan ended 1.3% below bf16+Mods). The site whose plan
    moves the parameter gradient most steps down a pass; when the last back-off moved no loss
    by `stalled_fraction` of its excess, every site with an FP8 gradient pass steps down at
    once. `shadow_noise_floor` widens the bounds to the check's own noise (bf16+Mods trained
    again from a jittered checkpoint): a short run from an early state is chaotic, and
    backing off one site's gradients moved Wukong `large`'s held-out change from +1.27% to
    -0.68% in one window and from +1.96% to +3.82% in another (H200).
    `shadow_warmup_steps` re-warms the learning rates after the switch; a probe state on a
    loss plateau (Wukong `large` leaves its plateau between steps 100 and 350 by seed, plan
    and warm-up) is better judged from initialization, with `shadow_steps=0`.
  training from initialization (`training.check_from_init`; `from_init_steps`, 0 skips it):
    the same comparison from a fresh initialization, over `from_init_seeds` seeds, with the
    recipe the model is trained with (`from_init_warmup_steps`, `from_init_clip_norm`). The
    checks from a trained state cannot see early training: at DLRM `large`, FP8 gradients
    enlarge Adam's early spike (+0.004 held-out log loss after 500 steps, H200) under a plan
    that passed both. `from_init_quality_bound` also judges each round's held-out log loss by
    the quality rule (`held_out_gate`: `train.verdict.paired_quality` of the plan against
    bf16+Mods by seed, bound `max_rel_logloss`): a missed verdict fails the round, as does,
    with one seed, a change above the bound; an unresolved one passes, recorded as such.
  speed (`speed`; on a GPU, or `speed=True`): whole jitted train and inference steps, plan vs
    bf16+Mods, interleaved, >= 20 repeats, bootstrap 95% CI of the speedup. While a lower
    bound is below `min_speedup`, the site slowest in context goes to xla_bf16 with every
    other site whose reversion alone clearly speeds the failing steps up (on DCNv2 `small`,
    H200, all 11 FP8 sites slowed the step by 4-13% each: one site a round would take 11
    rounds). A step that runs none of the plan's FP8 passes is noise, recorded, not acted on.

Past `max_measured_sites` FP8 sites a round ranks them from the probe report
(`backoff.report_scores`) and backs off the worst quarter, unless it measures in one
compiled program (`held_out_one_program`, `gradient_one_program`: a switch board,
`state.switch_board`). Every measurement is a `validation` record of the plan and every
change a back-off record, so the plan file tells how it came to be; a check's last record
carries `final: true`. `Progress` saves the plan before every round and measurement and
pauses (ValidationPaused) when the caller's `should_stop` says so;
`validate_end_to_end(..., resume_from=saved)` goes on from the saved plan, reusing every
site measurement and training run it records (`records`).
"""
from __future__ import annotations

from typing import Optional

from loka_jax.plan.file import Plan, add_validation, as_plan
from loka_jax.dispatch.validate.backoff import (back_off_site, more_precise_fused_op,
                                                more_precise_kernel, report_scores,
                                                worst_by_report)
from loka_jax.dispatch.validate.config import (BASELINE, CHECK_STEPS, DELAYED_WARMUP,
                                               NOISE_FLOOR_JITTER, PROMOTION,
                                               ValidationConfig, ValidationContext, fp8_sites,
                                               on_gpu_unless, only_site, promotion_enabled,
                                               ruled_out_by_config, speed_enabled,
                                               without_site)
from loka_jax.dispatch.validate.gradients import (gradient_change, gradient_distance,
                                                  gradient_switched)
from loka_jax.dispatch.validate.held_out_check import check_held_out
from loka_jax.dispatch.validate.promotion import (PROPOSAL, Promotion, check_promotion,
                                                  promotable_sites, promotion_pays, promotions)
from loka_jax.dispatch.validate.records import (REOPENED, SPEED_STEPS, Progress,
                                                ValidationPaused, _final, finished,
                                                held_out_backed_off, is_back_off,
                                                matching_records, measure_sites, reopen_check,
                                                run_step, saved_site_measurements,
                                                site_records, site_step, take_in_turn,
                                                validation_records)
from loka_jax.dispatch.validate.runs import (BASELINE_ARM, CHECKPOINT, CURVE_EVERY, INIT,
                                             NOISE_ARM, PLAN_ARM, initial_state, jittered,
                                             loss_curve, run_summary, shadow_run)
from loka_jax.dispatch.validate.speed import (STEP_PASSES, check_speed, clearly_slow_sites,
                                              in_context_slowdown, measure_steps)
from loka_jax.dispatch.validate.state import (SwitchBoard, held_out, held_out_change,
                                              held_out_change_se, held_out_change_switched,
                                              held_out_switched, model_and_meta, state_for,
                                              switch_board, switched_plan, working_state)
from loka_jax.dispatch.validate.training import (check_from_init, check_shadow,
                                                 held_out_gate, shadow_diverged,
                                                 shadow_noise_bounds, stalled_back_off)

__all__ = [
    "BASELINE", "BASELINE_ARM", "CHECKPOINT", "CHECKS", "CHECK_STEPS", "CURVE_EVERY",
    "DELAYED_WARMUP", "INIT", "NOISE_ARM", "NOISE_FLOOR_JITTER", "PLAN_ARM", "PROMOTION",
    "PROPOSAL", "Progress", "Promotion", "REOPENED", "SPEED_STEPS", "STEP_PASSES",
    "SwitchBoard", "ValidationConfig", "ValidationContext", "ValidationPaused",
    "back_off_site", "check_from_init", "check_held_out", "check_promotion", "check_shadow",
    "check_speed", "clearly_slow_sites", "finished", "fp8_sites", "gradient_change",
    "gradient_distance", "gradient_switched", "held_out", "held_out_backed_off",
    "held_out_change", "held_out_change_se", "held_out_change_switched",
    "held_out_gate", "held_out_switched", "in_context_slowdown", "initial_state",
    "is_back_off", "jittered", "loss_curve", "matching_records", "measure_sites",
    "measure_steps", "model_and_meta", "more_precise_fused_op", "more_precise_kernel",
    "on_gpu_unless", "only_site", "promotable_sites", "promotion_enabled", "promotion_pays",
    "promotions", "reopen_check", "report_scores", "ruled_out_by_config", "run_step",
    "run_summary", "saved_site_measurements", "shadow_diverged", "shadow_noise_bounds",
    "shadow_run", "site_records", "site_step", "speed_enabled", "stalled_back_off",
    "state_for", "switch_board", "switched_plan", "take_in_turn", "validate_end_to_end",
    "validation_records", "without_site", "working_state", "worst_by_report",
]

_CHECK_OF = {PROMOTION: check_promotion, "quality_held_out": check_held_out,
             "quality_shadow": check_shadow, "quality_from_init": check_from_init,
             "speed": check_speed}
# (step, check) in the order validation runs them.
CHECKS = tuple((step, _CHECK_OF[step]) for step in CHECK_STEPS)


def validate_end_to_end(plan, ctx: ValidationContext,
                        config: ValidationConfig = ValidationConfig(), *,
                        progress: Optional[Progress] = None, resume_from=None) -> Plan:
  """Speed promotion, held-out quality, shadow training, training from initialization, then
  speed; returns the plan with every step, promotion and back-off recorded and a final
  'validated' record summing them up.

  `plan` is the selected plan; `resume_from`, the plan an interrupted call saved through
  `progress` (its finished checks are skipped, an unfinished one goes on from its last
  round). `progress` saves the plan as it goes and pauses (ValidationPaused) when its
  `should_stop` says so.
  """
  plan = as_plan(plan)
  progress = progress or Progress()
  before = fp8_sites(plan, ctx.site_names())
  if resume_from is not None:
    plan = as_plan(resume_from)
  for step, check in CHECKS:
    if finished(plan, step):
      continue
    if step != PROMOTION and not fp8_sites(plan, ctx.site_names()):  # e.g. all backed off
      plan = _final(plan, {"step": step, "skipped": True,
                           "reason": "no FP8 site in the plan: it runs bf16+Mods, which is "
                                     "what it would be compared with"})
      continue
    why = ruled_out_by_config(step, config)
    if why is not None:  # recorded even when told to stop: a resumed call would only do this
      plan = _final(plan, {"step": step, "skipped": True, "reason": why})
      continue
    progress.checkpoint(plan, f"the {step} check")
    plan = check(plan, ctx, config, progress)
  after = fp8_sites(plan, ctx.site_names())
  last = {}
  for r in plan["validation"]:
    if (r.get("step") in dict(CHECKS) and r["step"] != PROMOTION   # promotion cannot fail
        and not r.get(REOPENED)):
      last[r["step"]] = r
  return add_validation(plan, {
      "step": "validated", "config": config.to_dict(),
      "fp8_sites_before": len(before), "fp8_sites_after": len(after),
      "backed_off": sorted(s for s in before if before[s] != after.get(s)),
      "promoted": sorted(s for s in after if s not in before),
      "passed": {k: (None if v.get("skipped") else v.get("passed")) for k, v in last.items()}})
