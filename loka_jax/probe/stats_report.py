"""Site statistics -> the JSON summaries of a ProbeReport (host side).

Per operand: the covariance model and its numbers (gaussian.summary / matrix_normal.summary),
underflow fractions per use (pass), format and granularity (mean and worst over
observations), amax and delayed-scaling saturation, and a histogram of log10|x| of real
values (reservoir slices; the latest weight snapshot for weights) that the plots draw.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np

from loka_jax.kernels import ACT_WEIGHT
from loka_jax.probe import flush as flush_lib
from loka_jax.probe import gaussian, matrix_normal
from loka_jax.probe.collector import SiteProbe
from loka_jax.probe.layout import OPERANDS, PASS_AXES

HIST_LO, HIST_HI, HIST_STEP = -12.0, 8.0, 0.25


def histogram(values: np.ndarray) -> Dict:
  """Counts of log10|x| in fixed bins [HIST_LO, HIST_HI) (values outside are clipped in)."""
  x = np.abs(np.asarray(values, np.float64).ravel())
  x = x[np.isfinite(x)]
  nonzero = x[x > 0]
  edges = np.arange(HIST_LO, HIST_HI + HIST_STEP / 2, HIST_STEP)
  logs = np.clip(np.log10(nonzero), HIST_LO, HIST_HI - 1e-9) if nonzero.size else nonzero
  counts, _ = np.histogram(logs, bins=edges)
  return {"log10_lo": HIST_LO, "log10_hi": HIST_HI, "step": HIST_STEP,
          "counts": [int(c) for c in counts], "zeros": int(x.size - nonzero.size),
          "total": int(x.size)}


def _flush_summary(acc: Mapping, observations: int, op: str) -> Dict:
  uses = list(PASS_AXES[op])
  total = np.asarray(acc["sum"]) / max(observations, 1)
  worst = np.asarray(acc["max"])
  return {use: {"mean": flush_lib.as_dict(total[i]), "max": flush_lib.as_dict(worst[i])}
          for i, use in enumerate(uses)}


def _amax_summary(acc: Mapping, observations: int) -> Dict:
  return {"last": float(acc["last"]), "max": float(acc["max"]),
          "delayed_saturation_mean": float(acc["saturation_sum"]) / max(observations - 1, 1),
          "delayed_saturation_max": float(acc["saturation_max"]),
          "growth_max": float(acc["growth_max"])}


def site_stats(site: SiteProbe, state: Mapping, observations: int,
               detail: bool = True) -> Dict:
  """The `stats` object of one site in the report. `detail` False leaves out what the drift
  check does not read: the covariance spectra (host and device eigendecompositions, most of
  the time a refresh of the drift valve spent here) and the histograms."""
  out: Dict = {"observations": observations}
  for op in OPERANDS:
    mode = site.modes[op].describe()
    if op == "rhs" and site.kind == ACT_WEIGHT:
      numbers = matrix_normal.summary(state["rhs"], spectrum=detail)
      values = np.asarray(state["weight"], np.float32)
    else:
      numbers = gaussian.summary(state[op], spectrum=detail)
      values = (np.asarray(state["reservoir"][op]) if "reservoir" in state
                and op in state["reservoir"] else None)
    entry = {**mode, **numbers,
             "flush": _flush_summary(state["flush"][op], observations, op),
             "amax": _amax_summary(state["amax"][op], observations)}
    if values is not None and detail:
      entry["histogram"] = histogram(values)
    out[op] = entry
  if "reservoir" in state:
    seen = int(state["reservoir"]["seen"])
    out["reservoir"] = {"capacity": site.reservoir_capacity, "seen": seen,
                        "slice_index": site.layout.slice_label,
                        "filled": min(seen, site.reservoir_capacity)}
  else:
    out["reservoir"] = {"capacity": 0, "reason": site.layout.slice_reason}
  return out


def stats_underflow(stats: Mapping, operand: str, pass_name: str, fmt: str,
                    granularity: str) -> Optional[list]:
  """[mean, mean, worst] underflow over observations for one operand use, from the report's
  site stats (None when that use or granularity was not recorded)."""
  try:
    use = stats[operand]["flush"][pass_name]
    mean, worst = use["mean"][fmt][granularity], use["max"][fmt][granularity]
  except KeyError:
    return None
  return [mean, mean, max(mean, worst)]


def underflow_from_stats(site_entry: Dict, kernels_info: Mapping, layout) -> None:
  """Fills a report entry's underflow from its statistics for the FP8 kernels that do not
  expose their quantized operands (e.g. Flax's delayed-scaling op); an entry without
  statistics has none to fill from."""
  stats = site_entry.get("stats") or {}
  for p, kernels in site_entry["passes"].items():
    for k, e in kernels.items():
      info = kernels_info.get(k, {})
      if (not info.get("fp8") or e.get("operands") or e.get("unsupported")
          or e.get("sqnr_db") is None):
        continue
      gran = info.get("granularity")
      if gran is None:
        continue
      operands = {}
      for name in layout.pass_operands(p):
        fmt = "e5m2" if name == "grad" else "e4m3"
        u = stats_underflow(stats, name, p, fmt, gran)
        if u is not None:
          operands[name] = {"underflow": u, "saturation": None}
      if operands:
        e["operands"] = operands
        e["underflow"] = [max(o["underflow"][i] for o in operands.values()) for i in range(3)]
        e["underflow_source"] = f"stats ({gran})"
