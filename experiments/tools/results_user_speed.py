"""RESULTS' "Speed where the user sees it": what a user of the main job and of
`experiments.train` waits for and gets, from committed rows (JSONL, one object a line, each
with its sha256): the time to a plan, cold and warm (`time_to_plan`), the start-up and loop
speed of each training arm (`startup`) and the probe's statistics pass against the training
step (`probe_overhead`), the loop beside the bench (`loop_vs_bench`) and what the drift
valve's refreshes cost in a training run (`drift_run`). Each row names its card, jax, date,
commit and command."""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Dict, List, Mapping, Sequence

from loka_jax import jsonio

KINDS = ("time_to_plan", "startup", "probe_overhead", "loop_vs_bench", "drift_run")
REQUIRED = ("kind", "model", "preset", "device", "jax", "date", "commit", "command")
# What each kind's table reads, beyond REQUIRED.
KIND_FIELDS = {"time_to_plan": ("candidates", "complete", "cold_s", "stages_s"),
               "startup": ("arm", "cache", "prefetch", "start_to_first_step_s", "setup_s",
                           "first_step_s", "window_steps_per_s"),  # optional: xla_flags, note
               "probe_overhead": ("cadence", "pass_ms", "step_ms"),  # optional: batch_size,
# weight_every, one_program, group_sites, pass_compile, first_call_s, extract_ms, measured_in,
# parts_ms
                 "loop_vs_bench": ("arm", "bench_steps_per_s", "window_steps_per_s",
                                   "loop_steps_per_s", "loop_over_bench"),  # LoKA's row:
# speedup_bench, speedup_loop
               "drift_run": ("cadence", "max_overhead", "steps", "refresh_steps", "refresh_s",
                             "later_refresh_s", "step_ms", "share", "share_after_first")}
# The cadences at which RESULTS states the statistics pass's share of training time.
CADENCES = (25, 100, 200)
# The overhead budget at which RESULTS states the gap between observations (`budgeted_gap`:
# the drift valve's default `max_overhead`).
BUDGET = 0.02


class UserSpeedError(ValueError):
  """A row file that cannot be read (the message names the file and line)."""


def load_rows(paths: Sequence[str]) -> List[Dict]:
  """Every row of `paths`, checked: valid JSON, its sha256, a known kind, the fields every
  row needs."""
  rows = []
  for path in paths:
    with open(path) as f:
      for n, line in enumerate(f, 1):
        where = f"{path}:{n}"
        try:
          row = json.loads(line)
        except ValueError as e:
          raise UserSpeedError(f"{where}: not valid JSON ({e})") from e
        jsonio.check_digest(row, where, "row", "measure it again", UserSpeedError)
        if not isinstance(row, dict) or row.get("kind") not in KINDS:
          raise UserSpeedError(f"{where}: a user-speed row needs a kind among "
                               f"{', '.join(KINDS)}")
        missing = [k for k in REQUIRED + KIND_FIELDS[row["kind"]] if k not in row]
        if missing:
          raise UserSpeedError(f"{where}: a {row['kind']} row needs "
                               f"{', '.join(REQUIRED + KIND_FIELDS[row['kind']])} (missing: "
                               f"{missing})")
        if row["kind"] in ("startup", "loop_vs_bench") and not row["window_steps_per_s"]:
          raise UserSpeedError(f"{where}: window_steps_per_s is empty")
        rows.append({k: v for k, v in row.items() if k != jsonio.DIGEST_FIELD})
  return rows


def _s(value) -> str:
  return "-" if value is None else f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _provenance(rows: Sequence[Mapping]) -> str:
  seen = dict.fromkeys((r["device"], r["jax"], r["date"], r["commit"], r["command"])
                       for r in rows)
  return "; ".join(f"{d}, jax {j}, {day}, commit {c}, `{cmd}`" for d, j, day, c, cmd in seen)


def _stage_s(stages: Mapping[str, float], name: str) -> str:
  """A stage's seconds, marked where the run was cut during it (`<name>_incomplete`)."""
  if f"{name}_incomplete" in stages:
    return f"{_s(stages[name + '_incomplete'])} (cut)"
  return _s(stages.get(name))


