"""Validation's records and progress: where a long validation saves its plan and when it
stops (`Progress`, `ValidationPaused`), the records a check reads its rounds and
measurements back from (`finished`, `matching_records`, `saved_site_measurements`), each
measurement taken in turn and recorded at once (`take_in_turn`, `measure_sites`), and a check
started over (`reopen_check`)."""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from loka_jax.plan.file import Plan, add_validation, as_plan
from loka_jax.dispatch.validate.config import CHECK_STEPS
from loka_jax.kernels import PASSES, KernelChoice


class ValidationPaused(RuntimeError):
  """The caller's `should_stop` asked validation to stop before it finished; the plan so far
  was saved (`Progress.save`) and calling again with it resumes where this call stopped."""


@dataclasses.dataclass
class Progress:
  """Where a long validation saves its plan and when it must stop.

  `save(plan)` is called at the start of every back-off round, before and after every site
  measured within a round, and after every check, so an interrupted validation loses at most
  the measurement it was in. `should_stop(ahead_s)`, the caller's, is asked before every round
  and check (ahead_s 0) and before every measurement, with the seconds that measurement is
  expected to take at most (`pace`); when it says True the plan is saved and
  ValidationPaused raised. A caller with a deadline (a time.time() value) passes
  `lambda ahead_s: time.time() + ahead_s > deadline`: no new round starts once the deadline
  has passed, and no measurement that would not end by it.
  A measurement is paced by the slowest one measured of its kind (a `take_in_turn` record
  step: site measurements pace site measurements, training runs training runs), in this
  call or recorded in the plan by an earlier one (a process killed by a hard time limit
  mid-measurement loses it). One pace for every kind stops calls early: on an H200 a Wukong
  `large` shadow run took 231 s, a held-out site measurement 1.5 s in one program, and with
  one pace for both a call stopped before its first gradient measurement with about 190 s
  left.
  A measurement whose compiled program already ran in this call (`take_in_turn`'s
  `program_of`) is paced by the slowest such warm one of its kind, once one was taken: a
  Wukong `large` gradient site took 111 s with its compile and 33-37 s after it, and a call
  paced by the 111 s stopped with about 120 s, three such sites, left. Before a warm one was
  taken, it is paced by its own program's first run in this call (a rerun does not compile
  again): a Wukong `large` shadow run paced by another program's 268 s stopped a call with
  260 s left, after its own first run took 162 s and before a rerun that took 61 s.
  `log`, where given, receives a line per record as it is made (a round's verdict, a
  back-off, each site measurement and training run), so a long validation shows where it is.
  """
  save: Optional[Callable[[Plan], None]] = None
  # ahead_s -> whether to stop now (None: never)
  should_stop: Optional[Callable[[float], bool]] = None
  longest_s: Dict[str, float] = dataclasses.field(default_factory=dict)  # kind -> seconds
  log: Optional[Callable[[str], None]] = None
  # kind -> seconds of its slowest measurement that reran a program compiled in this call
  longest_warm_s: Dict[str, float] = dataclasses.field(default_factory=dict)
  # (kind, program) -> seconds of its first measurement in this call (which compiled it)
  first_s: Dict[Tuple[str, Hashable], float] = dataclasses.field(default_factory=dict)

  def note(self, plan: Plan, since: int) -> Plan:
    """Logs the plan's validation records from index `since` on; returns the plan."""
    self.note_records(plan["validation"][since:])
    return plan

  def note_records(self, records: Sequence[Mapping[str, Any]]) -> None:
    if self.log is not None:
      from loka_jax.train.report import validation_line
      for record in records:
        line = validation_line(record, measurements=True)
        if line is not None:
          self.log(line.strip().lstrip("- "))

  def checkpoint(self, plan: Plan, where: str, *, measurement: Optional[str] = None,
                 program: Optional[Hashable] = None) -> None:
    """Saves `plan`; pauses when `should_stop` says so, asked with 0 or, before a
    `measurement` (its kind; `program`: the compiled program it runs, None where its own),
    with `pace(measurement, program)`."""
    if self.save is not None:
      self.save(plan)
    ahead_s = self.pace(measurement, program) if measurement else 0.0
    if self.should_stop is not None and self.should_stop(ahead_s):
      raise ValidationPaused(f"validation paused before {where}: should_stop said stop"
                             + (f", allowing for the {ahead_s:.0f} s the slowest such "
                                "measurement took" if ahead_s else "")
                             + "; the plan so far is saved, call again to resume")

  def pace(self, kind: str, program: Optional[Hashable] = None) -> float:
    """Seconds the next measurement of `kind` is expected to take at most: where its
    `program` already ran in this call, the smaller of that program's first run here and
    the slowest warm one of its kind (once one was taken); else the slowest of its kind
    known (0 where none is)."""
    if program is not None and (kind, program) in self.first_s:
      return min(self.first_s[kind, program], self.longest_warm_s.get(kind, math.inf))
    return self.longest_s.get(kind, 0.0)

  def measured(self, kind: str, seconds: float, program: Optional[Hashable] = None) -> None:
    """One measurement of `kind` taken, in `seconds` (`program`: as `checkpoint`'s)."""
    self.longest_s[kind] = max(self.longest_s.get(kind, 0.0), seconds)
    if program is not None:
      if (kind, program) in self.first_s:
        self.longest_warm_s[kind] = max(self.longest_warm_s.get(kind, 0.0), seconds)
      else:
        self.first_s[kind, program] = seconds


