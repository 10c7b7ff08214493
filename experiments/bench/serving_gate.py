"""The served model's quality gate of the bench's `serving.plan`.

A serving plan is selected from the probe report on the forward's accuracy and speed, and the
serving promotion adds forwards on accuracy alone and keeps them when the served step is
faster; neither looks at the served model's held-out quality, and validation judged only the
training plan's forwards, as training runs them. So before a target's serving plan is first
written, each candidate export (the serving proposal, the selected serving plan, the training
plan) is scored on the probe's trained parameters (`dispatch.serve_quality`, the 0.02%
held-out budget against served bf16+Mods) and saved beside the plans as serve_quality.json;
the bench then serves the first candidate within the budget, in that order (the proposal only
when it is also provably faster), else bf16+Mods' own all-bf16 export.

A proposal outside the budget need not be given up whole: it adds FP8 forwards at sites the
selected plan keeps in bf16, chosen on their error alone, and a few of them may carry its whole
change (at DHEN `large` the 48 it adds moved held-out log loss by +0.13% while the selected
plan's 13 moved it +0.0004%, H200). So, when the selected plan is within the budget, the gate
ranks the proposal's added sites by the probe report's forward error and bisects on how many of
the most accurate to keep (at most `TRIM_SCORINGS` more exports scored), and saves the largest
set it measured within the budget as the candidate `trimmed` (its `sites`), which the bench then
times in the proposal's place.

The scoring restores the probe's state (or trains the probe run again where its checkpoint is
absent, as validation does), before the bench builds its baseline, and frees it after.
"""
from __future__ import annotations

import gc
import os
from typing import Any, Dict, Mapping, Optional, Sequence

from loka_jax import jsonio
from experiments.bench import planning

QUALITY_FILE = "serve_quality.json"
QUALITY_STEP = "serve_quality"   # a serving plan's back-off for the served quality
CANDIDATES = ("proposal", "selected", "training")   # the order the bench serves them in
ALL_BF16 = "all_bf16"   # served when no candidate is within the budget: bf16+Mods' export
TRIMMED = "trimmed"     # the proposal with only its most accurate added forwards in FP8
TRIM_SCORINGS = 4       # exports the bisection scores at most (2^4 = 16 sites resolved)


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


def score(plans_root: str, model: str, preset: str, context_factory, log=print,
          budget: Optional[float] = None) -> Dict[str, Any]:
  """Scores the target's serving candidates once (`context_factory()`: the probe's
  ValidationContext), trims an outside proposal (module docstring) and saves the scores;
  later calls read the saved scores. `budget`: the held-out budget (None: validation's)."""
  saved = load(plans_root, model, preset)
  if saved is not None:
    return saved
  from loka_jax.dispatch import read_plan, serve_quality
  from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS
  selected, proposal, sites = planning.select_serving(plans_root, model, preset)
  candidates = {"selected": selected,
                "training": read_plan(planning.plan_path(plans_root, model, preset))}
  if sites:
    candidates["proposal"] = proposal
  report = planning.load_report(plans_root, model, preset)
  log(f"  scoring the served models ({', '.join(candidates)}) on the probe's trained "
      "parameters")
  scorer = serve_quality.Scorer(context_factory(), report,
                                budget=NEUTRAL_REL_LOGLOSS if budget is None else budget)
  measured = scorer.score(candidates, with_baseline=True)
  for name, m in measured.items():
    log(f"  served {name}: {serve_quality.change_text(m['vs_served_bf16_mods'])} vs served "
        f"bf16+Mods ({'within' if m['within_budget'] else 'outside'} the budget)")
  trim = None
  if sites and not measured["proposal"]["within_budget"] and measured["selected"]["within_budget"]:
    trim = _trim(scorer, report, proposal, sites, log)
    if trim["kept"]:
      measured[TRIMMED] = {**trim["measurement"], "sites": trim["kept"]}
  del scorer
  gc.collect()   # the probe's state must be gone before the bench builds its baseline
  jsonio.write_json_atomic(quality_path(plans_root, model, preset),
                           {"target": f"{model}/{preset}", "served": measured,
                            **({"trim": {k: v for k, v in trim.items() if k != "measurement"}}
                               if trim else {})})
  return measured


def trimmed(proposal, sites: Sequence[str], keep: Sequence[str]):
  """`proposal` with the forwards of `sites` (those it adds) back in bf16 but for `keep`."""
  return planning.forwards_in_bf16(
      proposal, {s: f"served quality: the proposal trimmed to its {len(keep)} most accurate "
                    "added forwards" for s in sites if s not in keep}, QUALITY_STEP)


def _trim(scorer, report, proposal, sites: Sequence[str], log) -> Dict[str, Any]:
  """The bisection of the module docstring: {"ranked": sites most accurate first, "tried":
  [{"keep", "within_budget", "rel_logloss_change"}], "kept": the largest set measured within
  the budget (empty: none), "measurement": its score}."""
  from loka_jax.dispatch.serve_quality import change_text
  from loka_jax.dispatch.validate import report_scores
  errors = report_scores(report, proposal, {s: proposal.choice_for(s) for s in sites},
                         "error", passes=("fwd",))
  ranked = sorted(sites, key=lambda s: (errors[s], s))   # least error first
  lo, hi, tried, best = 0, len(ranked), [], None          # lo within (selected), hi outside
  while hi - lo > 1 and len(tried) < TRIM_SCORINGS:
    keep = ranked[:(lo + hi) // 2]
    m = scorer.score({TRIMMED: trimmed(proposal, sites, keep)})[TRIMMED]
    tried.append({"keep": len(keep), "within_budget": m["within_budget"],
                  "rel_logloss_change": m["vs_served_bf16_mods"]["rel_logloss_change"]})
    log(f"  served proposal with its {len(keep)} of {len(ranked)} most accurate added "
        f"forwards: {change_text(m['vs_served_bf16_mods'])} "
        f"({'within' if m['within_budget'] else 'outside'} the budget)")
    if m["within_budget"]:
      lo, best = len(keep), m
    else:
      hi = len(keep)
  return {"ranked": ranked, "tried": tried, "kept": ranked[:lo], "measurement": best}


def verdict(scores: Optional[Mapping[str, Any]], name: str) -> Optional[str]:
  """Why candidate `name` may not be served (outside the budget), or None when it may (or
  no score gates it: a serving plan made before the gate)."""
  m = (scores or {}).get(name)
  if m is None or m["within_budget"]:
    return None
  from loka_jax.dispatch.serve_quality import change_text
  return (f"its served held-out log loss is {change_text(m['vs_served_bf16_mods'])} from "
          f"served bf16+Mods, outside the {m['budget']:.2%} budget")
