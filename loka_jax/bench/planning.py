"""The LoKA arm's plans: one `plan.json` per target, from probing that target (bf16 + Mods)
and selecting per site and pass. Resumable: the probe keeps its own checkpoints, evaluation
cache and timing cache under DIR/plans/<target>/, and a finished plan is never redone.

`loka_jax.dispatch.pipeline.probe_and_plan` (probe -> select -> validate) is used when the
checkout has it; otherwise the probe runner and `dispatch.select` are called directly.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Optional

from loka_jax import dispatch
from loka_jax.kernels import KernelPlan
from loka_jax.train import experiment
from loka_jax.train.loop import TrainConfig

PLAN_FILE = "plan.json"


def plan_dir(plans_root: str, model: str, preset: str) -> str:
  return os.path.join(plans_root, f"{model}_{preset}")


def plan_path(plans_root: str, model: str, preset: str) -> str:
  return os.path.join(plan_dir(plans_root, model, preset), PLAN_FILE)


def load(plans_root: str, model: str, preset: str) -> Optional[KernelPlan]:
  """The target's KernelPlan, or None when its plan file does not exist yet."""
  path = plan_path(plans_root, model, preset)
  return dispatch.load_plan(path) if os.path.exists(path) else None


def _pipeline():
  try:
    from loka_jax.dispatch import pipeline
  except ImportError:
    return None
  return getattr(pipeline, "probe_and_plan", None)


def make_plan(spec: experiment.RunSpec, plans_root: str, train_config: TrainConfig, *,
              budget_s: Optional[float], build: Optional[Callable] = None,
              samples: int = 32, repeats: int = 20) -> Optional[str]:
  """Probes `spec` (its model with Mods, in bf16) and writes its plan; returns the plan's path,
  or None when the budget ran out first (a rerun resumes)."""
  from loka_jax.probe.runner import ProbeOptions, run_probe  # heavy: only when planning
  workdir = plan_dir(plans_root, spec.model, spec.preset)
  path = os.path.join(workdir, PLAN_FILE)
  if os.path.exists(path):
    return path
  options = ProbeOptions(samples=samples, repeats=repeats, budget_s=budget_s, plots=False,
                         site_plots=False)
  pipeline = _pipeline()
  if pipeline is not None:
    params = inspect.signature(pipeline).parameters
    if build is None or "build" in params:
      kwargs = {k: v for k, v in (("train_config", train_config), ("probe_options", options),
                                  ("options", options), ("build", build))
                if k in params and v is not None}
      try:
        result = pipeline(spec, workdir, **kwargs)
      except RuntimeError as e:  # the probe ran out of budget: a rerun resumes it
        print(f"[bench] plan for {spec.model}/{spec.preset} not ready: {e}", flush=True)
        return None
      return path if os.path.exists(path) else _path_of(result)
  result = run_probe(spec, os.path.join(workdir, "probe"), train_config, options=options,
                     build=build)
  if not result.complete:
    return None
  plan = dispatch.select(result.paths["json"])
  dispatch.save_plan(plan, path)
  return path


def _path_of(result) -> Optional[str]:
  paths = getattr(result, "paths", None) or {}
  if isinstance(paths.get("plan"), str) and os.path.exists(paths["plan"]):
    return paths["plan"]
  for attr in ("plan_path", "path"):
    value = getattr(result, attr, None)
    if isinstance(value, str) and os.path.exists(value):
      return value
  return None