# ----------------------------------------------------------------------------- records


REOPENED = "reopened"
# Record steps beside a check's verdicts: the speed check's timed steps per round.
SPEED_STEPS = "speed_steps"


def site_step(step: str) -> str:
  """The record name of one site's measurement within a round of `step`."""
  return f"{step}_site"


def run_step(step: str) -> str:
  """The record name of one training run within a check of `step`."""
  return f"{step}_run"


def is_back_off(record: Mapping[str, Any]) -> bool:
  """Whether a validation record is a back-off (`plan.back_off`: one site, from, to)."""
  return "site" in record and "to" in record


def _live_records(plan: Plan, step: str) -> List[Dict[str, Any]]:
  """The plan's `step` records since the check was last reopened (`reopen_check`): the
  ones its verdict and round numbering go by. Earlier ones stay in the plan as history."""
  records = plan["validation"]
  last = max((i for i, r in enumerate(records)
              if r.get("step") == step and r.get(REOPENED)), default=-1)
  return [r for r in records[last + 1:] if r.get("step") == step]


def finished(plan, step: str) -> bool:
  """Whether the plan records a finished `step` check (its `final` record)."""
  return any(r.get("final") for r in _live_records(as_plan(plan), step))


def _rounds_done(plan: Plan, step: str) -> int:
  """Rounds of `step` recorded before a resumed call (numbering goes on from there)."""
  return sum(1 for r in _live_records(plan, step) if "round" in r)


def _record_steps(check: str) -> Tuple[str, ...]:
  """The record steps a check writes: its verdicts and back-offs, its site measurements, its
  training runs and, for the speed check, its timed steps."""
  return (check, site_step(check), run_step(check)) + ((SPEED_STEPS,) if check == "speed"
                                                          else ())


def _reopen_one(plan: Plan, step: str, reason: str) -> Plan:
  """`plan` with the `step` check's back-offs since it was last opened undone, newest first,
  and its `reopened` record."""
  live = _live_records(plan, step)
  data = plan.to_dict()
  restored = []
  for r in reversed([r for r in live if is_back_off(r)]):
    entry = data["sites"][r["site"]]
    for pass_name, kernel in r["from"].items():
      entry[pass_name] = {"kernel": kernel,
                          "reason": f"restored: the {step} check was reopened ({reason})"}
    restored.append({"site": r["site"], "passes": sorted(r["from"]), "to": r["from"]})
  return add_validation(Plan(data), {"step": step, REOPENED: True, "reason": reason,
                                     "rounds_before": sum(1 for r in live if "round" in r),
                                     "restored": restored})


