"""Reading a training-loss spike from a run's per-module norms.

A run trained with `TrainConfig.module_norms` (`experiments.train
--config.train.module_norms=True --config.train.log_every=1`) logs every step's gradient,
parameter and update norm of each module (module_norms.py). This module asks of such a log:
at which step did the loss leave its recent range, which modules' gradients (and updates)
left theirs, in what order, and how many
steps before the loss; and which modules' outputs (the forward's activations) grew first.
"Left its recent range" is one rule for every series: the value
exceeds `factor` times its median over the `window` logged steps before it (with at least
`min_history` of them, so the first steps from initialization, whose gradients fall fast, are
not read as jumps).

`experiments.report spikes` prints the summary and writes `spike.json`, `spike.md` and
`spike.png` beside the run's metrics.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from loka_jax import figures, jsonio
from loka_jax.train import module_norms as norms_lib

GRAD_FACTOR = 10.0   # a module's gradient (or update) norm jumps at 10x its recent median
OUTPUT_FACTOR = 3.0  # a module's output RMS jumps at 3x its recent median
LOSS_FACTOR = 2.0    # the training loss spikes at 2x its recent median
WINDOW = 20          # logged steps the recent median is taken over
# Modules whose gradients jump within this many steps of the first one jumped with it: a
# first module that leads the rest by a step or less marks a jump of the whole network, not
# one module's (DCNv2 `large`'s spike on an H200: 7 of 12 modules within a step).
TOGETHER_STEPS = 1
MIN_HISTORY = 5      # logged steps a series needs before it can jump


class NormTraceError(ValueError):
  """A metrics file that cannot be read as a per-module norm trace."""


@dataclasses.dataclass(frozen=True)
class NormTrace:
  """The logged steps of one run: its loss and each module's norms (NaN where a line has
  none, e.g. a skipped step's)."""
  path: str
  steps: np.ndarray                               # int, increasing
  loss: np.ndarray                                # mean training loss of each line
  max_loss: np.ndarray                            # worst step's loss of each line
  norms: Mapping[str, Mapping[str, np.ndarray]]   # kind (module_norms.KINDS) -> module -> values

  @property
  def modules(self) -> List[str]:
    """The modules with parameters (those of the gradient norms)."""
    return sorted(self.norms[norms_lib.GRAD])

  @property
  def every_step(self) -> bool:
    """Whether each line is one step (log_every=1), so a jump's step is exact."""
    return bool(len(self.steps) < 2 or np.all(np.diff(self.steps) == 1))


def read_trace(path: str) -> NormTrace:
  """The per-module norm trace of a metrics.jsonl (or of the run directory holding it)."""
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  if not os.path.exists(path):
    raise NormTraceError(f"no metrics file at {path}")
  by_step: Dict[int, Mapping[str, Any]] = {}
  rows = list(jsonio.jsonl_rows(path))
  for index, (number, record, error) in enumerate(rows):
    if error is not None:
      if index == len(rows) - 1:
        continue  # the last append of a killed run, cut short
      raise NormTraceError(f"{path} line {number} is not JSON ({error}); the metrics file "
                           "is corrupt")
    if not isinstance(record, dict) or "loss" not in record or "step" not in record:
      continue  # an error, swap or other event line
    if not isinstance(record["step"], int) or not isinstance(record["loss"], (int, float)):
      raise NormTraceError(f"{path} line {number}: step/loss are not numbers: {record!r:.200}")
    by_step[record["step"]] = record  # a resumed run's repeated line: the later one counts
  records = [by_step[s] for s in sorted(by_step)]
  with_norms = [r for r in records if norms_lib.GRAD in r]
  if not with_norms:
    raise NormTraceError(
        f"{path} has no per-module norms: train the run with train.module_norms=True (and "
        "train.log_every=1, to read every step)")
  # Each kind has its own modules: the outputs include parameter-free ones (and none in a
  # log written before they were recorded).
  norms = {kind: {m: np.array([float(r.get(kind, {}).get(m, math.nan)) for r in records])
                  for m in sorted({m for r in with_norms for m in r.get(kind, {})})}
           for kind in norms_lib.KINDS}
  return NormTrace(
      path=path, steps=np.array([r["step"] for r in records]),
      loss=np.array([float(r["loss"]) for r in records]),
      max_loss=np.array([float(r.get("max_loss", r["loss"])) for r in records]),
      norms=norms)


