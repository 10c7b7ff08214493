"""A drifted site's probe report entry, evaluated again on fresh statistics: the errors of
its candidate kernels (or of some of them) as the probe measures them, the report's timings
kept (speed does not drift). The drift valve (valve.py) calls it; `config` is its
ValveConfig (samples, seed and bootstrap size of the evaluation)."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from loka_jax.dispatch.selection import TIMING_FIELDS
from loka_jax.kernels import registry
from loka_jax.probe import collector as collector_lib
from loka_jax.probe import evaluate, stats_report, summarize


def registered(kernel_names) -> List[Any]:
  kernels = []
  for k in kernel_names:
    try:
      kernels.append(registry.get(k))
    except KeyError:
      continue  # not registered in this process: it gets no entry, so it is not chosen
  return kernels


def candidates(report: Mapping, name: str) -> List[str]:
  """The kernels the report evaluated at site `name` (a re-evaluation evaluates them again)."""
  return sorted({k for ks in report["sites"][name].get("passes", {}).values() for k in ks})


def compute_dtype(report: Mapping) -> str:
  return (report.get("evaluation") or {}).get("compute_dtype", "bfloat16")


def eval_config(config) -> evaluate.EvalConfig:
  return evaluate.EvalConfig(samples=config.samples, seed=config.seed)


def site_entry(site: collector_lib.SiteProbe, state, kernel_names, compute_dtype: str,
               config, observations: int, kernels_info: Mapping) -> Dict[str, Any]:
  """A report entry of one site from its statistics `state`, as the probe evaluates it:
  kind, spec, shapes, `stats` and per-pass errors of every registered candidate."""
  kernels = registered(kernel_names)
  ev = evaluate.evaluate_site(site, state, kernels, compute_dtype, eval_config(config))
  entry = {"kind": site.kind, "spec": site.spec,
           "shapes": {k: list(v) for k, v in site.layout.shapes().items()},
           "stats": stats_report.site_stats(site, state, observations),
           "passes": summarize.site_passes(ev, [k.name for k in kernels],
                                           n_boot=config.bootstrap, seed=config.seed)}
  stats_report.underflow_from_stats(entry, kernels_info, site.layout)
  return entry


def reevaluated_entry(report: Mapping, name: str, site: collector_lib.SiteProbe, state,
                      config, kernels: Optional[Sequence[str]] = None
                      ) -> Dict[str, Any]:
  """The report entry of site `name` re-evaluated on fresh statistics `state` (one
  observation): the errors of `kernels` (default: every candidate the report evaluated
  there), the report's timings (speed does not drift)."""
  old = report["sites"][name]
  names = candidates(report, name)
  if kernels is not None:
    names = [k for k in names if k in set(kernels)]
  fresh = site_entry(site, state, names, compute_dtype(report), config, 1,
                     report.get("kernels") or {})
  for p, per_kernel in fresh["passes"].items():
    for k, e in per_kernel.items():
      before = old.get("passes", {}).get(p, {}).get(k, {})
      e.update({f: before[f] for f in TIMING_FIELDS if f in before})
  return {**old, "passes": fresh["passes"], "stats": fresh["stats"]}