def reopen_check(plan, step: str, reason: str, later: bool = False) -> Plan:
  """The plan with the `step` check started over: every site it backed off (its back-off
  records since it was last reopened, undone newest first) runs its earlier kernels again,
  and a `reopened` record says why and what was undone. For a check whose rule changed
  after it backed sites off under the old one (the shadow check's noise floor,
  `shadow_noise_floor`; the held-out check's report ranking where one program measures).
  Nothing is deleted: the old rounds, back-offs and every measurement stay recorded, and a
  run or site measurement whose plan and recipe come back is taken from its record instead
  of measured again. A later check judged the plan as this one left it, so one with records
  since it was last opened refuses, unless `later`: then each such check is reopened too,
  the newest first, so every back-off is undone in the reverse of the order it was made.
  Never after the validation's final verdict."""
  plan = as_plan(plan)
  steps = list(CHECK_STEPS)
  if step not in steps:
    raise ValueError(f"reopen_check: unknown check {step!r}; checks are {steps}")
  if not reason:
    raise ValueError("reopen_check: give the reason the check starts over")
  if any(r.get("step") == "validated" for r in plan["validation"]):
    raise ValueError("reopen_check: the plan is validated; validate the selected plan again "
                     "instead")
  if not _live_records(plan, step):
    raise ValueError(f"reopen_check: the plan has no {step} records since it was last opened")
  # A later check's measurements count too: it may have timed or trained before its
  # first verdict (`speed_steps` before speed round 0's record).
  after = [check for check in steps[steps.index(step) + 1:]
           if any(r.get("step") in _record_steps(check) for r in plan["validation"])]
  open_after = [check for check in after if _live_records(plan, check)]
  if after and not later:
    raise ValueError(f"reopen_check: {', '.join(after)} already judged the plan the {step} "
                     "check left; only the last check with records can be reopened, or "
                     "reopen the later ones too (later=True)")
  for check in reversed(open_after):
    plan = _reopen_one(plan, check, f"{reason} (reopened with the {step} check)")
  return _reopen_one(plan, step, reason)


def matching_records(plan: Plan, record_step: str,
                     fields: Optional[Mapping[str, Any]] = None) -> List[Dict[str, Any]]:
  """The plan's `record_step` records whose fields match `fields` (field: value; None:
  any), in order: a measurement recorded under what it measured."""
  return [r for r in plan["validation"]
          if r.get("step") == record_step
          and all(r.get(k) == v for k, v in (fields or {}).items())]


def site_records(plan: Plan, step: str, scope: Optional[Mapping[str, Any]] = None
                 ) -> List[Dict[str, Any]]:
  """The site measurement records of `step` whose fields match `scope`, in order."""
  return matching_records(plan, site_step(step), scope)


def saved_site_measurements(plan: Plan, step: str, scope: Optional[Mapping[str, Any]] = None
                            ) -> Dict[Tuple[str, KernelChoice], float]:
  """{(site, choice): value} of every site measurement recorded for `step` (a non-finite
  value is stored as null) whose record matches `scope` (`site_records`). A quality
  measurement is of the site alone against bf16+Mods on the validation's state, so it holds
  in every later round and call while the site keeps that choice; the speed check's
  in-context slowdowns hold only within their round (`measure_sites`' scope)."""
  return {(r["site"], KernelChoice.from_dict(r["choice"])):
          math.inf if r["value"] is None else float(r["value"])
          for r in site_records(plan, step, scope)}


