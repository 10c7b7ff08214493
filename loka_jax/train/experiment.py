"""What `experiments.train` runs: a tower preset + a data source + a precision arm -> train().

Kept out of the script so that tests, notebooks and other experiments (ablations, benchmarks)
build runs the same way.
"""
from __future__ import annotations

import dataclasses
import logging as py_logging
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from absl import logging

from loka_jax.data.make import make_source
from loka_jax.data.spec import FeatureSpec
from loka_jax.kernels import KernelPlan
from loka_jax.models import SiteConfig, apply_mods, build_model, get_config
from loka_jax.models.presets import check_keep_bias
from loka_jax.plan import PlanMismatchError, check_plan, read_plan, to_kernel_plan
from loka_jax.train.loop import TrainConfig, train


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """The common experiment flags (loka_jax/flags.py) as one value."""
  model: str = "wukong"
  preset: str = "tiny"
  data: str = "synthetic"
  data_spec: Optional[str] = None
  data_path: Optional[str] = None
  data_cache: Optional[str] = None
  precision: str = "bf16"
  kernel: str = "xla_fp8_tensorwise"
  plan: Optional[str] = None
  mods: Tuple[str, ...] = ()
  seed: int = 0
  num_eval: Optional[int] = None
  id_policy: str = "error"
  drift_every: int = 0                  # loka: drift valve cadence in steps (0: off)
  drift_report: Optional[str] = None    # loka: the plan's probe report (default: provenance)
  drift_max_overhead: float = 0.02      # loka: the valve's share of training time, at most
  drift_compile_ahead: bool = True      # loka: compile the valve's pass in the background

  def run_info(self) -> Dict[str, Any]:
    """What identifies the run in config.json and final.json."""
    info = {"model": self.model, "preset": self.preset, "data": self.data,
            "data_spec": self.data_spec, "data_path": self.data_path,
            "precision": self.precision, "mods": list(self.mods), "seed": self.seed,
            "num_eval": self.num_eval}
    if self.precision == "fp8_all":
      info["kernel"] = self.kernel
    if self.precision == "loka":
      info["plan"] = self.plan
      if self.plan and os.path.exists(self.plan):
        # The file may move (its path is a resumable setting); what it runs may not.
        info["plan_kernels_sha256"] = read_plan(self.plan).kernel_digest()
      if self.drift_every:  # only then: runs without the valve keep their config.json
        info.update(drift_every=self.drift_every, drift_report=self.drift_report,
                    drift_max_overhead=self.drift_max_overhead,
                    drift_compile_ahead=self.drift_compile_ahead)
    return info


class PlanError(RuntimeError):
  """Precision 'loka' without a usable plan, or with a plan that does not fit the model."""


def load_plan(path: Optional[str]) -> KernelPlan:
  """The KernelPlan of a loka.plan/1 file (PlanError naming the file when it is unusable)."""
  if not path:
    raise PlanError("precision 'loka' needs a plan: set run.plan to a loka.plan/1 file "
                    "(`python -m experiments.dispatch` writes one)")
  try:
    plan_file = read_plan(path)  # read once: its provenance, then its kernels
    objective = plan_file["provenance"].get("objective")
    plan = to_kernel_plan(plan_file)
  except ValueError as e:  # unreadable, corrupt or malformed: the message names the file
    raise PlanError(str(e)) from e
  if objective == "serve":  # its gradient passes were never judged: bf16 or a fused op's
    raise PlanError(f"{path} is a serving plan (objective 'serve': forwards chosen for "
                    "inference, gradients not judged); train with a training plan")
  if not isinstance(plan, KernelPlan):
    raise TypeError(f"loka_jax.plan.to_kernel_plan({path!r}) returned {type(plan).__name__}, "
                    "expected a KernelPlan")
  return plan


def build_run(spec: RunSpec):
  """(model, source, preset config) for `spec`; the model follows the source's features
  (MovieLens and Criteo fix their own)."""
  config = get_config(spec.model, spec.preset)
  if spec.mods:
    config = apply_mods(config, spec.mods)
  site_config = SiteConfig.for_precision(
      spec.precision, kernel=spec.kernel,
      plan=load_plan(spec.plan) if spec.precision == "loka" else None)
  source = make_source(spec.data, features=FeatureSpec.from_dict(dict(config.features)),
                       spec=spec.data_spec, data_path=spec.data_path,
                       data_cache=spec.data_cache, seed=spec.seed, num_eval=spec.num_eval,
                       id_policy=spec.id_policy)
  model = build_model(config, source.features, site_config)
  check_keep_bias(model, config, lambda: source.train_batch(0, 2))
  if spec.precision == "loka":
    check_plan_fits(spec.plan, model, source)
  return model, source, config


def check_plan_fits(path: str, model, source) -> None:
  """PlanError listing every site, rule or kernel of the plan at `path` that does not fit
  `model` (a plan made for another model or preset would otherwise run bf16 silently)."""
  try:
    check_plan(path, model, None, source.train_batch(0, 2))
  except PlanMismatchError as e:
    raise PlanError(f"{e}\nSelect a plan for this model (`python -m experiments.dispatch`) "
                    "or fix the listed entries") from e


def run(spec: RunSpec, workdir: str, train_config: TrainConfig,
        hook: Optional[Callable] = None) -> Dict[str, Any]:
  """Builds the run and trains it (resuming from `workdir`); returns final.json's dict.

  `spec.drift_every` needs `hook(spec, config, source, workdir, batch_size)`, which builds
  the model hook that guards the plan (Dispatch's drift valve: `dispatch.valve.run` passes
  it); training itself knows nothing of Dispatch."""
  model, source, config = build_run(spec)
  if spec.drift_every:
    if hook is None:
      raise PlanError("drift_every needs the drift valve: train through "
                      "loka_jax.dispatch.valve.run (experiments.train does)")
    valve = hook(spec, config, source, workdir, train_config.batch_size)
    return train(valve.model, source, workdir, train_config, run_info=spec.run_info(),
                 model_hook=valve)
  return train(model, source, workdir, train_config, run_info=spec.run_info())


def preset_batch_size(model: str, preset: str) -> int:
  """The preset's default training batch."""
  return int(get_config(model, preset).batch_size)


# The learning-rate warm-up each preset's first steps want. At the `large` presets Adam without
# one spikes in its first steps, in bf16 as well, and FP8 in the gradient passes makes the spike
# larger: on DLRM `large` (H200) a 50-step warm-up lowered every arm's held-out log loss by
# about 0.005 after 500 steps.
SUGGESTED_WARMUP_STEPS = {"large": 50}


def recipe_notes(preset: str, optim) -> Tuple[str, ...]:
  """What a run's recipe (an OptimConfig) is likely to get wrong at `preset`; empty if nothing.
  Notes, not errors: the default recipe stays what documented commands and resumed runs use."""
  want = SUGGESTED_WARMUP_STEPS.get(preset, 0)
  if want and optim.warmup_steps == 0:
    return (f"the `{preset}` presets spike in their first steps without a learning-rate "
            f"warm-up, in bf16 too, and FP8 gradients make the spike larger: consider "
            f"optim.warmup_steps={want}",)
  return ()


def parse_mods(mods: Sequence[str]) -> Tuple[str, ...]:
  return tuple(m.strip() for m in mods if m and m.strip())


class _DropLibraryInfo(py_logging.Filter):
  """Drops INFO records logged from inside orbax (one per file it writes or closes)."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname


def quiet_library_logs() -> None:
  """Keeps the run's own progress lines readable in a script's stderr."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
    handler.addFilter(_DropLibraryInfo())
