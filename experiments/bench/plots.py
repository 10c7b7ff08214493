"""PNG plots of the benchmark rows (speedup per variant per target, paired quality verdicts), of
the quality runs' and shadow runs' training curves and of step profiles (where each step's
device time goes)."""
from __future__ import annotations

import os
import re
from typing import Any, Callable, List, Mapping, Optional, Sequence

import matplotlib
import numpy as np
from matplotlib.lines import Line2D

from experiments.bench import quality as quality_lib
from experiments.bench.mods_set import row_subject
from experiments.bench.variants import LABELS, VARIANTS
from loka_jax import figures


def variant_color(variant: str) -> str:
  """A fixed colour per variant, the same in every plot; LoKA, the subject, in black.

  Matplotlib's default cycle has ten colours and the suites have more variants: past ten,
  the lighter shades of the tab20 palette (C0..C9 are tab20's darker ones).
  """
  if variant == "loka":
    return "k"
  names = [v for v in VARIANTS if v != "loka"]
  if variant not in names:
    return "0.5"
  i = names.index(variant)
  if i < 10:
    return f"C{i}"
  return matplotlib.colors.to_hex(matplotlib.colormaps["tab20"](2 * (i - 10) + 1))


def tick_label(subject: str, width: int = 36) -> str:
  """`subject` on lines of about `width` characters, broken after a space or a '+': a Mods
  set's label (`dcnv2/large (Mods no_bias+blocknorm+hard_swish+keep_bias:...)`) would
  otherwise run across its neighbours' ticks."""
  lines = [""]
  for piece in re.split(r"(?<=[ +])", subject):
    if lines[-1] and len(lines[-1]) + len(piece.rstrip()) > width:
      lines.append("")
    lines[-1] += piece
  return "\n".join(line.rstrip() for line in lines)


def speedup_plot(rows: Sequence[Mapping], suite: str, path: str) -> str:
  """Grouped bars: train and inference speedup vs bf16 (with 95% CI) per variant per target."""
  rows = [r for r in rows if r.get("suite") == suite and "train" in r and "error" not in r]
  # A target with its bf16 row alone has nothing to compare yet: no empty group for it.
  measured = {row_subject(r) for r in rows if r["variant"] != "bf16"}
  targets = sorted(measured or {row_subject(r) for r in rows})
  variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
  by = {(row_subject(r), r["variant"]): r for r in rows}
  # Wide enough to tell the bars apart, not so wide that a page shrinks it past reading.
  width_in = min(16, max(6, 1.4 * len(targets) * max(len(variants), 1) / 3))
  fig, axes = figures.subplots(2, 1, figsize=(width_in, 7), squeeze=False)
  width = 0.8 / max(len(variants), 1)
  x = np.arange(len(targets))
  for ax, mode in zip(axes[:, 0], ("train", "infer")):
    for j, v in enumerate(variants):
      vals, lo, hi = [], [], []
      for t in targets:
        s = by.get((t, v), {}).get(mode)
        vals.append(np.nan if s is None else s["speedup"])
        # A ratio of medians can fall just outside its bootstrap interval: no negative bars.
        lo.append(0 if s is None else max(0.0, s["speedup"] - s["speedup_ci"][0]))
        hi.append(0 if s is None else max(0.0, s["speedup_ci"][1] - s["speedup"]))
      ax.bar(x + (j - (len(variants) - 1) / 2) * width, vals, width, yerr=[lo, hi],
             label=LABELS.get(v, v), color=variant_color(v), ecolor="0.45", capsize=2)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels([tick_label(t) for t in targets], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"{mode} speedup vs bf16")
  # Below the axes: inside them the legend hides the bars of the first targets.
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", fontsize=7, ncol=min(len(labels), 5))
  axes[0, 0].set_title(f"{suite}: speedup vs bf16 of the same run (95% CI)")
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=110)
  return path


# A fixed colour per quality arm, the same in the loss gap and the training curves.
ARM_COLORS = {"bf16": "0.45", "bf16_mods": "C0", "fp8_naive": "C1", "fp8_delayed": "C2",
              "loka": "C3", "fp8_naive_mods": "C4", "loka_accuracy": "C5"}


# Marker of each paired verdict in `paired_quality_plot`.
VERDICT_MARKERS = {"met": "o", "missed": "X", "unresolved": "s", "not applicable": "D"}


def _short_subject(subject: str, width: int = 24) -> str:
  """A quality subject for a tick label: synthetic data unnamed, a long Mods set cut."""
  subject = subject.removeprefix("synthetic:")
  head, sep, mods = subject.partition("(Mods ")
  return head + (sep + (mods if len(mods) <= width else mods[:width - 3] + "...)")
                 if sep else "")


