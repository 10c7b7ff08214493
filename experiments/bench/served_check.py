"""The served model's quality behind a LoKA row's inference numbers.

A LoKA row's inference speed is its export's: weights stored once in e4m3, static activation
scales and, with `serving.plan`, FP8 forwards that the serving selection and promotion chose
on the forward's accuracy and speed alone. Validation never judged that model, so its
held-out quality is a measurement of its own (`dispatch.serve_quality`), and an inference
ratio measured on a model outside the quality budget is not a LoKA result: the report marks
those verdicts missed and says why (`targets.check_speed`).

The measurement comes from one of two places:
- the row itself: the bench's served-quality gate scores each serving candidate before it
  serves one, and the row's `serve_promotion.quality` is the served candidate's score;
- a report of `experiments.measure serving_quality` (JSON, one per target), for rows served before
  the gate existed. Such a report names no row, so it is applied only where the export it
  scored has the row's own export modes (how many sites it served in e4m3 and in bf16).
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence, Tuple

from loka_jax import jsonio
from experiments.bench import mods_set
from loka_jax.dispatch.serve_quality import SERVING_PLAN, TRAINING_PLAN, change_text

ReportKey = Tuple[str, str, Optional[str]]   # (model, preset, Mods-set label)


class ServedQualityError(ValueError):
  """A served-quality report that cannot be read (the message names the file)."""


def _served_entries(path: str, data) -> Dict[str, Mapping]:
  served = data.get("served") if isinstance(data, dict) else None
  if not isinstance(served, dict) or not served or not all(
      isinstance(m, dict) and {"within_budget", "budget", "vs_served_bf16_mods",
                               "export_modes"} <= set(m) for m in served.values()):
    raise ServedQualityError(
        f"{path}: not a served-quality report: expected 'served' with, per served model, "
        "'within_budget', 'budget', 'vs_served_bf16_mods' and 'export_modes' (written by "
        "experiments.measure serving_quality)")
  return served


def load_reports(paths: Sequence[str]) -> Dict[ReportKey, Dict]:
  """{(model, preset, Mods-set label): {"served": ..., "path": ...}} of the reports, a later
  file replacing an earlier one of the same target (list them oldest first)."""
  out: Dict[ReportKey, Dict] = {}
  for path in paths:
    if not os.path.isfile(path):
      raise ServedQualityError(f"served-quality report {path} does not exist")
    data = jsonio.read_json(path, "served-quality report",
                            "make it again with experiments.measure serving_quality",
                            ServedQualityError)
    served = _served_entries(path, data)
    model, _, preset = str(data.get("target", "")).partition("/")
    if not model or not preset:
      raise ServedQualityError(f"{path}: its 'target' is {data.get('target')!r}, expected "
                               "model/preset")
    out[(model, preset, data.get("mods_set"))] = {"served": served, "path": path}
  return out


def _modes(modes: Optional[Mapping[str, int]]) -> Dict[str, int]:
  return {m: int(n) for m, n in (modes or {}).items() if n}


def for_row(loka_row: Mapping, reports: Mapping[ReportKey, Mapping]) -> Optional[Dict]:
  """The held-out score of the model the LoKA row served, or None when nothing measured it:
  {"rel_logloss_change", "se", "budget", "within_budget", "source"}; or {"mismatch": why}
  when the target's report scored another export than the row served."""
  own = (loka_row.get("serve_promotion") or {}).get("quality")
  if own is not None:
    return {**own, "source": "the bench's served-quality gate"}
  key = (loka_row["model"], loka_row["preset"], mods_set.of_row(loka_row))
  report = reports.get(key)
  if report is None:
    return None
  name = SERVING_PLAN if loka_row.get("serve_plan") else TRAINING_PLAN
  measured = report["served"].get(name)
  if measured is None:
    return {"mismatch": f"{report['path']} has no score of {name}, the export this row served"}
  row_modes, report_modes = _modes(loka_row.get("export_modes")), _modes(
      measured["export_modes"])
  if row_modes != report_modes:
    return {"mismatch": f"{report['path']} scored {name} with export modes {report_modes}, "
                        f"but this row served {row_modes or 'unrecorded modes'}"}
  return {**measured["vs_served_bf16_mods"], "budget": measured["budget"],
          "within_budget": measured["within_budget"], "source": report["path"]}


def describe(score: Mapping) -> str:
  """A verdict's note on the served model's score."""
  return (f"served held-out log loss {change_text(score)} from served bf16+Mods, "
          f"{'within' if score['within_budget'] else 'outside'} the {score['budget']:.2%} "
          f"budget ({score['source']})")