def time_to_plan_table(rows: Sequence[Mapping]) -> str:
  """One line per run, numbered, then each run's note and kernel-pass counts under its number
  (runs of one model on one card, even of one commit, differ in settings the notes name)."""
  lines = ["| run | model | card | commit | candidates | cold | warm | probe training | "
           "evaluation | timing | arms | FP8 sites |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  notes = []
  for number, r in enumerate(rows, 1):
    stages = r.get("stages_s", {})
    cold = _s(r["cold_s"]) if r.get("complete") else f"> {_s(r['cold_s'])} (stopped)"
    stage_cells = " | ".join(_stage_s(stages, name) for name in
                             ("probe_training", "evaluation", "timing", "arms"))
    lines.append(
        f"| {number} | {r['model']}/{r['preset']} | {card(r['device'])} | "
        f"{r.get('commit') or '-'} | {r['candidates']} | {cold} | {_s(r.get('warm_s'))} | "
        f"{stage_cells} | {'-' if r.get('fp8_sites') is None else r['fp8_sites']} |")
    said = [r["note"].rstrip(".") + "."] if r.get("note") else []
    c = r.get("kernel_passes")
    if c:
      said.append(f"Kernel passes: {c['measured']} timed, {c['reused']} reused from the "
                  f"card's committed table, {c['not_safe']} not timed (no site of their shape "
                  f"admits them on accuracy), {c['dominated']} not timed (dominated on the "
                  "card).")
    if said:
      notes.append(f"- Run {number}: {' '.join(said)}")
  return "\n".join(lines + [""] + notes)


def startup_table(rows: Sequence[Mapping]) -> str:
  lines = ["| model | card | arm | XLA flags | compilation cache | batches ahead | process start "
           "to first step | set-up | first step | steps/s (median; windows) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    rates = r["window_steps_per_s"]
    flags = f"`{r['xla_flags']}`" if r.get("xla_flags") else "-"
    lines.append(
        f"| {r['model']}/{r['preset']} | {card(r['device'])} | {r['arm']} | {flags} | "
        f"{r['cache']} | {r['prefetch']} | "
        f"{_s(r['start_to_first_step_s'])} | {_s(r['setup_s'])} | {_s(r['first_step_s'])} | "
        f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f}) |")
  notes = [f"- {r['model']}/{r['preset']} {r['arm']}"
           f"{' with ' + r['xla_flags'] if r.get('xla_flags') else ''}: {r['note']}"
           for r in rows if r.get("note")]
  return "\n".join(lines + ([""] + notes if notes else []))


def card(device: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3': the rows of one table may come from
  different cards."""
  return device.removeprefix("NVIDIA ")


def overhead_table(rows: Sequence[Mapping]) -> str:
  shares = " | ".join(f"every {c} steps" for c in CADENCES)
  lines = [f"| model | card | batch | measured in | weight refit every | compiled as | "
           f"first call | statistics pass | extract stage | training step | {shares} | "
           f"every under a {BUDGET:.0%} budget |",
           "|---|---|---|---|---|---|---|---|---|---|" + "---|" * (len(CADENCES) + 1)]
  for r in rows:
    share = " | ".join(f"{100 * r['pass_ms'] / (c * r['step_ms']):.1f}%" for c in CADENCES)
    extract = f"{r['extract_ms']:.1f} ms" if r.get("extract_ms") is not None else "-"
    compiled = _compiled_as(r)
    first = f"{r['first_call_s']:.0f} s" if r.get("first_call_s") is not None else "-"
    lines.append(f"| {r['model']}/{r['preset']} | {card(r['device'])} | "
                 f"{r.get('batch_size', '-')} | {r.get('measured_in', '-')} | "
                 f"{r.get('weight_every', 1)} | {compiled} | {first} | {r['pass_ms']:.0f} ms | "
                 f"{extract} | {r['step_ms']:.1f} ms | {share} | "
                 f"{math.ceil(r['pass_ms'] / (BUDGET * r['step_ms']))} steps |")
  return "\n".join(lines)


def overhead_parts_table(rows: Sequence[Mapping]) -> str:
  """The statistics pass taken apart, for the rows measured with --parts: each part jitted
  alone and summed over the sites, largest first, with its share of the parts' sum."""
  lines = ["| model | card | weight refit every | compiled as | statistics pass | parts, "
           "summed over the sites (share of their sum) |", "|---|---|---|---|---|---|"]
  for r in rows:
    parts = sorted(r["parts_ms"].items(), key=lambda kv: -kv[1])
    total = sum(ms for _, ms in parts)
    listed = ", ".join(f"{name} {ms:.1f} ms ({100 * ms / total:.0f}%)" for name, ms in parts)
    lines.append(f"| {r['model']}/{r['preset']} | {card(r['device'])} | "
                 f"{r.get('weight_every', 1)} | {_compiled_as(r)} | {r['pass_ms']:.0f} ms | "
                 f"{listed} |")
  return "\n".join(lines)


def _compiled_as(row: Mapping) -> str:
  return (f"{'one program' if row.get('one_program') else 'per site'}, "
          f"{'sites grouped, ' if row.get('group_sites') else ''}"
          f"{row.get('pass_compile', 'autotuned')}")


def loop_table(rows: Sequence[Mapping]) -> str:
  lines = ["| model | card | arm | batch workers | bench step | loop steps/s (median; windows) "
           "| loop / bench | LoKA over bf16+Mods: bench, loop |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    rates = r["window_steps_per_s"]
    speedup = (f"{r['speedup_bench']:.3f}x, {r['speedup_loop']:.3f}x"
               if r.get("speedup_loop") is not None else "-")
    workers = r.get("batch_workers", 0)
    if r.get("batch_workers_from_step") is not None:
      workers = f"{workers} (from step {r['batch_workers_from_step']})"
    # The bench's step on the arm's own state (speed.own_states) is marked; unmarked, on
    # bf16's shared state.
    own = " (own state)" if r.get("bench_shared_state") is False else ""
    lines.append(f"| {r['model']}/{r['preset']} | {card(r['device'])} | {r['arm']} | "
                 f"{workers} | {r['bench_steps_per_s']:.2f} steps/s{own} | "
                 f"{r['loop_steps_per_s']:.2f} "
                 f"({min(rates):.2f}-{max(rates):.2f}) | {r['loop_over_bench']:.3f} | "
                 f"{speedup} |")
  return "\n".join(lines)


def percent(share) -> str:
  return "-" if share is None else f"{100 * share:.2f}%"


def drift_table(rows: Sequence[Mapping]) -> str:
  lines = ["| model | plan | every | budget | steps | refreshes at | first refresh | later "
           "refreshes (median) | training step | share of training time | without the first |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    first = f"{r['refresh_s'][0]:.1f} s" if r["refresh_s"] else "-"
    later = "-" if r["later_refresh_s"] is None else f"{1e3 * r['later_refresh_s']:.0f} ms"
    lines.append(f"| {r['model']}/{r['preset']} | {r.get('plan') or '-'} | {r['cadence']} | "
                 f"{percent(r['max_overhead']) if r['max_overhead'] else 'none'} | "
                 f"{r['steps']} | {', '.join(map(str, r['refresh_steps'])) or '-'} | {first} | "
                 f"{later} | {r['step_ms']:.1f} ms | {percent(r['share'])} | "
                 f"{percent(r['share_after_first'])} |")
  return "\n".join(lines)


def section(paths: Sequence[str]) -> str:
  """The section's markdown (without its heading)."""
  rows = load_rows(paths)
  by_kind = {k: [r for r in rows if r["kind"] == k] for k in KINDS}
  # Each kind's table, after a sentence saying what it shows.
  parts = (
      ("time_to_plan", time_to_plan_table,
       "The main job (`python3 -m experiments.loka`, its defaults) on a fresh host with an "
       "empty compilation cache (cold), then rerun on its workdir (warm):"),
      ("startup", startup_table,
       "`experiments.train` per arm: seconds from process start to the first step, and the "
       "steps/s of each 25-step metrics window after the first:"),
      ("probe_overhead", overhead_table,
       "The probe's statistics pass against the training step: its cost per observation, its "
       "share of training time when it runs every 25 (the default), 100 or 200 steps, and how "
       "far apart an overhead budget of 2% of training time (the drift valve's default "
       "`max_overhead`) spaces its observations:"),
      ("loop_vs_bench", loop_table,
       "`experiments.train`'s loop beside the bench's timed step of the same arm, in one call "
       "(the loop's 25-step windows after the first; the bench's step on bf16's shared state, "
       "or on the arm's own where marked, `--config.speed.own_states`):"),
      ("drift_run", drift_table,
       "The drift valve in `experiments.train` (`--config.drift.every`): where its refreshes "
       "fell under the overhead budget, what each cost (the first compiles what was not "
       "compiled ahead) and their share of the run's training time, with and without the "
       "first:"))
  out = []
  for kind, table, intro in parts:
    if by_kind[kind]:
      out += [intro, "", table(by_kind[kind]), "", "Rows: " + _provenance(by_kind[kind]) + ".",
              ""]
    taken_apart = [r for r in by_kind[kind] if kind == "probe_overhead" and r.get("parts_ms")]
    if taken_apart:
      out += ["The same pass taken apart (`--parts`): the extract stage and each part of the "
              "per-site updates jitted and timed alone, summed over the sites (the matrix-normal "
              "refit per observation, so divided by the refit interval). Alone, each part pays "
              "its own launches, so the parts need not add up to the whole pass:", "",
              overhead_parts_table(taken_apart), ""]
  out.append("Files: " + ", ".join(f"`{os.path.basename(p)}`" for p in paths) + ".")
  return "\n".join(out)
