"""The rows of `experiments.report time_to_plan` (experiments/tools/time_to_plan.py): how long
the main job (`python3 -m experiments.loka`) takes to reach a plan, cold and warm, read from
the stamped logs `experiments/gpu_main_job_call.sh` writes. No flags, so tests and other tools
import it freely.

Each log line there starts with the seconds since the run began (the call's `stamp`), so a
stage's time is the difference of the stamps of the lines that end it and the one before.
The patterns below match the lines the job prints; each names the module that prints it, so
a changed message is found by searching for its pattern's source."""
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from loka_jax import jsonio
from loka_jax.kernels import registry
from loka_jax.kernels.spec import PASSES


class MainJobRowError(ValueError):
  """A log (or plan) that cannot make a row (the message names the file and what is
  missing)."""


# experiments/gpu_main_job_call.sh (its `stamp`): f"{seconds:7.1f} {line}"; an empty line
# keeps the stamp and its space, which an editor may strip.
STAMPED = re.compile(r"^\s*(\d+(?:\.\d+)?)(?: (.*))?$")
# experiments/loka.py: the job's first line, "== probe -> dispatch -> validate: {model}/
# {preset} on {data} -> {workdir}".
JOB = re.compile(r"^== probe -> dispatch -> validate: ([^/\s]+)/(\S+) on ")
# loka_jax/probe/runner.py (its `_log`): the probe's start, its training and its evaluation.
SITES = re.compile(r"^\[probe\] \S+: \d+ sites; training to step ")
TRAINED = re.compile(r"^\[probe\] trained to step \d+")
EVALUATED = re.compile(r"^\[probe\] evaluation phase: ")
# loka_jax/probe/assemble.py (its `_log`): the kernel timing's summary, and its counts.
TIMED = re.compile(r"^\[probe\] timing: ")
KERNEL_PASSES = re.compile(
    r"^\[probe\] timing: (?P<measured>\d+) kernel passes measured, (?P<reused>\d+) reused "
    r"from this card's committed table, (?P<not_safe>\d+) not timed \(no site of their shape "
    r"admits them on accuracy\), (?P<dominated>\d+) not timed \(dominated on this card\)")
# loka_jax/dispatch/pipeline.py (its `_log`): the validated plan, before the arms train.
PLAN = re.compile(r"^\[pipeline\] plan: ")
# experiments/loka_report.py: the report's heading (printed once the arms are done) and its
# "Probe:" line, which lists the candidate kernels.
REPORT = re.compile(r"^# loka_jax main job: ")
CANDIDATES = re.compile(r"^Probe: .*?\bcandidates (.*?)\. Selection budget")
# loka_jax/train/report.py (`plan_table`): the plan's table in the report, one row a site
# ("(other sites)": the default), a kernel per pass, " *" marking a validation back-off.
PLAN_TABLE = "| site | fwd | dgrad | wgrad |"
DEFAULT_ROW = "(other sites)"

# The stages of a cold run, each ending at the line its pattern matches: the first starts at
# the process's start, each other at the end of the one before.
STAGES = (("start", SITES), ("probe_training", TRAINED), ("evaluation", EVALUATED),
          ("timing", TIMED), ("report_select_validate", PLAN), ("arms", REPORT))


def read_log(path: str) -> List[Tuple[float, str]]:
  """(seconds, text) of each stamped line of `path`, from the job's first line on; a file
  without that line is no log of the main job."""
  try:
    with open(path, errors="replace") as f:
      raw = f.read().splitlines()
  except OSError as e:
    raise MainJobRowError(f"{path}: cannot read the main job's log ({e})") from None
  lines = [(float(m[1]), m[2] or "") for m in map(STAMPED.match, raw) if m]
  for i, (_, text) in enumerate(lines):
    if JOB.match(text):
      return lines[i:]
  raise MainJobRowError(
      f"{path}: not a log of the main job (no \"== probe -> dispatch -> validate\" line): "
      "give the stamped output of `python3 -m experiments.loka` that "
      "experiments/gpu_main_job_call.sh writes ($OUT/cold.log, $OUT/warm.log)")


def stage_ends(lines: List[Tuple[float, str]]) -> Dict[str, float]:
  """{stage: the stamp of the line that ends it} for the stages whose line is there, each
  searched for after the line of the one before (a stage whose line is missing is left out
  and the search goes on from where it stood)."""
  ends, at = {}, 0
  for name, pattern in STAGES:
    for i in range(at, len(lines)):
      if pattern.match(lines[i][1]):
        ends[name], at = lines[i][0], i + 1
        break
  return ends


def stages(ends: Mapping[str, float], complete: bool, last: float
           ) -> Dict[str, Optional[float]]:
  """Each stage's seconds (None where the line of its start or end is missing). A cut run
  has the stages it finished and the one it was in as "<stage>_incomplete", up to its last
  stamp; the stages it never began are left out."""
  reached = [i for i, (name, _) in enumerate(STAGES) if name in ends]
  cut = None if complete else (reached[-1] + 1 if reached else 0)
  out, start = {}, 0.0
  for i, (name, _) in enumerate(STAGES):
    if i == cut:
      out[f"{name}_incomplete"] = round(last - start, 1)
      break
    end = ends.get(name)
    out[name] = None if start is None or end is None else round(end - start, 1)
    start = end
  return out


