"""The held-out check: the planned model's held-out log loss against bf16+Mods' on the same
trained parameters. It passes when the relative change is at most `max_rel_logloss` (a plan
with a lower loss than bf16+Mods passes: being better is never a miss); while it is above,
the site that raises the loss most gets a more accurate forward."""
from __future__ import annotations

from typing import Optional

from loka_jax.plan.file import Plan, add_validation, as_plan
from loka_jax.dispatch.validate.backoff import (_ranked_by_report, back_off_site, recorded_scores,
                                                report_scores, worst_by_report)
from loka_jax.dispatch.validate.config import (BASELINE, ValidationConfig, ValidationContext,
                                               fp8_sites, only_site)
from loka_jax.dispatch.validate.records import Progress, _final, _rounds_done, measure_sites
from loka_jax.dispatch.validate.state import (held_out, held_out_change, held_out_change_se,
                                              held_out_change_switched)


def check_held_out(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                   progress: Optional[Progress] = None) -> Plan:
  """Backs off the site with the largest held-out contribution until the planned model's
  relative log-loss change is within `max_rel_logloss`."""
  plan = as_plan(plan)
  progress = progress or Progress()
  size = config.eval_batch_size
  base = held_out(ctx, BASELINE, size)
  first = _rounds_done(plan, "quality_held_out")
  for round_ in range(first, config.max_rounds + 1):
    progress.checkpoint(plan, f"held-out round {round_}")
    got = held_out(ctx, plan.kernel_plan(), size)   # cached: the change below reads it too
    rel, se = held_out_change_se(ctx, plan.kernel_plan(), size)
    passed = rel <= config.max_rel_logloss
    candidates = fp8_sites(plan, ctx.site_names())
    record = {"step": "quality_held_out", "round": round_, "logloss": got["logloss"],
              "logloss_bf16": base["logloss"], "ne": got["ne"], "ne_bf16": base["ne"],
              "auc": got["auc"], "auc_bf16": base["auc"], "rel_logloss_change": rel,
              "rel_logloss_change_se": se, "budget": config.max_rel_logloss, "passed": passed,
              "rule": "relative change <= budget",
              "num_eval_examples": got["num_examples"]}
    if passed or not candidates or round_ == config.max_rounds:
      if not passed:
        record["note"] = ("no FP8 site left to back off" if not candidates
                          else f"stopped after {config.max_rounds} back-offs")
      return progress.note(_final(plan, record), -1)
    excess = (f"held-out log loss {100 * rel:+.4f}% vs bf16+Mods exceeds "
              f"{100 * config.max_rel_logloss:g}%")
    if _ranked_by_report(ctx, config, candidates, config.held_out_one_program):
      # Only the forward pass moves a held-out evaluation.
      scores = report_scores(ctx.report, plan, candidates, "error", passes=("fwd",))
      worst = worst_by_report(scores)
      record["report_scores"] = recorded_scores(scores)
      reasons = {s: f"{excess}; ranked by the probe report's forward error" for s in worst}
    else:
      if config.held_out_one_program:
        measure = lambda site, choice: held_out_change_switched(ctx, candidates, site, size)
      else:
        measure = lambda site, choice: held_out_change(ctx, only_site(site, choice), size)
      plan, current = measure_sites(plan, "quality_held_out", round_, candidates, measure,
                                    progress, one_program=config.held_out_one_program)
      record["contributions"] = current
      # The site that raises the loss most: one that lowers it is offsetting, and backing
      # it off would widen the gap.
      site = max(current, key=lambda s: (current[s], s))
      worst = [site]
      reasons = {site: f"{excess}; this site alone: {100 * current[site]:+.4f}%"}
    since = len(plan["validation"])
    plan = add_validation(plan, record)
    for site in worst:
      # Held-out loss is the planned forward's: only a more accurate forward can help.
      plan = back_off_site(plan, ctx, site, reasons[site], step="quality_held_out",
                           must_improve=("fwd",))
    plan = progress.note(plan, since)
  return plan
