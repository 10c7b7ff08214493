"""The LoKA arm's plans: one `plan.json` per target, from probing that target (bf16 + Mods)
and selecting per site and pass. Resumable: the probe keeps its own checkpoints, evaluation
cache and timing cache under DIR/plans/<target>/, and a finished plan is never redone.

Planning is `loka_jax.dispatch.pipeline.probe_and_plan`: probe -> select -> validate.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from experiments import time_limit
from loka_jax import dispatch, jsonio
from loka_jax.plan.file import FALLBACK
from loka_jax.kernels import KernelPlan
from loka_jax.train import experiment
from loka_jax.train.loop import TrainConfig

PLAN_FILE = "plan.json"
SERVING_PLAN_FILE = "plan_serve.json"
# The folder, under a plans root, of the quality suite's plans selected by the error budget
# alone (the `loka_accuracy` arm's), apart from LoKA's own under the same root.
ACCURACY_ONLY_PLANS = "accuracy_only"


def loka_plans_root(plans_root: str, accuracy_only: bool) -> str:
  """The folder of LoKA's plans under `plans_root`, or of the plans selected by the error
  budget alone, so the two plans of one model never share a probe, plan or validation."""
  return os.path.join(plans_root, ACCURACY_ONLY_PLANS) if accuracy_only else plans_root


def plan_dir(plans_root: str, model: str, preset: str) -> str:
  return os.path.join(plans_root, f"{model}_{preset}")


def reuse_probe_statistics(source_plan_dir: str, target_plan_dir: str) -> List[str]:
  """Copies the trained-statistics summary and the evaluation cache of the probe under
  `source_plan_dir` into the probe folder under `target_plan_dir` where that probe has not
  trained yet (no summary of its own); returns the names copied (none without a source).

  The `loka_accuracy` arm's probe trains and evaluates as LoKA's does (the same run, training
  and probe settings; only selection and validation differ: on an H100 the two probes of
  DHEN `tiny` on MovieLens wrote the same 30 evaluations), so with LoKA's files it goes
  straight to timing. It saves a probe's training and evaluation (at InterFormer `tiny`, 93 s
  of training before 83 sites' evaluations); validation, which needs the trained state,
  trains it again without the statistics pass. The probe reads each file only under its own
  key (the run and its settings, the statistics' fingerprint), so files of other settings
  are ignored and it trains as before."""
  from loka_jax.dispatch.pipeline import PROBE_DIR
  from loka_jax.probe.runner import EVAL_CACHE, TRAINED_JSON, append_eval_rows
  source = os.path.join(source_plan_dir, PROBE_DIR)
  target = os.path.join(target_plan_dir, PROBE_DIR)
  if (not os.path.exists(os.path.join(source, TRAINED_JSON))
      or os.path.exists(os.path.join(target, TRAINED_JSON))):
    return []
  os.makedirs(target, exist_ok=True)
  copied = []
  if os.path.exists(os.path.join(source, EVAL_CACHE)):
    # Appended: rows the target's probe evaluated itself stay (a key evaluated twice reads
    # as one); a line of the source's that a kill left torn is not copied.
    append_eval_rows(os.path.join(target, EVAL_CACHE),
                     [row for _, row, error in jsonio.jsonl_rows(os.path.join(source, EVAL_CACHE))
                      if error is None])
    copied.append(EVAL_CACHE)
  # The summary last: with it the probe takes the cache as its evaluations.
  shutil.copyfile(os.path.join(source, TRAINED_JSON), os.path.join(target, TRAINED_JSON))
  return copied + [TRAINED_JSON]


def plan_path(plans_root: str, model: str, preset: str) -> str:
  return os.path.join(plan_dir(plans_root, model, preset), PLAN_FILE)


def report_path(plans_root: str, model: str, preset: str) -> str:
  """The probe report the target's plan was selected from (written by the pipeline)."""
  from loka_jax.dispatch.pipeline import REPORT_JSON
  return os.path.join(plan_dir(plans_root, model, preset), REPORT_JSON)


def load_report(plans_root: str, model: str, preset: str):
  """The (validated) probe report of the target's plan: it calibrates the exported model."""
  from loka_jax.probe.report import load_report as read_report
  return read_report(report_path(plans_root, model, preset))


def load(plans_root: str, model: str, preset: str) -> Optional[KernelPlan]:
  """The target's KernelPlan, or None when its plan file does not exist yet."""
  path = plan_path(plans_root, model, preset)
  return dispatch.load_plan(path) if os.path.exists(path) else None


def serving_plan_path(plans_root: str, model: str, preset: str) -> str:
  return os.path.join(plan_dir(plans_root, model, preset), SERVING_PLAN_FILE)


SERVE_SELECTION = "serve_selection"


def forwards_in_bf16(plan: dispatch.Plan, reasons: Mapping[str, str], step: str
                     ) -> dispatch.Plan:
  """`plan` with every pass of each site in `reasons` ({site: why}) back in xla_bf16 where
  its forward is FP8, each recorded as a `step` back-off."""
  for site, why in sorted(reasons.items()):
    if site in plan["sites"] and plan["sites"][site]["fwd"]["kernel"] != FALLBACK:
      plan = dispatch.back_off(plan, site, None, why, step=step)
  return plan


def _held_out_forwards_in_bf16(plan: dispatch.Plan, held: Mapping[str, str]) -> dispatch.Plan:
  """`plan` with the forward of every site in `held` ({site: why}) back in xla_bf16."""
  return forwards_in_bf16(plan, {site: "held-out validation of the training plan backed this "
                                       f"site off: {why}" for site, why in held.items()},
                          SERVE_SELECTION)


def select_serving(plans_root: str, model: str, preset: str
                   ) -> Tuple[dispatch.Plan, dispatch.Plan, List[str]]:
  """(the target's serving plan as selected, its serving proposal, the sites the proposal
  serves in FP8 besides): per site the fastest eligible forward on the forward alone
  (`dispatch.select(objective="serve")`), from the probe report and default budget its
  training plan was selected with, and `dispatch.serving_proposal` of it. A site whose
  forward the training plan's held-out check backed off serves in bf16 in both: selection
  reads the probe report, which does not know what validation measured (DHEN large's
  `head/dense_0`, H200)."""
  from loka_jax.dispatch.pipeline import default_criteria
  from loka_jax.dispatch.validate import held_out_backed_off
  report = load_report(plans_root, model, preset)
  criteria = default_criteria(report)
  path = plan_path(plans_root, model, preset)
  held = held_out_backed_off(dispatch.read_plan(path)) if os.path.exists(path) else {}
  selected = _held_out_forwards_in_bf16(dispatch.select(report, criteria, objective="serve"),
                                        held)
  proposal, sites = dispatch.serving_proposal(report, selected, criteria)
  proposal = _held_out_forwards_in_bf16(proposal, held)
  return selected, proposal, [s for s in sites if s not in held]


def serving_plan(plans_root: str, model: str, preset: str,
                 decide: Optional[Callable] = None) -> dispatch.Plan:
  """The target's serving plan, written once to plan_serve.json beside its training plan,
  then read. The first call selects it (`select_serving`) and saves what
  `decide(selected, proposal, sites)` returns (default: the selected plan)."""
  path = serving_plan_path(plans_root, model, preset)
  if not os.path.exists(path):
    selected, proposal, sites = select_serving(plans_root, model, preset)
    dispatch.save_plan(selected if decide is None else decide(selected, proposal, sites), path)
  return dispatch.read_plan(path)


def make_plan(spec: experiment.RunSpec, plans_root: str, train_config: TrainConfig, *,
              budget_s: Optional[float], build: Optional[Callable] = None,
              samples: int = 32, repeats: int = 20,
              kernels: Sequence[str] = (), timing_cache: Optional[str] = None,
              compile_workers: Optional[int] = None, timing_compile_workers: int = 1,
              min_timing_gflops: float = 0.0, criteria_changes=None,
              validation=None, deadline: Optional[float] = None) -> Optional[str]:
  """Probes `spec` (its model with Mods, in bf16), selects and validates its plan
  (`dispatch.pipeline.probe_and_plan`); returns the plan's path, or None when the budget ran out
  first (a rerun resumes). `budget_s`: seconds the probe may take from now (its `should_stop`,
  `experiments.time_limit.stop_after`). `kernels`: the probe's candidates (empty: the default
  list); `compile_workers`, `timing_compile_workers`, `min_timing_gflops`: those `ProbeOptions`;
  `criteria_changes`: fields of the default budget to change (`probe_and_plan`'s); `validation`:
  the `ValidationConfig` (None: the defaults); `deadline` (a `time.time()`): validation pauses
  before a round or measurement expected to end past it."""
  from loka_jax.dispatch.pipeline import probe_and_plan  # heavy: only when planning
  from loka_jax.dispatch.validate import ValidationConfig
  from loka_jax.probe.runner import ProbeOptions, ProbeSetupError
  workdir = plan_dir(plans_root, spec.model, spec.preset)
  path = os.path.join(workdir, PLAN_FILE)
  if os.path.exists(path):
    return path
  options = ProbeOptions(samples=samples, repeats=repeats,
                         should_stop=time_limit.stop_after(budget_s), plots=False,
                         site_plots=False, kernels=tuple(kernels), timing_cache=timing_cache,
                         compile_workers=compile_workers,
                         timing_compile_workers=timing_compile_workers,
                         min_timing_gflops=min_timing_gflops)
  should_stop = None if deadline is None else (lambda ahead_s: time.time() + ahead_s > deadline)
  try:
    probe_and_plan(spec, workdir, train_config=train_config, probe_options=options,
                   build=build, should_stop=should_stop, criteria_changes=criteria_changes,
                   validation=validation or ValidationConfig())
  except RuntimeError as e:  # the probe's budget or validation's deadline: a rerun resumes
    print(f"[bench] plan for {spec.model}/{spec.preset} not ready: {e}", flush=True)
    return None
  except ProbeSetupError as e:  # e.g. the probe cannot fit the card: no rerun makes the plan
    print(f"[bench] no plan for {spec.model}/{spec.preset}: {e}", flush=True)
    return None
  return path if os.path.exists(path) else None
