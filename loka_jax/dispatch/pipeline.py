"""Probe -> select -> validate in one resumable call: what the main job and the benchmarks
run to get the LoKA arm's plan.

  from loka_jax.dispatch import pipeline
  result = pipeline.probe_and_plan(RunSpec(model="wukong", preset="tiny", mods=("all",)),
                                   "loka_run", train_config=TrainConfig(steps=100))
  result.plan          # the validated Plan, also in loka_run/plan.json
  result.report        # the ProbeReport, also in loka_run/probe_report.json

Layout of `workdir`:
  probe/               the probe's training run (bf16 + the spec's Mods), its checkpoints,
                       evaluation cache, report and plots
  probe_report.json    the ProbeReport (loka.probe/2)
  plan_selected.json   the plan as selected, before end-to-end validation
  plan_validating.json the plan part-way through validation (a call its `should_stop`
                       paused); the next call resumes from it
  plan.json            the plan after validation (loka.plan/1, every step recorded)
  validation_state/    only where probe/ holds no checkpoint (the report and plans were
                       carried from the machine that probed): the probe's bf16+Mods
                       training run made again, to validate on (`context_for_run`)

Each part is skipped when its file is there and fits what came before (the probe report is
complete; a plan's `provenance.report_sha256` is the report's), so rerunning the same call
finishes an interrupted one. Delete a file to redo its part.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from loka_jax import jsonio
from loka_jax.dispatch import validate as validate_lib
from loka_jax.plan.check import check_plan
from loka_jax.plan.file import FALLBACK, Plan, add_validation, read_plan, save_plan
from loka_jax.dispatch.selection import make_budget, report_hash, resolve_timing, select
from loka_jax.kernels import PASSES, registry
from loka_jax.probe.eligibility import FUSED_SCOPE, Criteria

REPORT_JSON = "probe_report.json"
SELECTED_JSON = "plan_selected.json"
VALIDATING_JSON = "plan_validating.json"
PLAN_JSON = "plan.json"
PROBE_DIR = "probe"
STATE_DIR = "validation_state"


# What a probe report found in the workdir must share with the run asked for.
SAME_RUN_FIELDS = ("model", "preset", "data", "data_spec", "data_path", "mods", "seed")


class RunMismatchError(ValueError):
  """The workdir's probe report is of another run than the one asked for."""


def _check_same_run(report: Mapping, spec, path: str) -> None:
  """Raises RunMismatchError naming `path` when the report probed another model, data or seed than
  `spec`: reusing it would select a plan for the wrong sites."""
  ran = report.get("run") or {}
  wanted = spec.run_info()
  differ = [f"{k}: {ran.get(k)!r} there, {wanted.get(k)!r} here" for k in SAME_RUN_FIELDS
            if k in ran and ran.get(k) != wanted.get(k)]
  if differ:
    raise RunMismatchError(f"{path} probed another run ({'; '.join(differ)}): use another workdir, "
                     "or move the workdir's probe and plans aside to redo them")


@dataclasses.dataclass
class PipelineResult:
  """The plan (validated unless validation was off), the report and the files written."""
  plan: Plan
  report: Dict[str, Any]
  paths: Dict[str, str]
  criteria: Criteria
  skipped: Dict[str, bool]  # which parts were taken from files of an earlier call


def _log(message: str) -> None:
  print(f"[pipeline] {message}", flush=True)


def default_criteria(report: Mapping, target_device: Optional[str] = None) -> Criteria:
  """The documented default budget; accuracy only (`min_speedup=None`) where the report has
  no usable timings (a CPU run without a committed table), since then no FP8 kernel could
  ever be 'fast enough' and the plan would say nothing about accuracy."""
  try:
    source = resolve_timing(report, target_device=target_device)
  except ValueError:
    return Criteria(min_speedup=None)
  return Criteria() if source.kind != "none" else Criteria(min_speedup=None)