def kernel_passes(lines: List[Tuple[float, str]]) -> Optional[Dict[str, int]]:
  """The timing summary's counts of kernel passes (the last summary; None without one)."""
  found = [m for m in (KERNEL_PASSES.match(text) for _, text in lines) if m]
  return {k: int(v) for k, v in found[-1].groupdict().items()} if found else None


def _fp8_site(kernels: Mapping[str, str]) -> bool:
  """Whether a site runs any pass in FP8 ({pass: kernel}; a kernel that names itself in
  every pass may quantize only some, `Kernel.quantizes`)."""
  return any(registry.quantizes(kernels[p], p) for p in PASSES)


def table_fp8_sites(lines: List[Tuple[float, str]]) -> Optional[int]:
  """The sites of the report's plan table that run a pass in FP8 (the default row is no
  site); None where the log holds no report with such a table."""
  texts = [text.rstrip() for _, text in lines]
  heading = next((i for i, text in enumerate(texts) if REPORT.match(text)), None)
  if heading is None or PLAN_TABLE not in texts[heading:]:
    return None
  count = 0
  for text in texts[texts.index(PLAN_TABLE, heading) + 1:]:
    if not text.startswith("|"):
      break
    cells = [c.strip() for c in text.strip("|").split("|")]
    if len(cells) != 4 or not cells[0].strip("-") or cells[0] == DEFAULT_ROW:
      continue
    count += _fp8_site({p: c.removesuffix("*").strip() for p, c in zip(PASSES, cells[1:])})
  return count


def plan_fp8_sites(path: str) -> int:
  """The sites of a plan file (the run's plan.json) that run a pass in FP8."""
  remedy = "give the plan.json the main job wrote in its workdir"
  plan = jsonio.read_json(path, "plan (plan.json)", remedy, MainJobRowError)
  jsonio.check_digest(plan, path, "plan", remedy, MainJobRowError)
  sites = plan.get("sites") if isinstance(plan, Mapping) else None
  if not isinstance(sites, Mapping):
    raise MainJobRowError(f"{path}: not a plan (no \"sites\"): {remedy}")
  try:
    return sum(_fp8_site({p: entry[p]["kernel"] for p in PASSES}) for entry in sites.values())
  except (KeyError, TypeError):
    raise MainJobRowError(f"{path}: a site of the plan lacks a kernel for one of {PASSES}: "
                          f"{remedy}") from None


def _candidates(lines: List[Tuple[float, str]]) -> Optional[str]:
  """The candidate kernels the report's "Probe:" line lists, comma-joined as there."""
  found = [m[1] for m in (CANDIDATES.match(text) for _, text in lines) if m]
  return (found[-1] or None) if found else None


def row(cold_path: str, warm_path: Optional[str], device: str, jax_version: str, date: str,
        commit: str, command: str, *, plan_path: Optional[str] = None,
        cold_s: Optional[float] = None, warm_s: Optional[float] = None,
        candidates: Optional[str] = None, note: Optional[str] = None) -> Dict[str, Any]:
  """One time_to_plan row from the cold run's log and, if given, the warm rerun's.

  `cold_s`/`warm_s` replace a log's last stamp with the wall time the call measured (the
  process's exit comes after its last line). The FP8 sites come from `plan_path` if given,
  else from the plan table of the cold log's report; a cut run, which reached no report, has
  none. `candidates` replaces the report's list (a cut run's log names none)."""
  cold = read_log(cold_path)
  model, preset = JOB.match(cold[0][1]).groups()
  complete = any(REPORT.match(text) for _, text in cold)
  last = cold[-1][0]
  warm_last = None
  if warm_path:
    warm = read_log(warm_path)
    rerun = JOB.match(warm[0][1]).groups()
    if rerun != (model, preset):
      raise MainJobRowError(f"{warm_path}: a run of {'/'.join(rerun)}, not a rerun of the cold "
                            f"run's {model}/{preset} ({cold_path})")
    warm_last = warm[-1][0]
  fp8_sites = None
  if complete:
    fp8_sites = plan_fp8_sites(plan_path) if plan_path else table_fp8_sites(cold)
  out = {
      "kind": "time_to_plan", "model": model, "preset": preset, "device": device,
      "jax": jax_version, "date": date, "commit": commit, "command": command,
      "candidates": candidates or _candidates(cold), "complete": complete,
      "cold_s": round(last if cold_s is None else cold_s, 1),
      "warm_s": None if warm_s is None and warm_last is None else
                round(warm_last if warm_s is None else warm_s, 1),
      "fp8_sites": fp8_sites, "stages_s": stages(stage_ends(cold), complete, last),
      "kernel_passes": kernel_passes(cold)}
  if note:
    out["note"] = note
  return out
