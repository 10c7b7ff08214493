"""How far a plan's GEMMs are from what the probed kernels could give a step.

A missed speed target has two readings: the plan left time on the table (the accuracy
budget or validation kept sites in bf16), or no plan made of these kernels reaches it.
Both are sums over the probe report's kernel timings (`pipeline.site_gemm_times`, the
timings selection used): the GEMM time each plan saves over xla_bf16, projected onto a
measured step as step / (step - saved), every other op unchanged. Two references frame it:

- a single kernel everywhere (the bench's peers);
- the speed-only plan: selection with the accuracy budget switched off (`SPEED_ONLY`), the
  fastest kernel at every site where one beats bf16 at the low end of its CI. It bounds
  what any plan selected from this report's per-site timings saves, up to their noise
  (not what FP8 gains inside a step, below).

Training counts every pass; inference the forwards only (a served model's forward runs the
same GEMM, with static scales where the probe timed delayed ones, so its projection errs
low). The sums read each site alone, as selection does. Where the GEMMs are large they
predict the step: at Wukong `large` (H200) the peers' training projections land within 3%
of their rows. Where they are small, FP8 inside a whole step can beat its time alone
(operands quantized once for several passes, XLA's scheduling), which is why validation
promotes: at the 8192x2048x8 tower XLA's tensorwise FP8 everywhere projects 0.844x and
measured 0.995x.

The sites are ranked by the GEMM time the plan forgoes against the speed-only plan, each
with the plan's reason: the list of what would have to change to close the gap.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from experiments.bench import mods_set, variants
from loka_jax import figures
from loka_jax.dispatch import pipeline, selection
from loka_jax.plan.file import SCHEMA, Plan, as_plan
from loka_jax.kernels import PASSES, registry
from loka_jax.probe.eligibility import Criteria

MODES: Dict[str, Tuple[str, ...]] = {"train": PASSES, "infer": ("fwd",)}
SPEED_ONLY = Criteria(min_sqnr_fwd_db=-math.inf, min_sqnr_grad_db=-math.inf,
                      max_mere=math.inf, max_underflow=math.inf, min_speedup=1.0)
SPEED_ONLY_NAME = "speed-only (no accuracy budget)"


def _passes(mode: str) -> Tuple[str, ...]:
  if mode not in MODES:
    raise ValueError(f"mode {mode!r}: use one of {sorted(MODES)}")
  return MODES[mode]


def everywhere(kernel: str) -> Plan:
  """The plan running `kernel` in every pass of every site (a bench peer)."""
  if kernel not in registry.names():
    raise ValueError(f"unknown kernel {kernel!r}; registered: {sorted(registry.names())}")
  return Plan({"schema": SCHEMA, "sites": {}, "default": {p: kernel for p in PASSES}},
              f"<{kernel} everywhere>")


def speed_only(report: Mapping, mode: str) -> Plan:
  """The speed-only plan of `report` for `mode`: training selects over every pass, inference
  over the forwards (`selection.select`'s objectives)."""
  _passes(mode)
  objective = selection.SERVE if mode == "infer" else selection.TRAIN
  return selection.select(report, SPEED_ONLY, objective=objective)


def _fp8(kernel: str) -> bool:
  return kernel in registry.names() and registry.get(kernel).fp8


def probed_fp8_kernels(report: Mapping) -> List[str]:
  """The FP8 kernels the report probed, in its order (the default peers to set beside)."""
  return [k for k in report.get("kernels") or {} if _fp8(k)]


def _site_saved(report: Mapping, plan: Plan, mode: str
                ) -> Dict[str, Tuple[Optional[float], bool]]:
  """{site: (us saved over xla_bf16 or None when untimed, runs FP8 in a pass of `mode`)}."""
  passes = _passes(mode)
  out = {}
  for name, times in pipeline.site_gemm_times(plan, report, passes).items():
    choice = plan.choice_for(name)
    fp8 = any(registry.quantizes(choice.for_pass(p), p) for p in passes)
    if times is None:
      out[name] = (None if fp8 else 0.0, fp8)  # a bf16 site saves nothing, timed or not
    else:
      out[name] = (times[0] - times[1], fp8)
  return out


@dataclasses.dataclass(frozen=True)
class Line:
  """One plan in one mode: GEMM time saved over xla_bf16 and the step it projects."""
  plan: str
  mode: str
  fp8_sites: int
  untimed_fp8_sites: int       # FP8 sites without timings: not counted in saved_ms
  saved_ms: float
  step_ms: Optional[float]     # the measured baseline step (None: not given)
  projected: Optional[float]   # step / (step - saved)
  measured: Optional[float]    # the plan's own measured speedup over the baseline, if known

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


def line(report: Mapping, name: str, plan, mode: str, step_ms: Optional[float] = None,
         measured: Optional[float] = None) -> Line:
  """`plan` (named `name`) in `mode`: its FP8 sites and GEMM time saved, projected onto
  `step_ms` (the measured baseline step) where given."""
  plan = as_plan(plan, name)
  foreign = sorted(set(plan["sites"]) - set(report["sites"]))
  if foreign:
    raise ValueError(f"{name}: the plan names {len(foreign)} site(s) the probe report does not "
                     f"have ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): "
                     f"a plan of another model than the report's {report.get('model')!r}?")
  saved = _site_saved(report, plan, mode)
  saved_ms = sum(s for s, _ in saved.values() if s is not None) / 1e3
  # A plan may lose more than a step's time (a slow kernel everywhere); only a saving the
  # step cannot hold makes no projection.
  if step_ms is not None and not (math.isfinite(step_ms) and step_ms > max(saved_ms, 0.0)):
    raise ValueError(f"{name} ({mode}): a measured step of {step_ms} ms cannot hold the "
                     f"{saved_ms:.2f} ms of GEMM time the plan saves; is it the step of the "
                     "report's model and batch?")
  return Line(plan=name, mode=mode, fp8_sites=sum(fp8 for _, fp8 in saved.values()),
              untimed_fp8_sites=sum(s is None for s, _ in saved.values()),
              saved_ms=saved_ms, step_ms=step_ms,
              projected=None if step_ms is None else step_ms / (step_ms - saved_ms),
              measured=measured)


def peer_variant(kernel: str) -> Optional[str]:
  """The bench variant that runs `kernel` at every site, exactly (None: no such peer; the
  Pallas peers fall back to another kernel where theirs does not apply)."""
  return next((v.name for v in variants.VARIANTS.values()
               if v.precision == "fp8_all" and v.kernels_from == variants.UNIFORM
               and v.kernel == kernel), None)


def lines(report: Mapping, plans: Mapping[str, Any], mode: str,
          kernels: Sequence[str] = (), step_ms: Optional[float] = None,
          measured: Optional[Mapping[str, float]] = None,
          best: Optional[Plan] = None) -> List[Line]:
  """The `plans` ({name: plan}), each of `kernels` everywhere and the speed-only plan (`best`,
  else selected here), in that order, for `mode`; `measured`: {bench variant: measured
  speedup}, matched to a plan by its name and to a kernel everywhere by its `peer_variant`."""
  measured = measured or {}
  out = [line(report, name, plan, mode, step_ms, measured.get(name))
         for name, plan in plans.items()]
  out += [line(report, k, everywhere(k), mode, step_ms, measured.get(peer_variant(k)))
          for k in kernels]
  out.append(line(report, SPEED_ONLY_NAME, best or speed_only(report, mode), mode, step_ms))
  return out


def needed_saving_ms(step_ms: float, target: float) -> float:
  """The GEMM time a step of `step_ms` must shed to run `target` times faster."""
  return step_ms * (1.0 - 1.0 / target)


def _kernels_text(plan: Plan, site: str, passes: Tuple[str, ...]) -> str:
  kernels = [plan.choice_for(site).for_pass(p) for p in passes]
  return kernels[0] if len(set(kernels)) == 1 else " / ".join(kernels)


def _reason(plan: Plan, best: Plan, site: str, passes: Tuple[str, ...]) -> str:
  """The plan's reason at the first pass where it differs from the speed-only plan."""
  entry = plan["sites"].get(site)
  if entry is None:
    return "set by a rule or the plan's default"
  differs = [p for p in passes
             if plan.choice_for(site).for_pass(p) != best.choice_for(site).for_pass(p)]
  return entry[(differs or list(passes))[0]].get("reason", "")


def forgone(report: Mapping, plan, mode: str, top: int = 10,
            best: Optional[Plan] = None) -> List[Dict[str, Any]]:
  """The `top` sites where the plan saves least against the speed-only plan (`best`, else
  selected here): site, both choices, the ms forgone and the plan's reason there."""
  plan = as_plan(plan)
  passes = _passes(mode)
  best = best or speed_only(report, mode)
  mine, theirs = _site_saved(report, plan, mode), _site_saved(report, best, mode)
  rows = []
  for site, (saved, _) in mine.items():
    other = theirs.get(site, (None, False))[0]
    if saved is None or other is None or other - saved <= 0:
      continue
    rows.append({"site": site, "plan": _kernels_text(plan, site, passes),
                 "speed_only": _kernels_text(best, site, passes),
                 "forgone_ms": (other - saved) / 1e3, "reason": _reason(plan, best, site, passes)})
  return sorted(rows, key=lambda r: -r["forgone_ms"])[:top]


def measured_speedups(rows: Sequence[Mapping], subject: str, baselines: Mapping[str, str]
                      ) -> Dict[str, Dict[str, Any]]:
  """From bench speed rows of `subject` ('model/preset', `mods_set.row_subject`), per mode of
  `baselines` ({mode: variant}): {"step_ms": that variant's median step, "speedups":
  {variant: speedup over it}}, each variant's from its one-interleaving pair with the
  baseline where the row has one, else from the two rows' medians."""
  mine = {r["variant"]: r for r in rows
          if r.get("suite") in ("models", "towers") and mods_set.row_subject(r) == subject}
  out = {}
  for mode, baseline in baselines.items():
    _passes(mode)
    if baseline not in mine:
      raise ValueError(f"no {baseline!r} row of {subject} among the rows (variants there: "
                       f"{sorted(mine) or 'none'})")
    base_us = float(mine[baseline][mode]["median_us"])
    speedups = {}
    for variant, row in mine.items():
      pair = ((row.get("head_to_head") or {}).get(baseline) or {}).get(mode)
      speedups[variant] = (float(pair["ratio"]) if pair else
                           base_us / float(row[mode]["median_us"]))
    out[mode] = {"baseline": baseline, "step_ms": base_us / 1e3, "speedups": speedups}
  return out


def _x(v: Optional[float]) -> str:
  return "-" if v is None else f"{v:.3f}x"


def markdown(all_lines: Sequence[Line], forgone_rows: Mapping[str, Sequence[Mapping]],
             targets: Mapping[str, float], baselines: Mapping[str, str]) -> str:
  """The lines as one table per mode (with what each target needs), then each mode's
  forgone sites; `baselines`: {mode: the measured step's variant}."""
  out = []
  for mode in MODES:
    mine = [l for l in all_lines if l.mode == mode]
    if not mine:
      continue
    step = mine[0].step_ms
    head = f"### {mode}: GEMM time saved over xla_bf16"
    if step is not None:
      head += (f", projected onto {baselines.get(mode, 'the baseline')}'s measured "
               f"{step:.2f} ms step")
      if mode in targets:
        head += (f" (a {targets[mode]:.2f}x target needs "
                 f"{needed_saving_ms(step, targets[mode]):.2f} ms)")
    out += [head, "", "| plan | FP8 sites | GEMM ms saved | projected | measured |",
            "|---|---|---|---|---|"]
    for l in mine:
      untimed = f" ({l.untimed_fp8_sites} untimed)" if l.untimed_fp8_sites else ""
      out.append(f"| {l.plan} | {l.fp8_sites}{untimed} | {l.saved_ms:.2f} | "
                 f"{_x(l.projected)} | {_x(l.measured)} |")
    rows = forgone_rows.get(mode) or []
    if rows:
      out += ["", f"Sites where the plan forgoes most against the speed-only plan ({mode}):",
              "", "| site | plan | speed-only | ms forgone | the plan's reason |",
              "|---|---|---|---|---|"]
      out += [f"| {r['site']} | {r['plan']} | {r['speed_only']} | {r['forgone_ms']:.2f} | "
              f"{r['reason'][:160]} |" for r in rows]
    out.append("")
  return "\n".join(out)


def plot(all_lines: Sequence[Line], path: str, targets: Mapping[str, float],
         baselines: Mapping[str, str], title: str) -> None:
  """Projected (bars) and measured (dots) speedups per plan, one panel per mode, with each
  target as a dashed line."""
  modes = [m for m in MODES if any(l.mode == m and l.projected for l in all_lines)]
  if not modes:
    raise ValueError("nothing to plot: give the measured step (--rows or --*_step_ms)")
  per_mode = max(sum(l.mode == m for l in all_lines) for m in modes)
  fig, axes = figures.subplots(1, len(modes), figsize=(6.5 * len(modes), 0.45 * per_mode + 2.2),
                               squeeze=False)
  for ax, mode in zip(axes[0], modes):
    mine = [l for l in all_lines if l.mode == mode and l.projected]
    ys = list(range(len(mine)))[::-1]
    ax.barh(ys, [l.projected for l in mine], color="#4c72b0", label="projected (GEMM timings)")
    got = [(y, l.measured) for y, l in zip(ys, mine) if l.measured is not None]
    if got:
      ax.plot([m for _, m in got], [y for y, _ in got], "o", color="black", label="measured")
    if mode in targets:
      ax.axvline(targets[mode], color="red", linestyle="--", label=f"target {targets[mode]}x")
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_yticks(ys)
    ax.set_yticklabels([l.plan for l in mine])
    ax.set_xlim(left=min(0.8, min(l.projected for l in mine) - 0.05))
    ax.set_xlabel(f"{mode} speedup over {baselines.get(mode, 'the baseline')}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