def context_for_run(spec, probe_dir: str, train_config, report: Optional[Mapping] = None,
                    build=None, rebuild_dir: Optional[str] = None
                    ) -> validate_lib.ValidationContext:
  """The validation context of a probe run: its trained bf16+Mods checkpoint, its data, and
  a builder of the same tower under any KernelPlan. `build(spec) -> (model, source, config)`
  replaces `experiment.build_run` (as in `run_probe`); its model gets each plan through
  `dispatch.apply`.

  Where `probe_dir` holds no checkpoint and `rebuild_dir` is given, the probe's training run
  is made again there (`retrain_probe_state`) instead of failing."""
  from loka_jax.models import SiteConfig, build_model
  from loka_jax.precision import BF16
  from loka_jax.train import experiment
  from loka_jax.train.loop import restore_run
  base_spec = dataclasses.replace(spec, precision="bf16", plan=None)
  model, source, config = (build or experiment.build_run)(base_spec)
  # The state only: the probe's statistics (array extras) are not needed to validate.
  restored = restore_run(probe_dir, model, source, train_config, array_extras=False)
  if restored is None and rebuild_dir is not None:
    restored = retrain_probe_state(base_spec, model, source, train_config, report, rebuild_dir)
  if restored is None:
    raise FileNotFoundError(f"{probe_dir}: no checkpoint of the probe run to validate the plan "
                            "on; run the probe there first (probe_and_plan does)")
  features = source.features
  if build is None:
    builder = lambda kplan: build_model(config, features, SiteConfig(BF16, kplan))
  else:
    from loka_jax.plan.binding import apply
    builder = lambda kplan: apply(model, kplan, policy=BF16)
  return validate_lib.ValidationContext(
      build=builder,
      source=source, state=restored[0], batch_size=train_config.batch_size,
      optim=train_config.optim, report=report)


def retrain_probe_state(spec, model, source, train_config, report: Optional[Mapping],
                        state_dir: str):
  """(state, extras) of the probe's bf16+Mods training run, made again in `state_dir`.

  The probe's checkpoint of a large model is big (Wukong large: 41 GB on disk with its statistics)
  and lives on the machine that probed; its report and plans are small and travel. The
  trained state is a function of the run (spec, seed, data order, steps), so training the
  same run again, without the statistics pass, gives the state validation needs: on the CPU
  the same values; on a GPU up to the nondeterminism of its reductions. The run resumes
  from `state_dir` like any other, so a paused validation trains it once.
  """
  from loka_jax.train.loop import restore_run, train
  ran = dict((report or {}).get("run") or {})
  wanted = {**spec.run_info(), "steps": train_config.steps,
            "batch_size": train_config.batch_size}
  mismatched = [f"{key}: the probe ran {ran[key]!r}, this run asks for {want!r}"
                for key, want in wanted.items()
                if key in ran and not jsonio.same_json(ran[key], want)]
  if mismatched:
    raise ValueError("cannot make the probe's training run again to validate on: "
                     + "; ".join(mismatched))
  restored = restore_run(state_dir, model, source, train_config, array_extras=False)
  if restored is not None and int(restored[0].step) == train_config.steps:
    return restored
  _log(f"no probe checkpoint here: training the probe's bf16+Mods run again to step "
       f"{train_config.steps} in {state_dir} to validate on")
  train(model, source, state_dir, train_config, run_info=spec.run_info())
  return restore_run(state_dir, model, source, train_config, array_extras=False)


