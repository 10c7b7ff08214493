"""The end-to-end check that needs no loka_jax training loop: held-out loss on the user's own
batches with the user's own loss, the plan against the same model in bf16, backing off the
worst FP8 sites until the plan is non-inferior (`loka_jax.validate`).

Per held-out batch the relative loss change (plan - bf16) / bf16 is one pair; the plan passes
when the upper end of the 95% interval of the mean change is within `max_rel_loss`
(`train.verdict.noninferiority`). A plan better than bf16 passes. While it does not pass, the
FP8 sites whose forward the probe report ranks least accurate (or, without a report, whose
plan alone moves the loss most) go back to bf16 forwards, one round at a time.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import jax
import numpy as np

from loka_jax.plan import binding
from loka_jax.plan.file import check_called
from loka_jax.plan.file import Plan, add_validation, as_plan, back_off
from loka_jax.dispatch.validate import (BASELINE, DELAYED_WARMUP, fp8_sites, only_site,
                                        report_scores, worst_by_report)
from loka_jax.kernels import FP8_META, KernelChoice, KernelPlan, registry
from loka_jax.kernels.flax_delayed import merge_fp8_meta
from loka_jax.precision import BF16, DtypePolicy
from loka_jax.probe.streaming import model_forward
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS
from loka_jax.train.verdict import MET, noninferiority

STEP = "held_out_loss"


class ValidationInputError(ValueError):
  """Arguments the check cannot run with; the message says what to change."""


def _losses(loss_of: Callable, variables, batches: Sequence) -> List[float]:
  return [float(loss_of(variables, b)) for b in batches]


def _stateful(plan: KernelPlan, names: Sequence[str]) -> bool:
  return any(registry.get(plan.choice_for(n).for_pass(p)).stateful for n in names
             for p in ("fwd", "grad_lhs", "grad_rhs"))


class _Runner:
  """Compiled held-out losses of the model under any kernel plan (cached per plan)."""

  def __init__(self, module, forward: Callable, loss_fn: Callable, policy, variables,
               batches: Sequence, calibration: Sequence):
    self.module, self.forward, self.loss_fn, self.policy = module, forward, loss_fn, policy
    self.variables, self.batches, self.calibration = variables, list(batches), list(calibration)
    self._cache: Dict[Any, List[float]] = {}
    self.site_names = self._called_sites()

  def loss_fn_for(self, kplan: KernelPlan) -> Callable:
    def loss_of(variables, batch):
      with binding.routing(kplan, self.policy):
        out = self.forward(variables, batch)
      return self.loss_fn(out, batch)
    return loss_of

  def _called_sites(self) -> List[str]:
    """The site names one forward pass calls (abstract trace)."""
    seen: set = set()

    def run(v, b):
      with binding.routing(BASELINE, self.policy, seen):
        return self.loss_fn(self.forward(v, b), b)
    jax.eval_shape(run, self.variables, self.batches[0])
    return sorted(seen)

  def _variables_for(self, kplan: KernelPlan, loss_of: Callable):
    """The user's variables, with calibrated delayed-scaling state when the plan needs it."""
    if FP8_META in self.variables or not _stateful(kplan, self.site_names):
      return self.variables
    wrapped = binding.Wrapped(self.module, kplan, self.policy)
    try:
      variables = wrapped.init_state(self.variables, self.batches[0])
    except Exception as e:  # noqa: BLE001 - the model's own init decides what it accepts
      raise ValidationInputError(
          "the plan uses delayed scaling, whose state could not be created from a batch "
          f"({type(e).__name__}: {str(e)[:160]}); pass variables that hold it: "
          "fp8_model.init_state(variables, *model_inputs)") from None
    grad = jax.jit(jax.grad(lambda meta, v, b: loss_of({**v, FP8_META: meta}, b)))
    meta = variables[FP8_META]
    for b in self.calibration[:DELAYED_WARMUP]:
      meta = merge_fp8_meta(grad(meta, variables, b))
    return {**variables, FP8_META: meta}

  def losses(self, kplan: KernelPlan) -> List[float]:
    if kplan not in self._cache:
      loss_of = self.loss_fn_for(kplan)
      variables = self._variables_for(kplan, loss_of)
      self._cache[kplan] = _losses(jax.jit(loss_of), variables, self.batches)
    return self._cache[kplan]


