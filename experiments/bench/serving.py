"""The LoKA arm's served inference in the speed suites: the export of its plan
(`serve_exported`), the choice between a serving plan and its serving proposal timed in one
interleaving (`decide_serving`), the fall-back when the served-quality gate finds a candidate
outside its budget (`within_quality`) and the row's account of it (`serving_summary`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Sequence

import jax

from experiments.bench import planning, serving_gate, speed

if TYPE_CHECKING:
  from experiments.bench.suite import SpeedSettings, Target


def serve_exported(bench: speed.TargetBench, arm: speed.Arm, model, plan, report):
  """(arm, row fields): the LoKA arm with its inference served by the exported model, i.e.
  FP8-stored weights and static activation scales from the probe's amax (`dispatch.export`),
  on the parameters the arm trains."""
  from loka_jax.dispatch import export as export_lib
  exported = export_lib.export(model, bench.state_of(arm.name).params, plan, report,
                               batch=bench.batch)
  fields = {"export": True, "export_modes": exported.mode_counts(),
            "export_saved_fraction": round(exported.memory["saved_fraction"], 4)}
  return bench.with_inference(arm, exported.forward, exported.variables), fields


SERVE_PROMOTION = "serve_promotion"


def decide_serving(bench: speed.TargetBench, arm: speed.Arm, model, report,
                   settings: SpeedSettings, chosen: Dict, target: Target, selected, proposal,
                   sites: Sequence[str]):
  """The serving plan to keep: `proposal` (`dispatch.serving_proposal`: `sites` served in FP8
  besides) when its export serves provably faster than `selected`'s, both timed in one
  interleaving of inference steps (speedup CI above 1); else `selected`. On a GPU only unless
  `settings.serve_promotion` says otherwise. The decision is recorded in the plan's
  `validation` (`serve_promotion`); `chosen` receives the kept plan's export arm and row
  fields, so it is not built again. With the served-quality gate, only a candidate whose
  saved score (`serving_gate`) is within the budget is served: a proposal outside it is not
  timed (the gate's `trimmed` proposal, within it, is timed in its place), and a selected
  plan outside it gives way (`within_quality`)."""
  from loka_jax.dispatch import add_validation
  from loka_jax.dispatch.validate import on_gpu_unless
  record = {"step": SERVE_PROMOTION, "sites": list(sites)}
  scores = (serving_gate.load(settings.plans_root, target.model, target.preset)
            if settings.serve_quality_gate else None)
  selected, candidate, fallback = within_quality(
      selected, scores, planning.plan_path(settings.plans_root, target.model, target.preset))
  if fallback:
    record["quality_fallback"] = fallback
  if scores is not None:
    record["quality"] = {n: {**m["vs_served_bf16_mods"], "within_budget": m["within_budget"],
                             "budget": m["budget"]} for n, m in scores.items()}
  record["served"] = candidate   # which candidate's forwards the plan serves (its score)
  outside = serving_gate.verdict(scores, "proposal")
  offered = "proposal"   # the candidate timed against `selected`
  if sites and outside and candidate == "selected" and serving_gate.TRIMMED in scores:
    # The proposal trimmed to its most accurate added forwards, within the budget, is timed
    # in its place (`serving_gate`).
    kept = scores[serving_gate.TRIMMED]["sites"]
    proposal = serving_gate.trimmed(proposal, sites, kept)
    record.update(trimmed={"kept": list(kept), "of": len(sites), "why": (
        f"the whole proposal is not served: {outside}")}, sites=list(kept))
    sites, offered, outside = kept, serving_gate.TRIMMED, None
  if sites and outside:
    return add_validation(selected, {**record, "skipped": True, "reason": (
        f"the proposal is not served: {outside}")})
  if not sites:
    return add_validation(selected, {**record, "skipped": True, "reason": (
        "no site served in xla_bf16 has an FP8 forward safe on accuracy alone that the "
        "export serves as a static-scale e4m3 dot")})
  enabled, why = on_gpu_unless(settings.serve_promotion, "serve_promotion",
                               "promote serving forwards")
  if not enabled:
    return add_validation(selected, {**record, "skipped": True, "reason": why})
  exports = {"selected": serve_exported(bench, arm, model, selected, report)}
  try:  # a proposal that cannot be served or timed costs the row nothing: selected stands
    exports["proposal"] = serve_exported(bench, arm, model, proposal, report)
    pair = bench.head_to_head(exports["proposal"][0], {"selected": exports["selected"][0]},
                              settings.repeats, seed=settings.seed, modes=("infer",))
  except Exception as e:  # e.g. an export error, or out of memory with both exports alive
    exports.pop("proposal", None)
    chosen["arm"], chosen["fields"] = exports["selected"]
    return add_validation(selected, {**record, "skipped": True, "reason": (
        f"the proposal failed: {type(e).__name__}: {str(e)[:300]}")})
  infer = pair["selected"]["infer"]
  keep = infer["ci"][0] > 1.0
  record.update(device=jax.devices()[0].device_kind, why=why, repeats=settings.repeats,
                infer={"speedup": infer["ratio"], "speedup_ci": infer["ci"],
                       "proposal_median_us": infer["median_us"],
                       "selected_median_us": infer["other_median_us"]},
                promoted=keep)
  kept = "proposal" if keep else "selected"
  chosen["arm"], chosen["fields"] = exports[kept]  # the other export goes with `exports`
  if keep:
    record["served"] = offered
  return add_validation(proposal if keep else selected, record)


def within_quality(selected, scores, training_path: str):
  """(the plan to serve unless the proposal wins, the candidate it is, why it is not
  `selected`): `selected` when its served quality is within the budget (or unscored), else
  the training plan (`"training"`) when its export is, else bf16+Mods' all-bf16 forwards
  (`serving_gate.ALL_BF16`)."""
  outside = serving_gate.verdict(scores, "selected")
  if outside is None:
    return selected, "selected", None
  why = f"the selected serving plan is not served: {outside}"
  training_outside = serving_gate.verdict(scores, "training")
  if training_outside is None:
    from loka_jax import dispatch
    return (dispatch.read_plan(training_path), "training",
            why + "; served from the training plan's forwards instead")
  reasons = {n: f"{why}; the training plan's export too: {training_outside}"
             for n in selected["sites"]}
  return (planning.forwards_in_bf16(selected, reasons, serving_gate.QUALITY_STEP),
          serving_gate.ALL_BF16, why + "; served with every forward in bf16 instead")


def serving_summary(plan) -> Dict:
  """The row's account of the serving plan's promotion record (empty: none recorded), with
  the served candidate's held-out score where the gate scored it (`quality`)."""
  records = [r for r in plan["validation"] if r.get("step") == SERVE_PROMOTION]
  if not records:
    return {}
  r = records[-1]
  out = {"sites": len(r.get("sites", []))}
  score = (r.get("quality") or {}).get(r.get("served"))
  if score is not None:
    out["quality"] = score
  if r.get("skipped"):
    return {**out, "skipped": r.get("reason")}
  return {**out, "promoted": r["promoted"], "speedup": r["infer"]["speedup"],
          "speedup_ci": r["infer"]["speedup_ci"]}
