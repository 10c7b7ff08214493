"""Measuring part of a benchmark target again: its rows and plan files moved aside, never lost.

The bench resumes: a finished row is skipped, and a plan file once written is read back
rather than made again. To measure something again after a change (a serving plan made
under the served-quality gate, a plan validated with the check from initialization), its
rows and files have to leave the workdir. `forget` moves them to WORKDIR/forgotten/STAMP/
(the rows into a results file of the same name, a quality row's run folder under quality/,
the plan files, and the probe's report and folder and validation's probe run where named,
under plans/TARGET/) and writes a manifest there, so the next bench call measures them
again and every measurement made before stays readable.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Dict, List, Optional, Sequence

from loka_jax import jsonio
from loka_jax.dispatch import pipeline
from experiments.bench import mods_set, planning
from experiments.bench import quality as quality_lib
from experiments.bench import serving_gate
from experiments.bench.variants import VARIANTS

RESULTS = {"models": "bench.jsonl", "towers": "bench.jsonl", "quality": "quality.jsonl"}
# The plan files a target's rows are made from, in the order the bench writes them, then
# its probe's report and folder and the probe run that validation made again where the
# probe's checkpoints were not carried: named too, they make the next call probe the target
# again (after a change to what the probe measures, e.g. which kernels it times).
PLAN_FILES = ("plan_selected.json", "plan_validating.json", planning.PLAN_FILE,
              serving_gate.QUALITY_FILE, planning.SERVING_PLAN_FILE, pipeline.REPORT_JSON,
              pipeline.PROBE_DIR, pipeline.STATE_DIR)
FORGOTTEN = "forgotten"
MANIFEST = "forgotten.json"


class ForgetError(ValueError):
  """A request that names nothing the workdir holds, or names it wrongly."""


def _matches(row, suite: str, model: str, preset: str, names: Sequence[str],
             set_label: Optional[str]) -> bool:
  if not isinstance(row, dict) or row.get("suite") != suite:
    return False
  name = row.get("arm" if suite == "quality" else "variant")
  return (row.get("model") == model and row.get("preset") == preset and name in names
          and mods_set.of_row(row) == set_label)


def _check_names(suite: str, names: Sequence[str]) -> None:
  if suite not in RESULTS:
    raise ForgetError(f"unknown suite {suite!r}; valid: {', '.join(RESULTS)}")
  valid = quality_lib.ARMS if suite == "quality" else VARIANTS
  unknown = [n for n in names if n not in valid]
  if unknown or not names:
    raise ForgetError(f"unknown {'arm' if suite == 'quality' else 'variant'}(s) "
                      f"{unknown or '(none named)'} for the {suite} suite; valid: "
                      f"{', '.join(valid)}")


def _split_rows(path: str, keep_if) -> tuple:
  """(lines kept, lines moved) of a results file; a line that is not JSON is kept as is."""
  kept: List[str] = []
  moved: List[str] = []
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        kept.append(line)
        continue
      (kept if keep_if(row) else moved).append(line if line.endswith("\n") else line + "\n")
  return kept, moved


def _move_run_folders(workdir: str, dest: str, moved_lines: Sequence[str]) -> List[str]:
  """Moves the run folder of each moved quality row that has one (a LoKA row that is
  bf16+Mods' twin has none of its own) from WORKDIR/quality/ to DEST/quality/; returns their
  paths relative to WORKDIR."""
  root = os.path.join(workdir, quality_lib.RUNS_FOLDER)
  out = []
  for line in moved_lines:
    folder = quality_lib.run_dir(root, json.loads(line))
    if os.path.isdir(folder):   # a second row of one run finds it moved already
      target = os.path.join(dest, os.path.relpath(folder, workdir))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.replace(folder, target)
      out.append(os.path.relpath(folder, workdir))
  return out


def forget(workdir: str, *, suite: str, model: str, preset: str, names: Sequence[str],
           mods: Sequence[str] = mods_set.DEFAULT, plan_files: Sequence[str] = (),
           plans_dir: Optional[str] = None, stamp: Optional[str] = None) -> Dict:
  """Moves the target's rows of `names` (variants, or arms of the quality suite) and its
  `plan_files` (names from PLAN_FILES: plan files, the probe's report and folder, or the
  probe run validation made again) to WORKDIR/forgotten/STAMP/; returns the manifest.
  The rows are copied there before the results file is rewritten without them, so a kill
  in between leaves them in both places, never in neither."""
  _check_names(suite, names)
  bad = [f for f in plan_files if f not in PLAN_FILES]
  if bad:
    raise ForgetError(f"unknown plan file(s) {bad}; valid: {', '.join(PLAN_FILES)}")
  set_label = mods_set.label(mods)
  plans_dir = plans_dir or os.path.join(workdir, "plans")
  folder = planning.plan_dir(mods_set.plans_root(plans_dir, mods), model, preset)
  results = os.path.join(workdir, RESULTS[suite])
  kept, moved = _split_rows(results, lambda r: not _matches(
      r, suite, model, preset, names, set_label)) if os.path.exists(results) else ([], [])
  files = [f for f in plan_files if os.path.exists(os.path.join(folder, f))]
  target = mods_set.subject(model, preset, set_label)
  if not moved and not files:
    raise ForgetError(f"nothing to forget: {results} has no {suite} row of {target} for "
                      f"{', '.join(names)}, and {folder} has none of "
                      f"{', '.join(plan_files) or 'no plan files named'}")
  stamp = stamp or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  dest = os.path.join(workdir, FORGOTTEN, stamp)
  os.makedirs(dest, exist_ok=True)
  if moved:
    with open(os.path.join(dest, RESULTS[suite]), "a") as f:
      f.writelines(moved)
      f.flush()
      os.fsync(f.fileno())
    jsonio.write_text_atomic(results, "".join(kept))
  # A quality row's run folder goes with it: left behind, it would hold a run the next call
  # refuses to resume under other settings (a new plan). Moved after the rows are written
  # out, so a kill in between leaves a folder the bench refuses loudly, never a lost run.
  runs = _move_run_folders(workdir, dest, moved) if suite == "quality" else []
  if files:
    plan_dest = os.path.join(dest, "plans", os.path.relpath(folder, plans_dir))
    os.makedirs(plan_dest, exist_ok=True)
    for f in files:
      os.replace(os.path.join(folder, f), os.path.join(plan_dest, f))
  manifest = {"stamp": stamp, "suite": suite, "target": target, "names": list(names),
              "rows": len(moved), "rows_from": results, "run_folders": runs,
              "plan_files": files, "plans_from": folder}
  manifest_path = os.path.join(dest, MANIFEST)
  earlier = (jsonio.read_json(manifest_path, "forget manifest", "", ForgetError)
             if os.path.exists(manifest_path) else [])
  jsonio.write_json_atomic(manifest_path, list(earlier) + [manifest])
  return manifest
