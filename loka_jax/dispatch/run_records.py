"""A plan's validation read back: where it stands and what its training runs did.

Validation records every training run of the shadow check and the check from
initialization as it ends (`validate.run_step`), so a plan saved mid-check (a paused
`plan_validating.json`) already says how its runs went, seed by seed, before the check's
verdict exists. These functions turn those records into a status line, a table with each
plan run's change against bf16+Mods at the same seed and recipe, and the runs' loss curves
(`validate.loss_curve`), which show when a run left a plateau (as Wukong `large`'s runs
do). `experiments.report validation` prints
and plots them.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from loka_jax.dispatch import validate
from loka_jax.plan.file import as_plan

TRAINING_CHECKS = ("quality_shadow", "quality_from_init")
# What a run record holds besides its recipe: its arm (the noise floor's jitter and a plan
# run's sites among it), its results and bookkeeping.
_NOT_RECIPE = frozenset({"step", "time", "seed", "arm", "sites", "jitter", "finite",
                         "window_loss", "peak_loss", "logloss", "logloss_bf16_forward", "auc",
                         "calibration", "loss_curve", "seconds"})


def status(plan) -> str:
  """One line: validated (and what it changed), not validated (why), or in progress (the
  checks finished and the one a resumed call goes on with)."""
  plan = as_plan(plan)
  for record in reversed(plan["validation"]):
    if record.get("step") == "validated":
      changed = [f"backed off {len(record['backed_off'])}" if record["backed_off"] else "",
                 f"promoted {len(record['promoted'])}" if record.get("promoted") else ""]
      changed = ", ".join(c for c in changed if c) or "no site changed"
      return (f"validated: FP8 sites {record['fp8_sites_before']} -> "
              f"{record['fp8_sites_after']} ({changed})")
    if record.get("step") == "not_validated":
      return f"not validated: {record.get('reason', '')}"
  if not plan["validation"]:
    return "not validated yet: no validation record"
  done = [step for step, _ in validate.CHECKS if validate.finished(plan, step)]
  pending = [step for step, _ in validate.CHECKS if step not in done]
  return ("validation in progress: finished " + (", ".join(done) or "no check")
          + (f"; next {pending[0]}" if pending else ""))


def recipe_of(record: Mapping[str, Any]) -> Dict[str, Any]:
  """A run record's recipe (steps, start, window, warm-up, ...): what its arm's runs at
  other seeds share and its baseline run must match."""
  return {k: v for k, v in record.items() if k not in _NOT_RECIPE}


def _recipe_key(record: Mapping[str, Any]) -> str:
  return json.dumps(recipe_of(record), sort_keys=True)


def training_runs(plan) -> Dict[str, List[Dict[str, Any]]]:
  """{check: its run records in the order they ran}, for the training checks with any
  (records of a check reopened since are kept: they are the history its rounds read)."""
  plan = as_plan(plan)
  out: Dict[str, List[Dict[str, Any]]] = {}
  for check in TRAINING_CHECKS:
    runs = validate.validation_records(plan, validate.run_step(check))
    if runs:
      out[check] = runs
  return out


def arm_labels(runs: Sequence[Mapping[str, Any]]) -> List[str]:
  """Each run's arm, as its table row and curve name it: a plan run names how many sites it
  ran in FP8, and where the runs hold plans of more than one round (each round's plan its
  own set of site choices), which one, in the order they ran; a noise-floor run names its
  jitter."""
  plans: List[Any] = []
  for r in runs:
    if r.get("sites") is not None and r["sites"] not in plans:
      plans.append(r["sites"])
  labels = []
  for r in runs:
    label = r["arm"]
    if r.get("sites") is not None:
      which = f" {plans.index(r['sites']) + 1}" if len(plans) > 1 else ""
      label += f"{which} ({len(r['sites'])} FP8 sites)"
    if r.get("jitter"):
      label += f" (jitter {r['jitter']:g})"
    labels.append(label)
  return labels


def paired_change(record: Mapping[str, Any],
                  runs: Sequence[Mapping[str, Any]]) -> Optional[float]:
  """The relative change of `record`'s held-out log loss from the bf16+Mods run at its seed
  and recipe among `runs`; None for a baseline run, a run without that pair, or a
  non-finite one."""
  if record["arm"] == validate.BASELINE_ARM or not record.get("finite"):
    return None
  for base in runs:
    if (base["arm"] == validate.BASELINE_ARM and base["seed"] == record["seed"]
        and base.get("finite") and _recipe_key(base) == _recipe_key(record)):
      return record["logloss"] / base["logloss"] - 1.0
  return None


def _number(value: Optional[float], fmt: str) -> str:
  return "-" if value is None else format(value, fmt)


def _recipe_text(recipe: Mapping[str, Any]) -> str:
  parts = [f"{recipe['steps']} steps from {recipe['start']}"]
  for key, name in (("warmup_steps", "warm-up"), ("warmup_after_switch",
                                                  "warm-up after the switch"),
                    ("clip_norm", "clip")):
    if recipe.get(key):
      parts.append(f"{name} {recipe[key]:g}")
  return ", ".join(parts)


def runs_tables(check: str, runs: Sequence[Mapping[str, Any]]) -> List[str]:
  """Markdown, one table per recipe of `check`'s runs under a line naming it: one row per run
  (arm, seed, the last window's training loss, held-out log loss with its change from
  bf16+Mods at the same seed, AUC, calibration, the worst step's loss, seconds)."""
  by_recipe: Dict[str, List[Tuple[str, Mapping[str, Any]]]] = {}
  for label, r in zip(arm_labels(runs), runs):
    by_recipe.setdefault(_recipe_key(r), []).append((label, r))
  blocks = []
  for labelled in by_recipe.values():
    group = [r for _, r in labelled]
    recipe = recipe_of(group[0])
    lines = [f"{check}, {_recipe_text(recipe)} (training loss: mean of the last "
             f"{recipe.get('window')} steps):", "",
             "| arm | seed | train loss | held-out log loss | vs bf16+Mods | AUC | "
             "calibration | worst step | s |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in sorted(labelled, key=lambda x: (x[1]["arm"] != validate.BASELINE_ARM,
                                                    x[0], x[1]["seed"])):
      finite = r.get("finite")
      change = paired_change(r, group)
      lines.append(
          f"| {label} | {r['seed']} | "
          + (f"{r['window_loss']:.5f} | {r['logloss']:.5f} | " if finite
             else "non-finite | - | ")
          + ("-" if change is None else f"{100 * change:+.3f}%") + " | "
          + f"{_number(r.get('auc') if finite else None, '.4f')} | "
          + f"{_number(r.get('calibration') if finite else None, '.4f')} | "
          + f"{_number(r.get('peak_loss') if finite else None, '.3g')} | "
          + f"{_number(r.get('seconds'), 'g')} |")
    blocks.append("\n".join(lines))
  return blocks


def curves(runs: Sequence[Mapping[str, Any]]) -> Dict[Tuple[str, int], List[Optional[float]]]:
  """{(arm label, seed): loss curve} of the runs that recorded one (runs recorded before
  curves were have none)."""
  return {(label, r["seed"]): list(r["loss_curve"]) for label, r in zip(arm_labels(runs), runs)
          if r.get("loss_curve")}


def curves_table(curves: Mapping[Tuple[str, Any], Sequence[Optional[float]]],
                 panel: str = "seed") -> str:
  """Markdown: one row per (arm, `panel`) curve, its points to 3 decimals ('-' for a block
  with a non-finite step)."""
  lines = [f"| arm | {panel} | loss curve |", "|---|---|---|"]
  for (arm, which), curve in curves.items():
    lines.append(f"| {arm} | {which} | "
                 + " ".join("-" if x is None else f"{x:.3f}" for x in curve) + " |")
  return "\n".join(lines)