def take_in_turn(plan: Plan, progress: Progress, record_step: str,
                 pending: Sequence[Tuple[str, Dict[str, Any], Callable[[], Dict[str, Any]]]],
                 program_of: Optional[Callable[[Dict[str, Any]], Hashable]] = None) -> Plan:
  """Takes each pending measurement (where, its identifying fields, a call returning its
  result fields) in turn and records it at once as a `record_step` record with the
  `seconds` it took, saving the plan as soon as it is recorded (before its log line), so a
  call that stops or is killed midway keeps what it measured. Before each,
  `progress.checkpoint` asks the caller's `should_stop` with the pace of the slowest
  `record_step` record, from this call or an earlier one, or where
  `program_of` (fields -> the compiled program the measurement runs; None: its own) says its
  program already ran in this call, of the slowest warm one (`Progress.pace`)."""
  earlier = [r["seconds"] for r in plan["validation"]
             if r.get("step") == record_step and r.get("seconds") is not None]
  if earlier:
    progress.measured(record_step, max(earlier))
  for where, fields, measure in pending:
    program = program_of(fields) if program_of is not None else None
    progress.checkpoint(plan, where, measurement=record_step, program=program)
    start = time.time()
    result = measure()
    seconds = time.time() - start
    progress.measured(record_step, seconds, program)
    plan = add_validation(plan, {"step": record_step, **fields, **result,
                                 "seconds": round(seconds, 2)})
    if progress.save is not None:  # saved before it is logged: a kill after its line loses
      progress.save(plan)          # nothing the line reported
    plan = progress.note(plan, -1)
  return plan


def measure_sites(plan: Plan, step: str, round_: int, candidates: Mapping[str, KernelChoice],
                  measure: Callable[[str, KernelChoice], Any], progress: Progress,
                  scope: Optional[Mapping[str, Any]] = None, one_program: bool = False
                  ) -> Tuple[Plan, Dict[str, float]]:
  """(plan, {site: value}) for every candidate: as the plan records it (this round, an earlier
  one or an earlier call: `saved_site_measurements`) or taken now by `measure(site, choice)`
  (`take_in_turn`: recorded at once, so a call that stops mid-round keeps what it measured;
  even a call's first site waits for the pace of the slowest recorded). `measure` returns
  the value, or (value, extras) to record the extras beside it. `scope` (field: value) is
  recorded with each new measurement, and only measurements recorded with it are reused: a
  value that holds only where it was taken (the speed check's, in one round for its failing
  steps) is not carried past it. `one_program`: every site is measured through one compiled
  program (a switch board), so after the first the rest are paced as warm."""
  def result(site: str, choice: KernelChoice) -> Dict[str, Any]:
    got = measure(site, choice)
    value, extras = (float(got[0]), dict(got[1])) if isinstance(got, tuple) else (float(got), {})
    return {"value": value if math.isfinite(value) else None, **extras}

  saved = saved_site_measurements(plan, step, scope)
  pending = [(f"{step} round {round_}, site {site}",
              {"round": round_, **(scope or {}), "site": site, "choice": choice.to_dict()},
              functools.partial(result, site, choice))
             for site, choice in sorted(candidates.items()) if (site, choice) not in saved]
  plan = take_in_turn(plan, progress, site_step(step), pending,
                      (lambda fields: (step, round_)) if one_program else None)
  measured = saved_site_measurements(plan, step, scope)
  return plan, {s: measured[(s, c)] for s, c in candidates.items()}


def _final(plan: Plan, record: Dict[str, Any]) -> Plan:
  return add_validation(plan, {**record, "final": True})


def held_out_backed_off(plan) -> Dict[str, str]:
  """{site: reason} of the sites whose forward the held-out check moved off its selected
  kernel. That check scores the plan's forwards alone on fixed parameters, so what it took
  back counts against serving the site's forward in FP8 too (the benchmarks' planning). Back-offs a
  reopened check undid (`reopen_check`) do not count."""
  return {r["site"]: r.get("reason", "") for r in _live_records(as_plan(plan),
                                                                "quality_held_out")
          if is_back_off(r) and "fwd" in (r.get("passes") or PASSES)}


def validation_records(plan, step: Optional[str] = None) -> List[Dict[str, Any]]:
  """The plan's validation records (of one step)."""
  return [r for r in as_plan(plan)["validation"] if step is None or r.get("step") == step]
