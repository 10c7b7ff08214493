"""PNG plots of a ProbeReport (matplotlib, Agg): drawn from the report alone.

  heatmap_error.png     sites x kernels, pessimistic SQNR (dB) per pass
  heatmap_speedup.png   sites x kernels, median speedup vs xla_bf16 per pass (when timed;
                        titled 'estimated' when the numbers come from a timing table)
  site_speedup.png      per site: the best whole-site speedup any kernel reaches over
                        xla_bf16 (every pass, pessimistic) against the site's GFLOP, with the
                        selection's bar: where FP8 can pay on this model at all (when timed)
  sites/<site>.png      per site: covariance spectrum, log10|x| histograms of real values,
                        underflow per granularity (e4m3 for inputs/weights, e5m2 for grads)
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Mapping, Optional

import numpy as np

from loka_jax import figures
from loka_jax.kernels import PASSES
from loka_jax.probe import eligibility
from loka_jax.probe import flush as flush_lib
from loka_jax.probe.candidates import BASELINE

PASS_LABELS = {"fwd": "fwd", "grad_lhs": "dgrad", "grad_rhs": "wgrad"}


def safe_name(site: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", site).strip("_") or "site"


def _matrix(report: Mapping, field: str, pick) -> Dict[str, np.ndarray]:
  sites = list(report["sites"])
  kernels = sorted({k for s in report["sites"].values() for p in s["passes"].values()
                    for k in p})
  out = {}
  for p in PASSES:
    m = np.full((len(sites), len(kernels)), np.nan)
    for i, s in enumerate(sites):
      for j, k in enumerate(kernels):
        v = report["sites"][s]["passes"].get(p, {}).get(k, {}).get(field)
        if v is not None:
          m[i, j] = pick(v)
    out[p] = m
  return {"sites": sites, "kernels": kernels, **out}


def _heatmap(data, title: str, cmap: str, path: str, vmin=None, vmax=None, fmt="{:.0f}",
             center: Optional[float] = None) -> str:
  sites, kernels = data["sites"], data["kernels"]
  height = max(3.0, 0.28 * len(sites) + 1.8)
  fig, axes = figures.subplots(1, 3, figsize=(3.2 + 1.1 * len(kernels) * 1.4, height),
                               sharey=True, squeeze=False)
  for ax, p in zip(axes[0], PASSES):
    m = data[p]
    if center is not None and np.isfinite(m).any():
      span = np.nanmax(np.abs(m - center))
      vmin, vmax = center - span, center + span
    im = ax.imshow(m, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set_title(PASS_LABELS[p])
    ax.set_xticks(range(len(kernels)))
    ax.set_xticklabels(kernels, rotation=70, ha="right", fontsize=7)
    ax.set_yticks(range(len(sites)))
    ax.set_yticklabels(sites, fontsize=7)
    if len(sites) * len(kernels) <= 600:
      for i in range(m.shape[0]):
        for j in range(m.shape[1]):
          if np.isfinite(m[i, j]):
            ax.text(j, i, fmt.format(m[i, j]), ha="center", va="center", fontsize=5.5)
  fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
  fig.suptitle(title, fontsize=10, y=1.04)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  return path


def error_heatmap(report: Mapping, path: str) -> str:
  data = _matrix(report, "sqnr_db", lambda v: v[0])
  return _heatmap(data, f"{report['model']} {report['preset']}: pessimistic SQNR (dB) vs "
                  "fp32 HIGHEST on the original operands", "viridis", path, vmin=0, vmax=60)


def speedup_heatmap(report: Mapping, path: str) -> Optional[str]:
  data = _matrix(report, "speedup", lambda v: v[1])
  if not any(np.isfinite(data[p]).any() for p in PASSES):
    return None
  note = "" if report["timing_valid"] else " (ESTIMATED from a timing table: not this device)"
  return _heatmap(data, f"{report['model']} {report['preset']} on {report['device']}: speedup "
                  f"vs xla_bf16{note}", "RdYlGn", path, fmt="{:.2f}", center=1.0)


def best_site_speedups(report: Mapping) -> Dict[str, tuple]:
  """{site: (best whole-site speedup over xla_bf16, its kernel)} of every site where some
  kernel is timed in every pass. A site's speedup is `eligibility.site_times`': its passes'
  baseline times at the medians over the kernel's at each pass's CI low end (a fused op's
  backward timed once counted once), the measure the selection holds fused ops to. Speed
  only: the accuracy check may still rule the kernel out."""
  out = {}
  for name, site in report["sites"].items():
    kernels = {k for p in site.get("passes", {}).values() for k in p} - {BASELINE}
    best = None
    for k in sorted(kernels):
      times = eligibility.site_times(site["passes"], k)
      if times and times[1] > 0 and (best is None or times[0] / times[1] > best[0]):
        best = (times[0] / times[1], k)
    if best is not None:
      out[name] = best
  return out


def site_speedup_plot(report: Mapping, path: str) -> Optional[str]:
  """Each timed site's best whole-site speedup (`best_site_speedups`) against its GFLOP, one
  colour per kernel, the selection's bar drawn across; the five fastest sites named. None
  when no site is timed in every pass."""
  best = best_site_speedups(report)
  if not best:
    return None
  bar = ((report.get("criteria") or {}).get("min_speedup")
         or eligibility.Criteria().min_speedup)
  kernels = sorted({k for _, k in best.values()})
  fig, ax = figures.subplots(figsize=(7.5, 4.2))
  for i, k in enumerate(kernels):
    names = [n for n, (_, kk) in best.items() if kk == k]
    ax.scatter([report["sites"][n]["flops"] / 1e9 for n in names], [best[n][0] for n in names],
               s=18, color=f"C{i % 10}", label=k, alpha=0.8)
  points: Dict[tuple, List[str]] = {}  # repeated layers share a shape and so a point
  for name in best:
    points.setdefault((report["sites"][name]["flops"], round(best[name][0], 4)), []).append(name)
  for (flops, speedup), names in sorted(points.items(), key=lambda kv: -kv[0][1])[:5]:
    more = f" (+{len(names) - 1} alike)" if len(names) > 1 else ""
    ax.annotate(names[0] + more, (flops / 1e9, speedup), fontsize=6, xytext=(3, 3),
                textcoords="offset points")
  ax.axhline(bar, color="k", lw=0.8, label=f"selection bar {bar:g}x")
  ax.axhline(1.0, color="0.6", lw=0.8, ls=":", label="bf16 (1.0x; below: slower)")
  ax.set_xscale("log")
  ax.set_xlabel("site GFLOP per step (forward)")
  ax.set_ylabel("best whole-site speedup over xla_bf16")
  note = "" if report.get("timing_valid", True) else " (ESTIMATED from a timing table)"
  ax.set_title(f"{report['model']} {report['preset']} on {report['device']}: best kernel per "
               f"site, every pass, pessimistic{note}\n{len(best)} of {len(report['sites'])} "
               "sites timed in every pass", fontsize=8)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def _hist_curve(ax, hist: Mapping, label: str):
  counts = np.asarray(hist["counts"], np.float64)
  if counts.sum() <= 0:
    return
  edges = np.arange(hist["log10_lo"], hist["log10_hi"] + hist["step"] / 2, hist["step"])
  centers = 0.5 * (edges[:-1] + edges[1:])
  ax.step(centers, counts / max(hist["total"], 1), where="mid", label=label)


def site_plot(report: Mapping, site: str, path: str) -> str:
  entry = report["sites"][site]
  stats = entry.get("stats", {})
  fig, axes = figures.subplots(1, 3, figsize=(14, 3.6))
  ax = axes[0]
  for op in ("lhs", "rhs", "grad"):
    spec = stats.get(op, {}).get("spectrum") or stats.get(op, {}).get("col_cov_spectrum")
    if spec:
      vals = np.maximum(np.asarray(spec, np.float64), 1e-30)
      ax.semilogy(np.arange(1, len(vals) + 1), vals, marker=".", label=op)
  ax.set_title("covariance spectrum (top eigenvalues)")
  ax.set_xlabel("rank")
  ax.legend(fontsize=7)
  ax = axes[1]
  for op in ("lhs", "rhs", "grad"):
    hist = stats.get(op, {}).get("histogram")
    if hist:
      _hist_curve(ax, hist, op)
  ax.set_title("log10 |x| of real values")
  ax.set_xlabel("log10 |x|")
  ax.legend(fontsize=7)
  ax = axes[2]
  _, grans = flush_lib.names()
  width = 0.25
  for i, (op, use, fmt) in enumerate((("lhs", "fwd", "e4m3"), ("rhs", "fwd", "e4m3"),
                                      ("grad", "grad_lhs", "e5m2"))):
    flush = stats.get(op, {}).get("flush", {}).get(use)
    if not flush:
      continue
    vals = [flush["max"][fmt][g] for g in grans]
    ax.bar(np.arange(len(grans)) + (i - 1) * width, vals, width,
           label=f"{op} ({PASS_LABELS[use]}, {fmt})")
  ax.set_xticks(range(len(grans)))
  ax.set_xticklabels(grans, fontsize=7)
  ax.set_ylim(0, 1)
  ax.axhline(0.01, color="k", lw=0.6, ls="--")
  ax.set_title("underflow (worst observation) per granularity")
  ax.legend(fontsize=7)
  fig.suptitle(f"{site} ({entry['kind']}, {entry['spec']})", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  return path


def write_plots(report: Mapping, directory: str, sites: bool = True) -> List[str]:
  """Writes every plot; returns the paths."""
  os.makedirs(directory, exist_ok=True)
  paths = [error_heatmap(report, os.path.join(directory, "heatmap_error.png"))]
  for plot, name in ((speedup_heatmap, "heatmap_speedup.png"),
                     (site_speedup_plot, "site_speedup.png")):
    written = plot(report, os.path.join(directory, name))
    if written:
      paths.append(written)
  if sites:
    site_dir = os.path.join(directory, "sites")
    os.makedirs(site_dir, exist_ok=True)
    for name in report["sites"]:
      paths.append(site_plot(report, name, os.path.join(site_dir, safe_name(name) + ".png")))
  return paths