@dataclasses.dataclass(frozen=True)
class Jump:
  """The first logged step at which `series` exceeded `factor` x its recent median."""
  series: str          # a module's name, or "loss"
  kind: str            # module_norms.GRAD / UPDATE / PARAM, or "loss"
  step: int
  value: float
  baseline: float      # the median it is set against

  @property
  def ratio(self) -> float:
    return self.value / self.baseline if self.baseline > 0 else math.inf

  def to_dict(self) -> Dict[str, Any]:
    return {**dataclasses.asdict(self), "ratio": self.ratio}


def first_jump(values: np.ndarray, steps: np.ndarray, factor: float, *, window: int = WINDOW,
               min_history: int = MIN_HISTORY) -> Optional[tuple]:
  """(step, value, baseline) of the first finite value above `factor` x the median of the
  finite values among the `window` before it, given at least `min_history` of them."""
  if factor <= 1:
    raise ValueError(f"factor must be > 1, got {factor}")
  if window < min_history or min_history < 1:
    raise ValueError(f"need window >= min_history >= 1, got {window} and {min_history}")
  for i in range(len(values)):
    if not math.isfinite(values[i]):
      continue
    history = values[max(0, i - window):i]
    history = history[np.isfinite(history)]
    if len(history) < min_history:
      continue
    baseline = float(np.median(history))
    if values[i] > factor * baseline:
      return int(steps[i]), float(values[i]), baseline
  return None


def module_jumps(trace: NormTrace, kind: str = norms_lib.GRAD, factor: float = GRAD_FACTOR,
                 **kwargs) -> List[Jump]:
  """Every module's first jump in `kind`, earliest first (ties: the larger ratio first)."""
  out = []
  for module, values in trace.norms[kind].items():
    hit = first_jump(values, trace.steps, factor, **kwargs)
    if hit is not None:
      out.append(Jump(module, kind, *hit))
  return sorted(out, key=lambda j: (j.step, -j.ratio, j.series))


def summarize(trace: NormTrace, *, grad_factor: float = GRAD_FACTOR,
              loss_factor: float = LOSS_FACTOR, output_factor: float = OUTPUT_FACTOR,
              window: int = WINDOW, min_history: int = MIN_HISTORY) -> Dict[str, Any]:
  """The spike's story as a JSON-able dict: the loss's worst step and first jump, the
  modules whose gradient and update norms and output RMS jumped (in order), and the lead of
  the first gradient jump over the loss's."""
  rule = {"window": window, "min_history": min_history}
  peak = int(np.nanargmax(trace.max_loss))
  loss_hit = first_jump(trace.max_loss, trace.steps, loss_factor, **rule)
  loss_jump = Jump("loss", "loss", *loss_hit) if loss_hit else None
  grads = module_jumps(trace, norms_lib.GRAD, grad_factor, **rule)
  updates = module_jumps(trace, norms_lib.UPDATE, grad_factor, **rule)
  outputs = module_jumps(trace, norms_lib.OUTPUT, output_factor, **rule)
  lead = (loss_jump.step - grads[0].step) if (loss_jump and grads) else None
  together = [j.series for j in grads if j.step - grads[0].step <= TOGETHER_STEPS]
  return {
      "metrics": trace.path, "steps": [int(trace.steps[0]), int(trace.steps[-1])],
      "every_step": trace.every_step, "modules": len(trace.modules),
      "rule": {**rule, "grad_factor": grad_factor, "loss_factor": loss_factor,
               "output_factor": output_factor},
      "peak": {"step": int(trace.steps[peak]), "loss": float(trace.max_loss[peak])},
      "loss_jump": loss_jump.to_dict() if loss_jump else None,
      "grad_jumps": [j.to_dict() for j in grads],
      "update_jumps": [j.to_dict() for j in updates],
      "output_jumps": [j.to_dict() for j in outputs],
      "first_module": grads[0].series if grads else None,
      "lead_steps": lead,
      # the modules whose gradients jumped within TOGETHER_STEPS of the first's, first included
      "jumped_together": together,
  }


