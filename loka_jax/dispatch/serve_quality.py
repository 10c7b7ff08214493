"""How far serving a model from its export moves held-out log loss.

Validation judges a plan's forwards as the training step runs them (delayed or current
scaling, weights cast on every call). The exported model serves them differently: weights
stored once in e4m3 and activation scales fixed from the probe's amax statistics, and a
serving plan may put FP8 forwards at sites the training plan keeps in bf16 (chosen on the
forward's accuracy and speed alone). So the served model's quality is its own measurement:
each export's held-out log loss on the probe's trained parameters, paired example by
example with bf16+Mods' (unexported, and served from its own all-bf16 export), with the
standard error of each change over the eval examples and the verdict of validation's
held-out budget.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import jax

from loka_jax.dispatch import export as export_lib
from loka_jax.dispatch.validate import BASELINE, ValidationContext, held_out
from loka_jax.train.loop import evaluate
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS, paired_logloss_change

SERVED_BF16 = "bf16_mods_served"
# The names `experiments.measure serving_quality` scores a LoKA target's exports under: its training
# plan's, and its serving plan's (plan_serve.json, with the bench's serving.plan).
TRAINING_PLAN = "loka"
SERVING_PLAN = "loka_serving_plan"


def exported_held_out(ctx: ValidationContext, plan, report: Optional[Mapping],
                      eval_batch_size: Optional[int] = None) -> Dict[str, Any]:
  """Held-out log loss / NE / AUC (with every example's logit and label) of the context's
  trained parameters served from their export under `plan`, calibrated by `report`, and
  the export's modes per site."""
  module = ctx.build(BASELINE)   # the bf16+Mods tower the plans were selected on
  exported = export_lib.export(module, ctx.state.params, plan, report, batch=ctx.batch())
  forward = jax.jit(exported.forward)
  size = min(eval_batch_size or ctx.batch_size, ctx.source.num_eval_examples())
  result = evaluate(lambda _, batch: forward(exported.variables, batch), None, ctx.source,
                    size, keep_scores=True)
  return {**result, "export_modes": exported.mode_counts(),
          "saved_fraction": exported.memory["saved_fraction"]}


def _change(got: Mapping, base: Mapping) -> Dict[str, float]:
  change, se = paired_logloss_change(got["logits"], base["logits"], base["labels"])
  return {"rel_logloss_change": change, "se": se}


def served_quality(ctx: ValidationContext, plans: Mapping[str, Any], report: Optional[Mapping],
                   eval_batch_size: Optional[int] = None,
                   budget: float = NEUTRAL_REL_LOGLOSS) -> Dict[str, Dict[str, Any]]:
  """{name: measurement} for bf16+Mods served from its all-bf16 export (`SERVED_BF16`) and
  each of `plans` ({name: plan}) served from its export: held-out `logloss`, `ne`, `auc`,
  `num_examples`, `export_modes`, the change against unexported bf16+Mods
  (`vs_bf16_mods`) and against served bf16+Mods (`vs_served_bf16_mods`), each a relative
  log-loss change with its standard error, and `within_budget`: whether the change against
  served bf16+Mods, which isolates what FP8 serving adds, is within `budget`."""
  return Scorer(ctx, report, eval_batch_size, budget).score(plans, with_baseline=True)


class Scorer:
  """`served_quality` for one context, its two references measured once however many plans
  are scored (the serving gate scores a few candidates, then trims the proposal)."""

  def __init__(self, ctx: ValidationContext, report: Optional[Mapping],
               eval_batch_size: Optional[int] = None, budget: float = NEUTRAL_REL_LOGLOSS):
    self.ctx, self.report, self.size, self.budget = ctx, report, eval_batch_size, budget
    self.reference = held_out(ctx, BASELINE, eval_batch_size)
    self.served_bf16 = exported_held_out(ctx, BASELINE, None, eval_batch_size)

  def score(self, plans: Mapping[str, Any], with_baseline: bool = False
            ) -> Dict[str, Dict[str, Any]]:
    got = [(SERVED_BF16, self.served_bf16)] if with_baseline else []
    got += [(n, exported_held_out(self.ctx, p, self.report, self.size)) for n, p in plans.items()]
    return {name: self._measurement(m) for name, m in got}

  def _measurement(self, got: Mapping[str, Any]) -> Dict[str, Any]:
    reference, served_bf16, budget = self.reference, self.served_bf16, self.budget
    vs_served = _change(got, served_bf16)
    out = {k: got[k] for k in ("logloss", "ne", "auc", "num_examples",
                               "export_modes", "saved_fraction") if k in got}
    out.update(vs_bf16_mods=_change(got, reference), vs_served_bf16_mods=vs_served,
               budget=budget, within_budget=abs(vs_served["rel_logloss_change"]) <= budget)
    return out


def change_text(change: Mapping[str, float]) -> str:
  """A relative log-loss change with its standard error, e.g. '+0.0842% +- 0.0143%'."""
  return f"{change['rel_logloss_change']:+.4%} +- {change['se']:.4%}"


def table(measured: Mapping[str, Mapping[str, Any]]) -> str:
  """A markdown table of `served_quality`'s result, one line per served model."""
  lines = ["| served model | export modes | held-out log loss | vs bf16+Mods | "
           "vs served bf16+Mods | within budget |", "|---|---|---|---|---|---|"]
  for name, m in measured.items():
    modes = ", ".join(f"{n} {mode}" for mode, n in sorted(m["export_modes"].items()) if n)
    lines.append(f"| {name} | {modes} | {m['logloss']:.5f} | {change_text(m['vs_bf16_mods'])} | "
                 f"{change_text(m['vs_served_bf16_mods'])} | "
                 f"{'yes' if m['within_budget'] else 'no'} ({m['budget']:.2%}) |")
  return "\n".join(lines)
