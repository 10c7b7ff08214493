"""One call of the bench (`settings.Call`): the speed suites' targets, then the quality runs,
each only while the call's pacing lets a new one start, then the report of every row so far.

Speed rows go to WORKDIR/bench.jsonl, quality rows to WORKDIR/quality.jsonl; a rerun skips
finished rows, so a suite longer than one call finishes over several. Every call ends by
writing WORKDIR/report.md (tables and the target checks), WORKDIR/targets.json and PNG plots
under WORKDIR/plots/.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from experiments.bench import settings as settings_lib

LEFT_FOR_NEXT = ("rows left for the next run (the deadline, a LoKA plan whose probe or "
                 "validation has not finished, or a run folder that holds other settings); "
                 "rerun the same command to continue")


def log(message: str) -> None:
  print(f"[bench] {message}", flush=True)


def setup(call: settings_lib.Call, workdir: str) -> None:
  """The workdir, XLA's autotune persistence, deterministic ops and the compilation cache;
  must run before JAX touches the GPU."""
  from loka_jax import xla_env
  os.makedirs(workdir, exist_ok=True)
  xla_env.add_xla_flags(xla_env.autotune_flag(os.path.join(workdir, "xla_autotune.textproto")),
                        *([xla_env.DETERMINISTIC] if call.xla_deterministic else []))
  import jax
  jax.config.update("jax_compilation_cache_dir", call.compile_cache)


def _deadlines(call: settings_lib.Call, start: float, log: Callable[[str], None]):
  """(deadline, end_by): when no new row starts by default, and the call's hard end (None
  when the config sets none). A hard end before the deadline caps it, said, so no call is
  lost to a refusal."""
  deadline = start + call.max_minutes * 60
  end_by = None if call.end_by_minutes is None else start + call.end_by_minutes * 60
  if end_by is not None and end_by < deadline:
    log(f"warning: pacing.max_minutes={call.max_minutes} is past pacing.end_by_minutes="
        f"{call.end_by_minutes}; no row starts after the latter")
    deadline = end_by
  return deadline, end_by


def selected_quality_runs(call: settings_lib.Call):
  """The call's (model, quality settings) that `targets.only` selects (all without it)."""
  return [(model, qs) for model, qs in call.quality_runs
          if not call.only or any(n in call.only for n in (f"{model}/{qs.preset}", model,
                                                             qs.preset, qs.data))]


def check_mods_set(call: settings_lib.Call) -> None:
  """ModsError, naming the `targets.mods` field and the model, when a keep_bias pattern of
  the call's Mods set keeps no bias at a model the call runs: every row of that set would
  fail alike, and each failure would be recorded as a finished row, so the call stops before
  its first. Each model is traced abstractly (`presets.check_keep_bias`): nothing compiles."""
  from experiments.bench import suite
  from loka_jax.models.presets import ModsError, parse_mods
  from loka_jax.train import experiment
  if not parse_mods(call.speed.mods)[1]:
    return
  subjects = [(t.model, t.preset, "synthetic", None)
              for t in suite.selected(call.speed_targets, call.only) if t.model != suite.TOWER]
  subjects += [(model, qs.preset, qs.data, qs.data_cache)
               for model, qs in selected_quality_runs(call)]
  for model, preset, data, data_cache in dict.fromkeys(subjects):
    try:
      experiment.build_run(experiment.RunSpec(model=model, preset=preset, data=data,
                                              data_cache=data_cache, mods=call.speed.mods,
                                              num_eval=2))
    except ModsError as e:
      raise ModsError(f"--config.targets.mods={','.join(call.speed.mods)} at "
                      f"{model}/{preset}: {e}") from None


def run(call: settings_lib.Call, workdir: str, log: Callable[[str], None] = log) -> bool:
  """Runs the call's rows, then writes the report; True when every selected row is done."""
  import jax
  from experiments.bench import quality, suite
  from experiments.bench.results import ResultsFile
  from loka_jax import _compat
  from loka_jax.probe import executables
  from loka_jax.train import experiment

  experiment.quiet_library_logs()
  if not _compat.on_gpu():
    log("warning: not on a GPU; these timings are smoke tests, not results")
  start = time.time()
  deadline, end_by = _deadlines(call, start, log)
  stop_at = deadline if end_by is None else end_by  # past it nothing starts
  device = jax.devices()[0].device_kind
  speed_rows = ResultsFile(os.path.join(workdir, "bench.jsonl"), suite.KEY_FIELDS)
  quality_rows = ResultsFile(os.path.join(workdir, "quality.jsonl"), quality.KEY_FIELDS)
  log(f"device {device}; suite {call.suite}; results under {workdir}")

  finished = True
  for target in suite.selected(call.speed_targets, call.only):
    # Past max_minutes a target's rows may still start by their recorded lengths
    # (`run_target` decides); past the hard end nothing does.
    if time.time() > stop_at:
      finished = False
      break
    finished &= suite.run_target(target, call.variants, speed_rows, settings=call.speed,
                                 deadline=deadline, device=device, log=log, end_by=end_by)

  quality_root = os.path.join(workdir, quality.RUNS_FOLDER)
  for model, qs in selected_quality_runs(call):
    if time.time() > stop_at:
      finished = False
      break
    plan_maker = (suite.quality_plan_maker(qs, call.speed, deadline) if call.speed.probe
                  else None)
    finished &= quality.run_model(model, qs, quality_rows, quality_root, deadline=deadline,
                                  device=device, log=log, plan_maker=plan_maker, end_by=end_by)
    # A model's probe and runs compile programs no other model calls. XLA:CPU maps each
    # program's machine code into memory mappings of its own, and a process keeps every
    # program it compiled (jax's caches, and the probe's evaluation functions compiled
    # ahead): a CPU call that probed Wukong, DLRM and DCNv2 `tiny` on MovieLens and ran 30
    # quality runs reached Linux's limit of mappings per process (vm.max_map_count) in
    # DHEN's probe, where the next compile failed ("Cannot allocate memory") and the process
    # died. The persistent compilation cache keeps what a later model may load again.
    executables.clear()
    jax.clear_caches()

  write_report(workdir, list(speed_rows.rows()) + list(quality_rows.rows()), [quality_root],
               log)
  log(("all selected rows are done" if finished else LEFT_FOR_NEXT)
      + f" ({time.time() - start:.0f}s)")
  return finished


def write_report(workdir: str, rows, quality_runs, log: Callable[[str], None] = log) -> None:
  """WORKDIR/targets.json, report.md (printed too) and plots/ of `rows`."""
  from experiments.bench import plots, tables, targets
  from loka_jax import jsonio
  verdicts = targets.check_all(rows)
  jsonio.write_json_atomic(os.path.join(workdir, "targets.json"), verdicts)
  report = tables.report(rows, verdicts, quality_runs)
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(report + "\n")
  written = plots.write_plots(rows, os.path.join(workdir, "plots"), quality_runs=quality_runs)
  print(report)
  log(f"plots: {', '.join(written) or 'none yet'}")
