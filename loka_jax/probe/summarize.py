"""Per-sample metrics -> report entries: bootstrap 95% CIs, sources combined pessimistically.

Every metric becomes `[lo, mid, hi]`: the mean over samples and the 2.5% / 97.5% percentiles
of bootstrap means. Non-finite samples never become numbers: the metric is null and the entry
gets an `error` string. The entry of a pass keeps both sources and reports, at top level,
  fwd, grad_lhs   the source with the lower pessimistic SQNR (the harder one);
  grad_rhs        the reservoir (real paired x and g rows: wgrad's error depends on their
                  correlation, which independent Gaussian draws destroy), else the Gaussian
                  draws, marked `"pairing": "independent"`.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from loka_jax.precision.metrics import SQNR_CAP_DB
from loka_jax.probe.evaluate import GAUSSIAN, METRICS, RESERVOIR, SOURCES, SiteEvaluation

OPERAND_FIELDS = (("underflow_a", "saturation_a"), ("underflow_b", "saturation_b"))


def bootstrap_ci(values: np.ndarray, rng: np.random.Generator, n_boot: int = 1000
                 ) -> Optional[List[float]]:
  """[lo, mean, hi] of the mean (95% percentile bootstrap); None if any value is NaN."""
  values = np.asarray(values, np.float64)
  if values.size == 0 or np.isnan(values).any():
    return None
  values = np.clip(values, -SQNR_CAP_DB, SQNR_CAP_DB) if np.isinf(values).any() else values
  if values.size == 1:
    v = float(values[0])
    return [v, v, v]
  idx = rng.integers(0, values.size, size=(n_boot, values.size))
  means = values[idx].mean(axis=1)
  return [float(np.percentile(means, 2.5)), float(values.mean()),
          float(np.percentile(means, 97.5))]


def _ci_or_none(values, rng, n_boot):
  """A CI when the values are measurable (not all NaN), else None (not an error)."""
  values = np.asarray(values, np.float64)
  if values.size == 0 or np.isnan(values).all():
    return None
  return bootstrap_ci(values, rng, n_boot)


def source_entry(metrics: Mapping[str, np.ndarray], operand_names: Sequence[str],
                 rng: np.random.Generator, n_boot: int) -> Dict:
  """One kernel, one pass, one source."""
  entry: Dict = {"samples": int(len(metrics["sqnr_db"]))}
  problems = []
  finite = np.asarray(metrics["finite"], bool)
  if not finite.all():
    problems.append(f"{int((~finite).sum())} of {finite.size} samples gave non-finite outputs")
  for m in METRICS:
    entry[m] = bootstrap_ci(metrics[m], rng, n_boot)
    if entry[m] is None and not problems:
      problems.append(f"non-finite {m}")
  operands = {}
  worst_underflow = None
  for name, (uf, sat) in zip(operand_names, OPERAND_FIELDS):
    u = _ci_or_none(metrics[uf], rng, n_boot)
    s = _ci_or_none(metrics[sat], rng, n_boot)
    if u is not None or s is not None:
      operands[name] = {"underflow": u, "saturation": s}
  if operands:
    per_sample = np.nanmax(np.stack([np.asarray(metrics[uf], np.float64)
                                     for uf, _ in OPERAND_FIELDS]), axis=0)
    worst_underflow = _ci_or_none(per_sample, rng, n_boot)
  entry["underflow"] = worst_underflow
  entry["operands"] = operands
  entry["error"] = "; ".join(problems) if problems else None
  return entry


def _pessimistic_sqnr(entry) -> float:
  v = entry.get("sqnr_db")
  return -np.inf if v is None else v[0]


def combine_sources(pass_name: str, by_source: Mapping[str, Dict]) -> Dict:
  """The pass's top-level entry from its per-source entries (see module docstring)."""
  if pass_name == "grad_rhs":
    if RESERVOIR in by_source:
      chosen, extra = RESERVOIR, {"pairing": "reservoir"}
    else:
      chosen, extra = GAUSSIAN, {"pairing": "independent"}
  else:
    chosen = min(by_source, key=lambda s: (_pessimistic_sqnr(by_source[s]), SOURCES.index(s)))
    extra = {}
  top = {k: v for k, v in by_source[chosen].items()}
  top.update(extra)
  top["source"] = chosen
  top["sources"] = {s: dict(e) for s, e in by_source.items()}
  return top


def site_passes(evaluation: SiteEvaluation, kernels: Sequence[str], n_boot: int = 1000,
                seed: int = 0) -> Dict[str, Dict[str, Dict]]:
  """{pass: {kernel: entry}} of one site (unsupported kernels get an `error` entry). Each
  (pass, kernel) bootstraps from its own generator, so its entry is the same whichever other
  kernels are summarized beside it (the drift valve evaluates a subset first)."""
  layout = evaluation.layout
  out: Dict[str, Dict[str, Dict]] = {}
  for p in ("fwd", "grad_lhs", "grad_rhs"):
    names = layout.pass_operands(p)
    per_kernel: Dict[str, Dict] = {}
    for k in kernels:
      if k in evaluation.errors:
        per_kernel[k] = _error_entry(f"kernel failed: {evaluation.errors[k]}")
        continue
      if k in evaluation.unsupported.get(p, {}):
        per_kernel[k] = _error_entry(f"unsupported: {evaluation.unsupported[p][k]}",
                                     unsupported=True)
        continue
      rng = np.random.default_rng([seed, zlib.crc32(f"{p}/{k}".encode())])
      by_source = {s: source_entry(evaluation.results[s][p][k], names, rng, n_boot)
                   for s in SOURCES
                   if k in evaluation.results.get(s, {}).get(p, {})}
      if by_source:
        per_kernel[k] = combine_sources(p, by_source)
    if per_kernel:
      out[p] = per_kernel
  return out


def _error_entry(message: str, unsupported: bool = False) -> Dict:
  entry = {m: None for m in METRICS}
  entry.update(underflow=None, operands={}, error=message)
  if unsupported:
    entry["unsupported"] = True
  return entry
