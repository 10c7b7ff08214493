"""The main job's settings as recorded in its workdir (`job_settings.json`), and what a rerun
with other settings replaces.

Every part of the main job resumes from its files, so a rerun in the same workdir with other
settings must not reuse parts those settings change: a probe of another model, a plan selected
under another budget, arms trained for another number of steps. Each setting belongs to the
first stage it changes (probe, select, validate, arms); a rerun moves that stage's files and
every later stage's to `WORKDIR/replaced/STAMP/` (nothing is deleted) and says so.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Dict, List, Mapping, Optional

from loka_jax import jsonio
from loka_jax.dispatch import pipeline

SETTINGS_JSON = "job_settings.json"
STAGES = ("probe", "select", "validate", "arms")
# The files each stage writes in the workdir.
OUTPUTS = {
    "probe": (pipeline.PROBE_DIR, pipeline.REPORT_JSON),
    "select": (pipeline.SELECTED_JSON,),
    "validate": (pipeline.VALIDATING_JSON, pipeline.PLAN_JSON, pipeline.STATE_DIR),
    "arms": ("arms", "report.md", "plan.png", "arms.png"),
}
# Settings that change nothing already computed.
NEUTRAL = ("compilation_cache", "probe.compile_workers", "probe.checkpoint_every",
           "probe.compile_evaluation_while_training")


def flatten(settings: Mapping, prefix: str = "") -> Dict[str, object]:
  """{'group.field': value} of a nested settings dict."""
  out = {}
  for key, value in settings.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def stage_of(name: str) -> Optional[str]:
  """The first stage a setting changes (None: it changes nothing computed)."""
  if name in NEUTRAL:
    return None
  if name == "run.steps" or name.startswith("arms."):
    return "arms"
  group = name.split(".", 1)[0]
  return {"run": "probe", "probe": "probe", "select": "select",
          "validate": "validate"}.get(group, "probe")


def changes(old: Mapping, new: Mapping) -> List[str]:
  """'name: old -> new' of every setting that differs, sorted."""
  a, b = flatten(old), flatten(new)
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and stage_of(k) is not None]


def first_stage(old: Mapping, new: Mapping) -> Optional[str]:
  a, b = flatten(old), flatten(new)
  stages = {stage_of(k) for k in set(a) | set(b) if a.get(k) != b.get(k)} - {None}
  return min(stages, key=STAGES.index) if stages else None


def settle(workdir: str, settings: Mapping) -> Optional[str]:
  """Records `settings` in `workdir`; when the workdir holds a run made with other settings,
  first moves aside the files of every stage they change and returns a line saying what was
  replaced and where the old files are (None when nothing was). A workdir with files but no
  recorded settings is left as it is."""
  path = os.path.join(workdir, SETTINGS_JSON)
  message = None
  if os.path.exists(path):
    try:
      with open(path) as f:
        old = json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f"{path}: unreadable ({e}); delete it (the next run then redoes "
                       "nothing it finds) or use a new --workdir") from e
    stage = first_stage(old, settings)
    if stage is not None:
      later = STAGES[STAGES.index(stage):]
      moved = _move_aside(workdir, [n for s in later for n in OUTPUTS[s]])
      what = ", ".join(changes(old, settings))
      message = (f"settings differ from the run in {workdir} ({what}): redoing "
                 f"{', '.join(later)}" + (f"; the previous files are in {moved}" if moved
                                          else ""))
  elif any(os.path.exists(os.path.join(workdir, n)) for s in STAGES for n in OUTPUTS[s]):
    # Files of a run whose settings were never recorded: the pipeline checks that its probe
    # report is of this run, and `record` notes the settings once the job has finished.
    return None
  record(workdir, settings)
  return message


def record(workdir: str, settings: Mapping) -> None:
  """Notes in `workdir` the settings its files are made with."""
  os.makedirs(workdir, exist_ok=True)
  jsonio.write_json_atomic(os.path.join(workdir, SETTINGS_JSON), dict(settings))


def _move_aside(workdir: str, names) -> Optional[str]:
  present = [n for n in names if os.path.exists(os.path.join(workdir, n))]
  if not present:
    return None
  target = os.path.join(workdir, "replaced", time.strftime("%Y%m%d-%H%M%S"))
  suffix = 1
  while os.path.exists(target):
    target = f"{target.rsplit('~', 1)[0]}~{suffix}"
    suffix += 1
  os.makedirs(target)
  for name in present:
    shutil.move(os.path.join(workdir, name), os.path.join(target, name))
  return target