def _worst_sites(report: Optional[Mapping], plan: Plan, candidates: Mapping[str, KernelChoice],
                 runner: _Runner, base: List[float]) -> Dict[str, str]:
  """{site: why} of the sites to back off this round."""
  if report is not None:
    scores = report_scores(report, plan, candidates, "error", passes=("fwd",))
    return {s: f"forward SQNR {-scores[s]:.1f} dB, among the least accurate in the probe "
               "report" if math.isfinite(scores[s]) else "not in the probe report"
            for s in worst_by_report(scores)}
  contribution = {}
  for site, choice in candidates.items():
    alone = runner.losses(only_site(site, choice))
    contribution[site] = float(np.mean((np.asarray(alone) - base) / np.asarray(base)))
  worst = max(contribution, key=lambda s: (contribution[s], s))
  return {worst: f"this site alone moves held-out loss {100 * contribution[worst]:+.4f}%"}


def validate(fp8_model, plan, variables, batches, loss_fn: Callable, *,
             apply_fn: Optional[Callable] = None, apply_kwargs: Optional[Mapping] = None,
             report: Optional[Mapping] = None, max_rel_loss: float = NEUTRAL_REL_LOGLOSS,
             max_rounds: int = 8, calibration_batches: Optional[Sequence] = None,
             policy: Optional[DtypePolicy] = None) -> Plan:
  """The plan after the held-out check, with every round recorded in its `validation`.

  Args:
    fp8_model: the model from `loka_jax.wrap(model, plan)` (or the plain Flax module).
    plan: the Plan to check (its sites are backed off where needed).
    variables: the model's trained variables.
    batches: held-out batches (at least 2: each is one pair of the verdict).
    loss_fn: `loss_fn(model_output, batch) -> scalar`, as given to the probe.
    apply_fn, apply_kwargs: how the model is called, as given to the probe.
    report: the ProbeReport the plan was selected from: ranks sites by forward error (one
      compile a round); without it each FP8 site is measured alone (one compile a site).
    max_rel_loss: the bound on the relative held-out loss change (default 0.02%).
    max_rounds: back-off rounds before giving up.
    calibration_batches: batches that calibrate delayed scaling (default: `batches`).
    policy: the sites' dtype policy (default: the wrapped model's, else bf16).
  """
  module = getattr(fp8_model, "module", fp8_model)
  if policy is None:
    policy = getattr(fp8_model, "policy", None) or BF16
  batches = list(batches)
  if len(batches) < 2:
    raise ValidationInputError(f"validate needs at least 2 held-out batches (each is one pair "
                               f"of the verdict), got {len(batches)}")
  plan = as_plan(plan)
  runner = _Runner(module, model_forward(module, apply_fn, apply_kwargs), loss_fn, policy,
                   variables, batches, list(calibration_batches or batches))
  names = runner.site_names
  check_called(plan.kernel_plan(), names, type(module).__name__)
  base = runner.losses(BASELINE)
  base_arr = np.asarray(base)
  for round_ in range(max_rounds + 1):
    got = runner.losses(plan.kernel_plan())
    candidates = fp8_sites(plan, names, passes=("fwd",))  # what a held-out loss sees
    record = {"step": STEP, "round": round_, "loss": float(np.mean(got)),
              "loss_bf16": float(np.mean(base)), "batches": len(batches),
              "fp8_forward_sites": len(candidates)}
    if not fp8_sites(plan, names):
      record.update(verdict="not applicable", passed=True,
                    note="the plan runs no FP8 product")
      return add_validation(plan, record)
    verdict = noninferiority((np.asarray(got) - base_arr) / base_arr, max_rel_loss)
    record.update(verdict=verdict["verdict"], rel_loss_change=verdict["mean"],
                  rel_loss_change_ci=verdict["ci"], budget=max_rel_loss,
                  passed=verdict["verdict"] == MET)
    if "pairs_to_resolve" in verdict:
      record["batches_to_resolve"] = verdict["pairs_to_resolve"]
    if record["passed"] or not candidates or round_ == max_rounds:
      if not record["passed"]:
        record["note"] = ("no FP8 forward left to back off" if not candidates
                          else f"stopped after {max_rounds} back-off rounds")
      return add_validation(plan, record)
    plan = add_validation(plan, record)
    excess = (f"held-out loss change {100 * verdict['mean']:+.4f}% "
              f"(95% CI up to {100 * verdict['ci'][1]:+.4f}%) not within "
              f"{100 * max_rel_loss:g}%")
    for site, why in _worst_sites(report, plan, candidates, runner, base_arr).items():
      plan = back_off(plan, site, "fwd", f"{excess}; {why}", step=STEP)
  return plan
