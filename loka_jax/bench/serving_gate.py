"""The served model's quality gate of the bench's `--serve_plan`.

A serving plan is selected from the probe report on the forward's accuracy and speed, and the
serving promotion adds forwards on accuracy alone and keeps them when the served step is
faster; neither looks at the served model's held-out quality, and validation judged only the
training plan's forwards, as training runs them. So before a target's serving plan is first
written, each candidate export (the serving proposal, the selected serving plan, the training
plan) is scored on the probe's trained parameters (`dispatch.serve_quality`, the 0.02%
held-out budget against served bf16+Mods) and saved beside the plans as serve_quality.json;
the bench then serves the first candidate within the budget, in that order (the proposal only
when it is also provably faster), else bf16+Mods' own all-bf16 export.

The scoring restores the probe's state (or trains the probe run again where its checkpoint is
absent, as validation does), before the bench builds its baseline, and frees it after.
"""
from __future__ import annotations

import gc
import os
from typing import Any, Dict, Mapping, Optional

from loka_jax import jsonio
from loka_jax.bench import planning

QUALITY_FILE = "serve_quality.json"
QUALITY_STEP = "serve_quality"   # a serving plan's back-off for the served quality
CANDIDATES = ("proposal", "selected", "training")   # the order the bench serves them in
ALL_BF16 = "all_bf16"   # served when no candidate is within the budget: bf16+Mods' export


def quality_path(plans_root: str, model: str, preset: str) -> str:
  return os.path.join(planning.plan_dir(plans_root, model, preset), QUALITY_FILE)


def load(plans_root: str, model: str, preset: str) -> Optional[Dict[str, Any]]:
  """The target's saved candidate scores ({candidate: measurement}), or None."""
  path = quality_path(plans_root, model, preset)
  if not os.path.exists(path):
    return None
  remedy = "delete it to score the serving candidates again"
  data = jsonio.read_json(path, "served-quality scores", remedy, ValueError)
  served = data.get("served") if isinstance(data, dict) else None
  if not isinstance(served, dict) or not all(
      isinstance(m, dict) and "within_budget" in m for m in served.values()):
    raise ValueError(f"{path}: no served-quality scores in it ('served' with a "
                     f"'within_budget' per candidate); {remedy}")
  return served


def score(plans_root: str, model: str, preset: str, context_factory, log=print
          ) -> Dict[str, Any]:
  """Scores the target's serving candidates once (`context_factory()`: the probe's
  ValidationContext) and saves them; later calls read the saved scores."""
  saved = load(plans_root, model, preset)
  if saved is not None:
    return saved
  from loka_jax.dispatch import read_plan, serve_quality
  selected, proposal, sites = planning.select_serving(plans_root, model, preset)
  candidates = {"selected": selected,
                "training": read_plan(planning.plan_path(plans_root, model, preset))}
  if sites:
    candidates["proposal"] = proposal
  report = planning.load_report(plans_root, model, preset)
  log(f"  scoring the served models ({', '.join(candidates)}) on the probe's trained "
      "parameters")
  ctx = context_factory()
  measured = serve_quality.served_quality(ctx, candidates, report)
  del ctx
  gc.collect()   # the probe's state must be gone before the bench builds its baseline
  jsonio.write_json_atomic(quality_path(plans_root, model, preset),
                           {"target": f"{model}/{preset}", "served": measured})
  for name, m in measured.items():
    log(f"  served {name}: {serve_quality.change_text(m['vs_served_bf16_mods'])} vs served "
        f"bf16+Mods ({'within' if m['within_budget'] else 'outside'} the budget)")
  return measured


def verdict(scores: Optional[Mapping[str, Any]], name: str) -> Optional[str]:
  """Why candidate `name` may not be served (outside the budget), or None when it may (or
  no score gates it: a serving plan made before the gate)."""
  m = (scores or {}).get(name)
  if m is None or m["within_budget"]:
    return None
  from loka_jax.dispatch.serve_quality import change_text
  return (f"its served held-out log loss is {change_text(m['vs_served_bf16_mods'])} from "
          f"served bf16+Mods, outside the {m['budget']:.2%} budget")