def markdown(summary: Mapping[str, Any], top: int = 12) -> str:
  """The summary as the few lines and the table a reader of a spike wants."""
  rule = summary["rule"]
  lines = [f"Spike report: `{summary['metrics']}`, steps {summary['steps'][0]}-"
           f"{summary['steps'][1]}, {summary['modules']} modules"
           + ("" if summary["every_step"] else
              " (logged every few steps: a jump's step is the line that holds it)") + ".",
           f"Worst step: loss {summary['peak']['loss']:.4g} at step {summary['peak']['step']}."]
  jump = summary["loss_jump"]
  lines.append(f"The loss first exceeds {rule['loss_factor']:g}x its median over the "
               f"{rule['window']} steps before at step {jump['step']} "
               f"({jump['value']:.4g} vs {jump['baseline']:.4g})." if jump else
               f"The loss never exceeds {rule['loss_factor']:g}x its recent median: no spike "
               "by this rule.")
  grads = summary["grad_jumps"]
  if not grads:
    lines.append(f"No module's gradient norm exceeds {rule['grad_factor']:g}x its recent "
                 "median.")
  else:
    lead = summary["lead_steps"]
    lines.append(
        f"First gradient jump: `{grads[0]['series']}` at step {grads[0]['step']}"
        + ("" if lead is None else
           f", {lead} steps before the loss's" if lead > 0 else
           ", at the loss's step" if lead == 0 else f", {-lead} steps after the loss's") + ".")
    together = summary.get("jumped_together") or [grads[0]["series"]]
    if len(together) > 1:
      lines.append(
          f"{len(together)} of {summary['modules']} modules' gradients jumped within "
          f"{TOGETHER_STEPS} step{'s' if TOGETHER_STEPS > 1 else ''} of it ("
          + ", ".join(f"`{m}`" for m in together) + "), so its lead over them is slight"
          + (" and the jump is the whole network's" if len(together) == summary["modules"]
             else "") + ".")
    updates = {j["series"]: j for j in summary["update_jumps"]}
    lines += ["", "| module | gradient jump step | gradient norm (x recent median) | "
              "update jump step |", "|---|---|---|---|"]
    for j in grads[:top]:
      u = updates.get(j["series"])
      lines.append(f"| {j['series']} | {j['step']} | {j['value']:.3g} ({j['ratio']:.1f}x) | "
                   f"{u['step'] if u else '-'} |")
    if len(grads) > top:
      lines.append(f"| ({len(grads) - top} more) | | | |")
  outputs = summary.get("output_jumps", [])
  if outputs:
    lines += ["", f"Outputs above {rule['output_factor']:g}x their recent median RMS, earliest "
              "first:", "", "| module | output jump step | output RMS (x recent median) |",
              "|---|---|---|"]
    lines += [f"| {j['series']} | {j['step']} | {j['value']:.3g} ({j['ratio']:.1f}x) |"
              for j in outputs[:top]]
    if len(outputs) > top:
      lines.append(f"| ({len(outputs) - top} more) | | |")
  return "\n".join(lines) + "\n"


def spike_plot(trace: NormTrace, summary: Mapping[str, Any], path: str, top: int = 6) -> str:
  """Loss, then the gradient and update norms of the modules that jumped first (else of the
  largest gradients) and the output RMS of the modules whose outputs jumped first, over the
  logged steps, with the loss's jump and worst step marked."""

  shown = [j["series"] for j in summary["grad_jumps"][:top]]
  if len(shown) < top:
    by_size = sorted(trace.modules, key=lambda m: -np.nanmax(trace.norms[norms_lib.GRAD][m]))
    shown += [m for m in by_size if m not in shown][:top - len(shown)]
  outputs = trace.norms[norms_lib.OUTPUT]
  shown_out = [j["series"] for j in summary.get("output_jumps", [])[:top]]
  shown_out += [m for m in shown if m in outputs and m not in shown_out][:top - len(shown_out)]
  fig, axes = figures.subplots(4, 1, figsize=(10, 11), sharex=True)
  axes[0].plot(trace.steps, trace.max_loss, color="black", lw=1)
  axes[0].set_ylabel("training loss (worst step of a line)")
  for ax, kind, label, modules in ((axes[1], norms_lib.GRAD, "gradient norm", shown),
                                   (axes[2], norms_lib.UPDATE, "update norm", shown),
                                   (axes[3], norms_lib.OUTPUT, "output RMS", shown_out)):
    for module in modules:
      ax.plot(trace.steps, trace.norms[kind][module], lw=1, label=module)
    ax.set_ylabel(label)
  for ax in axes:
    ax.set_yscale("log")
    if summary["loss_jump"]:
      ax.axvline(summary["loss_jump"]["step"], color="red", ls="--", lw=0.8)
    ax.axvline(summary["peak"]["step"], color="gray", ls=":", lw=0.8)
  axes[1].legend(fontsize=7, loc="upper left")
  if shown_out:
    axes[3].legend(fontsize=7, loc="upper left")
  axes[3].set_xlabel("step (red dashed: the loss's jump; gray dotted: its worst step)")
  axes[0].set_title(os.path.dirname(trace.path) or trace.path, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path
