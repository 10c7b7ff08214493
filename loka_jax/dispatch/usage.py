"""Which candidate kernels the selection ever picks, over many probe reports of one card.

A probe evaluates and times every candidate kernel at every site and pass. At the `large`
presets the timing is most of a probe's GPU time (DHEN `large` on the H200: 80-264 s a GEMM
shape, compile-bound), and some candidates never win there: over the H200's reports the
Pallas per-pass GEMMs never exceed 0.75x bf16, since Pallas's Triton lowering gives the FP8
dot no wgmma (docs/results/kernel_resources_sm90.md). `kernel_usage` counts, per kernel, the
passes where it is within the error budget on accuracy alone, the passes that timed it, the
passes where `dispatch.select` picks it for training and for serving, and the passes where it
is the fastest timed. A new model's probe on that card can
leave out the per-pass kernels that nothing picks (`droppable`, for a probe's candidate list), with
the counts as the evidence. Fused ops are always kept: validation's speed promotion tries
them at sites the selection left in bf16, so a kernel the selection never picks may still
be promoted.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, Iterable, List, Mapping, Optional

from loka_jax import kernels as kernels_lib
from loka_jax.dispatch import selection, timing_source
from loka_jax.kernels.base import PER_PASS
from loka_jax.kernels.choice import PASSES
from loka_jax.probe import eligibility, timing_table
from loka_jax.probe.eligibility import Criteria

BASELINE = selection.FALLBACK
_COUNTS = ("safe", "timed", "picked", "served", "fastest")


def kernel_usage(reports: Iterable[Mapping], criteria: Optional[Criteria] = None, *,
                 fill_from_table: bool = False, table_dir: str = timing_table.TIMINGS_DIR
                 ) -> Dict[str, Dict[str, float]]:
  """{kernel: {"safe", "timed", "picked", "served", "fastest", "max_speedup", "max_fwd_speedup"}}
  over every (site, pass) of the reports: the FP8 kernel's passes within `criteria`'s error budget,
  its speed aside (`eligibility.assess`); the passes with a measured speedup; those where
  `dispatch.select` under `criteria` (default: each report's default budget) picks the kernel for
  training, and the forward passes where it picks it for serving (`objective="serve"`); those where
  its median speedup is the largest timed; and its largest median speedup over bf16, in any pass and
  in the forward (a fused op's passes differ: the forward-only op runs its gradients in bf16).
  `fill_from_table`: the passes a report left untimed take the timings of its card's committed table
  (in `table_dir`), as `dispatch.select(..., fill_from_table=True)` does."""
  from loka_jax.dispatch.pipeline import default_criteria  # heavy: only when counting
  usage: Dict[str, Dict[str, float]] = collections.defaultdict(
      lambda: {**dict.fromkeys(_COUNTS, 0), "max_speedup": 0.0, "max_fwd_speedup": 0.0})
  for report in reports:
    budget = criteria or default_criteria(report)
    accuracy = dataclasses.replace(budget, min_speedup=None)
    timing = dict(fill_from_table=fill_from_table, table_dir=table_dir)
    train = selection.select(report, budget, **timing)
    serve = selection.select(report, budget, objective=selection.SERVE, **timing)
    for name, site in _sites(report, **timing).items():
      for pass_name in PASSES:
        entries = site.get("passes", {}).get(pass_name) or {}
        if not entries:
          continue
        for kernel, e in entries.items():
          if (kernel != BASELINE and isinstance(e, Mapping)
              and eligibility.assess({**e, "kernel": kernel}, pass_name, accuracy).safe):
            usage[kernel]["safe"] += 1
        speedups = {k: e["speedup"][1] for k, e in entries.items()
                    if isinstance(e, Mapping) and e.get("speedup")}
        for kernel, speedup in speedups.items():
          usage[kernel]["timed"] += 1
          usage[kernel]["max_speedup"] = max(usage[kernel]["max_speedup"], speedup)
          if pass_name == "fwd":
            usage[kernel]["max_fwd_speedup"] = max(usage[kernel]["max_fwd_speedup"], speedup)
        if speedups:
          usage[max(speedups, key=speedups.get)]["fastest"] += 1
        for plan, count in ((train, "picked"), (serve, "served")):
          choice = plan.choice_for(name)
          if choice is not None and (count == "picked" or pass_name == "fwd"):
            usage[choice.for_pass(pass_name)][count] += 1
  return {k: dict(v) for k, v in usage.items()}


def _sites(report: Mapping, fill_from_table: bool, table_dir: str) -> Mapping[str, Mapping]:
  """The report's sites, with the timings selection sees when it fills from the table."""
  if not fill_from_table:
    return report["sites"]
  source = timing_source.resolve_timing(report, fill_from_table=True, table_dir=table_dir)
  return {name: selection.effective_site(report, name, source)[0] for name in report["sites"]}


def droppable(usage: Mapping[str, Mapping]) -> List[str]:
  """The timed per-pass kernels that neither selection picked anywhere; never the baseline
  (every plan's fallback) or a fused op (validation may promote it)."""
  return sorted(k for k, u in usage.items()
                if k != BASELINE and u["timed"] and not (u["picked"] or u["served"])
                and k in kernels_lib.names() and kernels_lib.get(k).sort == PER_PASS)


def kept_kernels(usage: Mapping[str, Mapping]) -> List[str]:
  """A probe's candidate kernel list without the droppable kernels: the baseline first, then the
  rest of the timed ones, most picked first."""
  gone = set(droppable(usage)) | {BASELINE}
  rest = sorted((k for k, u in usage.items() if k not in gone and u["timed"]),
                key=lambda k: (-usage[k]["picked"], -usage[k]["served"], k))
  return [BASELINE] + rest


def markdown(usage: Mapping[str, Mapping]) -> str:
  """The counts as a table, most picked first."""
  lines = ["| kernel | passes within the error budget | passes timed | picked (train) | "
           "picked (serve) | fastest timed | best median speedup | in the forward |",
           "|---|---|---|---|---|---|---|---|"]
  for k in sorted(usage, key=lambda k: (-usage[k]["picked"], -usage[k]["served"],
                                        -usage[k]["timed"], k)):
    u = usage[k]
    safe = "-" if k == BASELINE else u["safe"]
    best, fwd = (f"{u[f]:.2f}x" if u[f] else "-" for f in ("max_speedup", "max_fwd_speedup"))
    lines.append(f"| {k} | {safe} | {u['timed']} | {u['picked']} | {u['served']} | "
                 f"{u['fastest']} | {best} | {fwd} |")
  return "\n".join(lines)