def _timed_scopes(passes: Mapping[str, Mapping], choice,
                  wanted: Tuple[str, ...] = PASSES) -> List[Optional[Tuple]]:
  """(baseline us, plan us, estimated) of each timed scope of one site under `choice`, at the
  medians, over the `wanted` passes; None for a scope without both times. A fused op's
  backward, timed as one call and filed under both gradient passes (`FUSED_SCOPE`), is one
  scope, against the baseline's backward timed the same way where the entry holds it
  (`baseline_us`), as selection compares them (`eligibility.site_times`); else against the
  two gradient passes."""
  scopes = []
  for p in wanted:
    kernel = choice.for_pass(p)
    entry = passes.get(p, {}).get(kernel) or {}
    whole_bwd = entry.get("time_scope") == FUSED_SCOPE
    if p == "grad_rhs" and (passes.get("grad_lhs", {}).get(kernel) or {}).get(
        "time_scope") == FUSED_SCOPE:
      continue  # counted once, under grad_lhs
    base_passes = ("grad_lhs", "grad_rhs") if whole_bwd else (p,)
    base = [(passes.get(q, {}).get(FALLBACK) or {}).get("time_us") for q in base_passes]
    k = entry.get("time_us")
    if whole_bwd and entry.get("baseline_us"):
      base = [entry["baseline_us"]]
    if not k or not all(base):
      scopes.append(None)
      continue
    scopes.append((sum(float(b[1]) for b in base), float(k[1]),
                   entry.get("timing") == "estimated"))
  return scopes


def _check_passes(passes: Tuple[str, ...]) -> None:
  unknown = [p for p in passes if p not in PASSES]
  if unknown or not passes:
    raise ValueError(f"passes {list(passes)}: give one or more of {list(PASSES)}")


def site_gemm_times(plan, report: Mapping, passes: Tuple[str, ...] = PASSES
                    ) -> Dict[str, Optional[Tuple[float, float, bool]]]:
  """Per site of the report that the plan covers: (xla_bf16 us, plan us, estimated) summed
  over its timed scopes of `passes` at the medians, from the kernel timings the plan was
  selected with (`estimated`: a committed table's nearest shape stood in somewhere); None
  where a scope has no time, or where the report has no timings at all."""
  from loka_jax.dispatch import selection
  from loka_jax.plan.file import as_plan
  _check_passes(passes)
  plan = as_plan(plan)
  try:
    source = selection.resolve_timing(report)
  except ValueError:
    source = selection.TimingSource("none", {"kind": "none"})
  out: Dict[str, Optional[Tuple[float, float, bool]]] = {}
  for name in report["sites"]:
    choice = plan.choice_for(name)
    if choice is None:
      continue
    site, _ = selection.effective_site(report, name, source)
    scopes = _timed_scopes(site["passes"], choice, passes)
    if source.kind == "none" or any(scope is None for scope in scopes):
      out[name] = None
      continue
    out[name] = (sum(scope[0] for scope in scopes), sum(scope[1] for scope in scopes),
                 source.kind == "table" or any(scope[2] for scope in scopes))
  return out


def plan_speedup_estimate(plan, report: Mapping,
                          passes: Tuple[str, ...] = PASSES) -> Dict[str, Any]:
  """The plan's speedup over xla_bf16 summed over every site's GEMM `passes` (GEMM time only:
  norms, activations and the optimizer are not counted; `("fwd",)` is inference's share).

  From the kernel timings the plan was selected with where every chosen kernel has one
  (`source` 'measured', or 'estimated' from a committed table; `site_gemm_times`);
  otherwise from FLOPs under the ideal 2x FP8 rate with no quantization cost (`source`
  'flop model', an upper bound).
  """
  from loka_jax.plan.file import as_plan
  plan = as_plan(plan)
  times = site_gemm_times(plan, report, passes)
  timed = [t for t in times.values() if t is not None]
  base_us, plan_us = sum(t[0] for t in timed), sum(t[1] for t in timed)
  if times and len(timed) == len(times) and plan_us > 0:
    return {"speedup": base_us / plan_us,
            "source": "estimated" if any(t[2] for t in timed) else "measured",
            "bf16_us": base_us, "plan_us": plan_us}
  base_flops = plan_flops = 0.0
  for name in times:
    choice = plan.choice_for(name)
    flops = float(report["sites"][name].get("flops") or 0.0)
    for p in passes:
      kernel = choice.for_pass(p)
      fp8 = registry.quantizes(kernel, p)
      base_flops += flops
      plan_flops += flops / 2.0 if fp8 else flops
  return {"speedup": base_flops / plan_flops if plan_flops else 1.0, "source": "flop model",
          "note": "upper bound: FP8 GEMMs at 2x the bf16 rate, no quantization cost"}