def paired_quality_plot(verdicts: Sequence[Mapping], path: str) -> Optional[str]:
  """One panel per reference (bf16+Mods, bf16), one line per subject and judged arm: each
  seed's paired relative change of held-out log loss (dots), their mean with its 95% CI
  (marker by verdict; one seed: no interval) and the +0.02% margin. The x axis is symlog,
  linear within +-0.1%, so the margin and the seeds' spread both read. None without a
  paired quality verdict."""
  from experiments.bench import quality_pairs
  from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS
  quality = [v for v in verdicts if v.get("mode") == "quality" and "changes" in v]
  if not quality:
    return None
  references = [r for r in ("bf16_mods", "bf16")
                if any(v["target"].endswith("_vs_" + r) for v in quality)]
  lines = list(dict.fromkeys((v["subject"], v["target"].split("_quality_vs_")[0])
                             for v in quality))
  fig, axes = figures.subplots(1, len(references), figsize=(5.2 * len(references) + 2.2,
                                                             1.3 + 0.2 * len(lines)),
                               sharey=True, squeeze=False)
  margin = 100 * NEUTRAL_REL_LOGLOSS
  ends = [100 * x for v in quality for x in v["changes"] + list(v["ci"] or [])]
  limit = 1.6 * max([abs(x) for x in ends] + [1.0])
  for ax, reference in zip(axes[0], references):
    mine = {(v["subject"], v["target"].split("_quality_vs_")[0]): v for v in quality
            if v["target"].endswith("_vs_" + reference)}
    for y, key in enumerate(lines):
      v = mine.get(key)
      if v is None:
        continue
      color = ARM_COLORS.get(key[1], "0.5")
      changes = 100 * np.asarray(v["changes"], float)
      ax.plot(changes, np.full(len(changes), y + 0.18), ".", color=color, ms=3, alpha=0.7)
      if v["value"] is None:
        continue
      mean = 100 * v["value"]
      err = None if v["ci"] is None else [[mean - 100 * v["ci"][0]], [100 * v["ci"][1] - mean]]
      ax.errorbar([mean], [y], xerr=err, fmt=VERDICT_MARKERS.get(v["verdict"], "o"),
                  color=color, ms=4.5, elinewidth=1.0, capsize=2,
                  mfc=color if v["verdict"] == "met" else "white")
    ax.axvline(0.0, color="0.6", lw=0.6)
    ax.axvline(margin, color="r", ls="--", lw=0.9)
    ax.set_xscale("symlog", linthresh=0.1, linscale=1.0)
    ax.set_xlim(-limit, limit)
    ax.set_xlabel("paired change of held-out log loss vs "
                  f"{quality_pairs.LABELS.get(reference, reference)} (%)",
                  fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", color="0.9", lw=0.5)
  axes[0][0].set_yticks(range(len(lines)))
  axes[0][0].set_yticklabels([f"{_short_subject(s)} | {quality_pairs.LABELS.get(a, a)}"
                              for s, a in lines],
                             fontsize=6.5)
  axes[0][0].set_ylim(len(lines) - 0.5, -0.5)   # the first subject on top, as in the tables
  handles = [Line2D([], [], color=c, lw=0, marker="s", label=quality_pairs.LABELS.get(a, a))
             for a, c in ARM_COLORS.items() if any(k[1] == a for k in lines)]
  handles += [Line2D([], [], color="k", lw=0, marker=m, mfc="k" if w == "met" else "white",
                     label=f"mean, 95% CI: {w}") for w, m in VERDICT_MARKERS.items()]
  handles += [Line2D([], [], color="k", lw=0, marker=".", label="one seed"),
              Line2D([], [], color="r", ls="--", label=f"+{margin:g}% margin")]
  fig.legend(handles=handles, loc="lower center", fontsize=7, ncol=5)
  fig.suptitle("Quality, paired by seed: (arm - reference) / reference of held-out log loss",
               fontsize=9)
  fig.tight_layout(rect=(0, 0.55 / (1.3 + 0.2 * len(lines)), 1, 1))
  fig.savefig(path, dpi=90)
  return path


def training_curves_plot(rows: Sequence[Mapping], runs_roots: Sequence[str],
                         comparison: "quality_lib.Comparison", path: str) -> Optional[str]:
  """One panel per seed: each arm's logged training loss over the steps (solid: the mean of
  each logged window; dotted: its worst step, where logged), on a log scale so a spike and
  the converged loss both read. The mean over seeds, which the verdicts compare, can rest on
  one seed's spike (DCNv2 `large` on an H200).
  Each run is read from the first of `runs_roots` (quality suites' run folders) that holds
  it; None when none holds a run of the comparison."""
  curves = quality_lib.run_curves(rows, runs_roots, comparison)
  if not curves:
    return None
  seeds = sorted(curves)
  fig, axes = figures.subplots(1, len(seeds), figsize=(4.2 * len(seeds), 3.4), sharey=True,
                               squeeze=False)
  for ax, seed in zip(axes[0], seeds):
    for arm in (a for a in quality_lib.ARMS if a in curves[seed]):
      c = curves[seed][arm]
      color = ARM_COLORS[arm]
      ax.plot(c["step"], c["loss"], color=color, lw=1.4, label=arm)
      worst = [(s, m) for s, m in zip(c["step"], c["max_loss"]) if m is not None]
      if worst:
        ax.plot(*zip(*worst), color=color, lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_title(f"seed {seed}", fontsize=9)
    ax.set_xlabel("step")
  axes[0][0].set_ylabel("training loss (log scale)")
  handles = {}  # every arm drawn in any panel, once
  for ax in axes[0]:
    handles.update(zip(*reversed(ax.get_legend_handles_labels())))
  axes[0][-1].legend(list(handles.values()), list(handles), fontsize=7)
  fig.suptitle(f"Training curves: {comparison.subject} (solid: window mean; dotted: its "
               "worst step)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def shadow_curves_plot(curves: Mapping[tuple, Sequence[Optional[float]]], every: int,
                       from_step: int, path: str, title: str = "",
                       panel_title: Callable[[Any], str] = "window {}".format,
                       xlabel: str = "step") -> str:
  """One panel per data window (or seed): each arm's training loss from its start, one point
  per block of `every` steps at the block's last step (`curves`: {(arm, panel): the runs'
  `loss_curve`}; None, a block with a non-finite step, is a gap). A run's last steps alone
  cannot tell one still on a plateau from one that never learns; the curve shows when it
  left (Wukong `large` on an H200)."""
  windows = sorted({w for _, w in curves})
  arms = list(dict.fromkeys(arm for arm, _ in curves))   # one colour per arm in every panel
  fig, axes = figures.subplots(1, len(windows), figsize=(4.6 * len(windows), 3.4), sharey=True,
                               squeeze=False)
  for ax, window in zip(axes[0], windows):
    for (arm, w), curve in curves.items():
      if w != window:
        continue
      steps = from_step + every * np.arange(1, len(curve) + 1)
      loss = np.array([np.nan if x is None else x for x in curve], float)
      color = "k" if arm == "bf16_mods" else f"C{arms.index(arm) % 10}"
      ax.plot(steps, loss, marker=".", lw=1.3, color=color, label=arm)
    ax.set_title(panel_title(window), fontsize=9)
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel(f"training loss (mean of {every} steps)")
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def curves_file_name(comparison: "quality_lib.Comparison") -> str:
  """`curves_<subject>.png`, the subject made safe for a file name."""
  return "curves_" + re.sub(r"[^A-Za-z0-9]+", "_", comparison.subject).strip("_") + ".png"


def profile_plot(profiles: Mapping[str, Mapping], path: str, title: str = "") -> str:
  """Stacked bars, one per profiled step: its device time split into the GEMM sites'
  forward and backward and the largest scopes outside the sites (`profile.step_parts`)."""
  from experiments.bench.profile import step_parts
  labels, parts = step_parts(profiles)
  names = list(parts)
  legend_rows = -(-len(labels) // 4)
  height_in = 1.4 + 0.45 * len(names) + 0.2 * legend_rows
  fig, ax = figures.subplots(figsize=(9, height_in))
  left = np.zeros(len(names))
  colors = ["#1f77b4", "#aec7e8", "C2", "C3", "C4", "C5", "0.75"]
  for i, label in enumerate(labels):
    widths = np.array([parts[n][i] for n in names]) / 1000.0
    ax.barh(names, widths, left=left, label=label,
            color=colors[i] if i < len(colors) - 1 and i < len(labels) - 1 else colors[-1])
    left += widths
  for y, total in enumerate(left):
    ax.text(total, y, f" {total:.2f} ms", va="center", fontsize=7)
  ax.invert_yaxis()  # the first profile on top, as in the tables
  ax.set_xlabel("device time per step (ms)")
  ax.set_title(title or "Where each step's device time goes")
  ax.set_xlim(0, max(left.max(), 1e-3) * 1.15)
  # Below the axes: inside them the legend hides the bars.
  fig.legend(*ax.get_legend_handles_labels(), loc="lower center", fontsize=7,
             ncol=min(len(labels), 4))
  fig.tight_layout(rect=(0, (0.1 + 0.2 * legend_rows) / height_in, 1, 1))
  fig.savefig(path, dpi=110)
  return path


def write_plots(rows: Sequence[Mapping], out_dir: str,
                quality_runs: Sequence[str] = ()) -> List[str]:
  """Every plot the rows can fill, under `out_dir`; returns the paths written. With
  `quality_runs` (quality suites' run folders), also each comparison's training curves from
  the runs found there."""
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for suite in ("towers", "models"):
    if any(r.get("suite") == suite and "train" in r for r in rows):
      paths.append(speedup_plot(rows, suite, os.path.join(out_dir, f"speedup_{suite}.png")))
  from experiments.bench import targets   # the verdicts the plot draws
  path = paired_quality_plot(targets.check_quality(rows),
                             os.path.join(out_dir, "quality_paired.png"))
  if path:
    paths.append(path)
  if quality_runs:
    for c in quality_lib.comparisons(rows):
      path = training_curves_plot(rows, quality_runs, c,
                                  os.path.join(out_dir, curves_file_name(c)))
      if path:
        paths.append(path)
  return paths