def _usable_plan(path: str, digest: str, budget: Mapping) -> Optional[Plan]:
  """The plan saved at `path` if it was made from this report under this budget (a rerun
  with another budget selects again instead of silently reusing the old plan)."""
  if not os.path.exists(path):
    return None
  plan = read_plan(path)
  provenance = plan["provenance"]
  same_budget = jsonio.same_json(provenance.get("budget"), budget)
  return plan if provenance.get("report_sha256") == digest and same_budget else None


_CHECK_NAMES = {"speed_promotion": "speed promotion", "quality_held_out": "held-out",
                "quality_shadow": "shadow training",
                "quality_from_init": "training from initialization", "speed": "speed"}


def checks_to_run(validation) -> List[str]:
  """The checks `validation` (a ValidationConfig) runs, in order, by name for the log: those
  its settings or the device rule out (no steps, not on a GPU) are left out."""
  return [_CHECK_NAMES[step] for step, _ in validate_lib.CHECKS
          if validate_lib.ruled_out_by_config(step, validation) is None]


def probe_and_plan(spec, workdir: str, *, train_config, probe_config=None, probe_options=None,
                   criteria: Optional[Criteria] = None,
                   criteria_changes: Optional[Mapping[str, Any]] = None,
                   budget_per_site=None,
                   validation: Optional[validate_lib.ValidationConfig] = (
                       validate_lib.ValidationConfig()),
                   target_device: Optional[str] = None, build=None,
                   should_stop: Optional[Callable[[float], bool]] = None) -> PipelineResult:
  """Probe the spec's tower (bf16 + its Mods), select a plan, validate it end to end.

  Args:
    spec: a train.experiment.RunSpec (model, preset, data, mods, seed); its precision is
      ignored: the probe trains in bf16 with the spec's Mods, which is the LoKA arm's tower.
    workdir: where everything goes (see the module docstring); reruns resume.
    train_config: the probe's training run (steps, batch size, optimizer); the validation
      runs on its final checkpoint.
    probe_config: probe.ProbeConfig (statistics cadence, ...); None: the default.
    probe_options: probe.ProbeOptions (candidates, samples, ...); None: the default.
    criteria: the error budget; None: `default_criteria(report)`.
    criteria_changes: fields of that budget to change, e.g. {"min_sqnr_wgrad_db": 0.0}
      (what a caller without the report can say: the default depends on its timings).
    budget_per_site: per-site budgets for `dispatch.select`.
    validation: end-to-end validation settings; None skips validation (recorded).
    target_device: the device kind the plan is for (default: the report's).
    build: `build(spec) -> (model, source, config)` in place of `experiment.build_run`
      (towers outside the presets); None: the presets.
    should_stop: asked by validation before every round and measurement with the seconds
      it is expected to take at most (0 before a round); True pauses: validation saves its
      progress and raises validate.ValidationPaused (a RuntimeError); call again to resume.
      A caller with a deadline passes `lambda ahead_s: time.time() + ahead_s > deadline`.
      None: never pauses.
  Returns:
    PipelineResult(plan, report, paths, criteria, skipped).
  """
  from loka_jax.probe.collector import ProbeConfig
  from loka_jax.probe.report import load_report, save_report
  from loka_jax.probe.runner import ProbeOptions, run_probe
  spec = dataclasses.replace(spec, precision="bf16", plan=None)
  os.makedirs(workdir, exist_ok=True)
  paths = {"report": os.path.join(workdir, REPORT_JSON),
           "selected": os.path.join(workdir, SELECTED_JSON),
           "plan": os.path.join(workdir, PLAN_JSON),
           "validating": os.path.join(workdir, VALIDATING_JSON),
           "probe_dir": os.path.join(workdir, PROBE_DIR),
           "state_dir": os.path.join(workdir, STATE_DIR)}
  skipped = {"probe": False, "select": False, "validate": False}
  if criteria_changes:
    unknown = sorted(set(criteria_changes) - {f.name for f in dataclasses.fields(Criteria)})
    if unknown:
      raise ValueError(f"criteria_changes: unknown budget field(s) {unknown}; the budget's "
                       f"fields are {[f.name for f in dataclasses.fields(Criteria)]}")
  probe_options = probe_options or ProbeOptions()
  if criteria is not None or criteria_changes:
    # The probe times only what can change the plan under the budget it will be selected by.
    probe_options = dataclasses.replace(probe_options, criteria=dataclasses.replace(
        criteria if criteria is not None else probe_options.criteria,
        **(criteria_changes or {})))

  report = None
  if os.path.exists(paths["report"]):
    report = load_report(paths["report"])
    _check_same_run(report, spec, paths["report"])
    trimmed = (report.get("timing_source") or {}).get("timed_for")
    if not report.get("complete", True):
      report = None
    elif trimmed is not None and trimmed != probe_options.criteria.to_dict():
      # A GPU probe times only what can change the plan under the criteria it was given;
      # other criteria may need other timings (the probe resumes from its caches).
      _log("the probe report's timings were chosen for other criteria: timing again")
      report = None
  if report is None:
    _log(f"probing {spec.model}/{spec.preset} (mods: {', '.join(spec.mods) or 'none'}) in "
         f"{paths['probe_dir']}")
    result = run_probe(spec, paths["probe_dir"], train_config, probe_config or ProbeConfig(),
                       probe_options, build=build)
    if not result.complete:
      raise RuntimeError(f"the probe in {paths['probe_dir']} is incomplete ("
                         f"{'; '.join(result.report.get('pending', []))}); call again to "
                         "finish it")
    report = result.report
    save_report(report, paths["report"])
  else:
    skipped["probe"] = True
    _log(f"probe report found: {paths['report']}")
  digest = report_hash(report)
  criteria = criteria if criteria is not None else default_criteria(report, target_device)
  if criteria_changes:
    criteria = dataclasses.replace(criteria, **criteria_changes)

  contexts = []

  def context() -> validate_lib.ValidationContext:  # restored once, when first needed
    if not contexts:
      contexts.append(context_for_run(spec, paths["probe_dir"], train_config, report, build,
                                      rebuild_dir=paths["state_dir"]))
    return contexts[0]

  budget = json.loads(json.dumps(make_budget(criteria, budget_per_site).to_dict()))
  selected = _usable_plan(paths["selected"], digest, budget)
  if selected is None:
    selected = select(report, criteria, budget_per_site=budget_per_site,
                      target_device=target_device)
    selected = Plan({**selected.to_dict(), "provenance": {
        **selected["provenance"], "report_path": os.path.abspath(paths["report"])}})
    check_plan(selected, context().build(validate_lib.BASELINE), None, context().batch(),
               where=paths["selected"])
    save_plan(selected, paths["selected"])
    _log(f"selected: {paths['selected']}")
  else:
    skipped["select"] = True

  plan = _usable_plan(paths["plan"], digest, budget)
  if plan is not None and any(r.get("step") in ("validated", "not_validated")
                              for r in plan["validation"]):
    skipped["validate"] = True
    _log(f"validated plan found: {paths['plan']}")
  elif validation is None:
    plan = add_validation(selected, {"step": "not_validated",
                                     "reason": "validation switched off by the caller"})
    save_plan(plan, paths["plan"])
  else:
    partial = _usable_plan(paths["validating"], digest, budget)
    _log(f"validating the plan end to end ({', '.join(checks_to_run(validation))})"
         + (f", resuming {paths['validating']}" if partial is not None else ""))
    progress = validate_lib.Progress(save=lambda p: save_plan(p, paths["validating"]),
                                     should_stop=should_stop, log=_log)
    plan = validate_lib.validate_end_to_end(selected, context(), validation,
                                            progress=progress, resume_from=partial)
    save_plan(plan, paths["plan"])
    if os.path.exists(paths["validating"]):  # finished: only plan.json speaks for it now
      os.remove(paths["validating"])
    _log(f"plan: {paths['plan']}")
  return PipelineResult(plan, report, paths, criteria, skipped)
