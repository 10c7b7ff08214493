"""The Mods ablation's report: the loka.ablation/1 dict from the arms' results and timing rows
(`summarize`), its markdown table, plot and reading, and the files they go to.

A loss change is neutral when |delta log loss| <= max(0.02% relative, 2 x the bf16
seed-to-seed std), the std from the config's `noise_seeds` (extra bf16 baseline arms with
other seeds; without them only the relative bound applies).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import jax
import numpy as np

from loka_jax.models.presets import get_config
from loka_jax.train.ablation_arms import (AblationConfig, Arm, arms, combination_key,
                                         combination_label, timing_enabled)
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

SCHEMA = "loka.ablation/1"


def write_json(path: str, value) -> None:
  """`value` as indented JSON with sorted keys, written to a temporary file and renamed."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def _finite(value) -> Optional[float]:
  return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _delta(new: Optional[float], ref: Optional[float], tolerance: Optional[float]):
  """{"abs", "rel", "verdict"} of new - ref in log loss (lower is better)."""
  if new is None or ref is None:
    return None
  delta = new - ref
  verdict = ("neutral" if abs(delta) <= tolerance else "worse" if delta > 0 else "better")
  return {"abs": delta, "rel": delta / ref if ref else None, "verdict": verdict}


def summarize(config: AblationConfig, finals: Mapping[str, Optional[Mapping[str, Any]]],
              timing_rows: Sequence[Mapping[str, Any]], device: str) -> Dict[str, Any]:
  """The loka.ablation/1 dict from per-arm final.json dicts (None: not run yet) and timing rows.

  Keys: settings, device, timing ("measured" | "smoke (not on a GPU)" | "skipped (...)"),
  noise (bf16 baseline seeds: logloss values, std, tolerance), rows (one per combination:
  per precision ne/logloss/auc and, where timed, train/infer median_ms and speedup vs the
  bf16 baseline with its CI; deltas fp8_vs_bf16, mods_vs_baseline, fp8_mods_vs_baseline),
  complete, pending.
  """
  def arm(mods, precision, seed=config.seed):
    return finals.get(Arm(mods, precision, seed).name)

  base = arm((), "bf16")
  base_ll = _finite((base or {}).get("logloss"))
  seeds = [config.seed] + list(config.noise_seeds)
  seed_ll = [_finite((arm((), "bf16", s) or {}).get("logloss")) for s in seeds]
  seed_ll = [v for v in seed_ll if v is not None]
  std = float(np.std(seed_ll, ddof=1)) if len(seed_ll) >= 2 else None
  tolerance = None
  if base_ll is not None:
    tolerance = max(NEUTRAL_REL_LOGLOSS * abs(base_ll), 2 * std if std is not None else 0.0)

  timed = {r["combination"]: r for r in timing_rows}
  if timed and not all(r.get("gpu") for r in timed.values()):
    timing_note = "smoke (not on a GPU: these timings are not results)"
  elif timed:
    timing_note = "measured"
  elif timing_enabled(config):
    timing_note = "pending"
  else:
    timing_note = ("skipped (not on a GPU)" if config.timing == "auto"
                   else "skipped (timing 'off')")

  rows = []
  for mods in config.combinations:
    row = {"mods": list(mods), "key": combination_key(mods), "label": combination_label(mods)}
    t = timed.get(combination_key(mods))
    for precision in config.precisions:
      final = arm(mods, precision)
      if final is None:
        status = "pending"
      elif _finite(final.get("logloss")) is None:
        status = "error"
      else:
        status = "done"
      entry = {"status": status}
      if final is not None:
        # peak_loss: the run's worst training step (absent from runs older than it).
        entry.update({k: _finite(final.get(k)) for k in ("ne", "logloss", "auc", "peak_loss")})
        if final.get("error"):
          entry["error"] = final["error"]
      if t is not None:
        for mode in ("train", "infer"):
          s = t["variants"].get(f"{precision}__{combination_key(mods)}", {}).get(mode)
          if s:
            entry[f"{mode}_ms"] = s["median_us"] / 1e3
            entry[f"{mode}_speedup"] = s["speedup"]
            entry[f"{mode}_speedup_ci"] = s["speedup_ci"]
      row[precision] = entry
    bf16_ll = (row.get("bf16") or {}).get("logloss")
    fp8_ll = (row.get("fp8_all") or {}).get("logloss")
    row["fp8_vs_bf16"] = _delta(fp8_ll, bf16_ll, tolerance)
    row["mods_vs_baseline"] = _delta(bf16_ll, base_ll, tolerance) if mods else None
    row["fp8_mods_vs_baseline"] = _delta(fp8_ll, base_ll, tolerance) if mods else None
    if t is not None and t.get("fp8_vs_bf16"):
      row["fp8_vs_bf16_speedup"] = t["fp8_vs_bf16"]
    rows.append(row)

  pending = [a.name for a in arms(config) if finals.get(a.name) is None]
  if timing_enabled(config):
    pending += [f"timing {combination_key(m)}" for m in config.combinations
                if combination_key(m) not in timed]
  block = int(get_config(config.model, config.preset).mods.block_size)
  return {
      "schema": SCHEMA, "settings": dict(config.shared_settings(), block_size=block,
                                         precisions=list(config.precisions)),
      "device": device, "jax": jax.__version__, "timing": timing_note,
      "noise": {"seeds": seeds, "logloss": seed_ll, "std": std, "tolerance": tolerance,
                "rule": "neutral: |delta log loss| <= max(0.02% relative, 2 x bf16 seed std)"},
      "rows": rows, "complete": not pending, "pending": pending,
  }


def _fmt(value, spec=".5f", missing="-"):
  return missing if value is None else format(value, spec)


def _fmt_delta(d) -> str:
  if d is None:
    return "-"
  rel = "" if d["rel"] is None else f" ({100 * d['rel']:+.3f}%)"
  return f"{d['abs']:+.5f}{rel} {d['verdict']}"


def _fmt_time(entry) -> str:
  if "train_ms" not in entry:
    return "-"
  return (f"{entry['train_ms']:.2f} ({entry['train_speedup']:.2f}x) / "
          f"{entry['infer_ms']:.2f} ({entry['infer_speedup']:.2f}x)")


def markdown_table(result: Mapping[str, Any]) -> str:
  """The ablation as a markdown table with a header line of its settings."""
  s = result["settings"]
  noise = result["noise"]
  floor = (f"bf16 seed-to-seed std of log loss {noise['std']:.5f} over seeds "
           f"{noise['seeds']}" if noise["std"] is not None else
           "no seed-to-seed noise floor (add noise seeds): only the 0.02% bound applies")
  lines = [
      f"Mods ablation: {s['model']}/{s['preset']}, {s['steps']} steps x batch {s['batch_size']}"
      + (f" (learning-rate warm-up {s['warmup_steps']} steps)" if s.get("warmup_steps") else "")
      + (" with deterministic XLA ops" if s.get("xla_deterministic") else "")
      + ", "
      f"{s['num_eval']} held-out examples, seed {s['seed']}; FP8 = fp8_all with {s['kernel']}; "
      f"BlockNorm block {s['block_size']}; device {result['device']}, jax {result['jax']}.",
      f"Neutral: |delta log loss| <= {_fmt(noise['tolerance'])} ({floor}).",
      f"Timing: {result['timing']}; cells are train / inference step ms (speedup vs the bf16 "
      "baseline timed in the same run).",
      "",
      "| mods | bf16 NE | FP8 NE | bf16 log loss | FP8 log loss | FP8 vs bf16 (log loss) | "
      "mods vs baseline (bf16) | FP8+mods vs bf16 baseline | bf16 train / infer ms | "
      "FP8 train / infer ms | worst step's loss (bf16 / FP8) |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in result["rows"]:
    b, f = row.get("bf16") or {}, row.get("fp8_all") or {}
    lines.append(
        f"| {row['label']} | {_fmt(b.get('ne'))} | {_fmt(f.get('ne'))} | "
        f"{_fmt(b.get('logloss'))} | {_fmt(f.get('logloss'))} | "
        f"{_fmt_delta(row['fp8_vs_bf16'])} | {_fmt_delta(row['mods_vs_baseline'])} | "
        f"{_fmt_delta(row['fp8_mods_vs_baseline'])} | {_fmt_time(b)} | {_fmt_time(f)} | "
        f"{_fmt(b.get('peak_loss'), '.3g')} / {_fmt(f.get('peak_loss'), '.3g')} |")
  errors = [(row["label"], p, row[p]["error"]) for row in result["rows"]
            for p in ("bf16", "fp8_all") if (row.get(p) or {}).get("error")]
  for label, precision, error in errors:
    lines.append(f"\nerror {label} {precision}: {error}")
  if not result["complete"]:
    lines.append(f"\nIncomplete: {len(result['pending'])} unit(s) pending; rerun to continue.")
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str) -> str:
  """NE per combination (bf16 vs FP8, with the bf16 noise band) and, where measured, the
  train / inference speedup vs the bf16 baseline; saved as a PNG at `path`."""
  import matplotlib
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  rows = result["rows"]
  labels = [r["label"] for r in rows]
  x = np.arange(len(rows))
  colors = {"bf16": "tab:blue", "fp8_all": "tab:orange"}
  # Without timing rows the latency panel would be an empty frame: the figure is the quality
  # panel alone, and its title says why there is no latency.
  measured = any("train_ms" in (r.get(p) or {}) for r in rows for p in colors)
  fig, axes = plt.subplots(1, 2 if measured else 1, squeeze=False,
                           figsize=(12, 4.2) if measured else (7, 4.4))
  ax_ne = axes[0, 0]
  names = {"bf16": "bf16", "fp8_all": f"FP8 ({result['settings']['kernel']})"}
  for offset, precision in ((-0.12, "bf16"), (0.12, "fp8_all")):
    ne = [np.nan if (r.get(precision) or {}).get("ne") is None else r[precision]["ne"]
          for r in rows]
    if not np.all(np.isnan(ne)) and precision in result["settings"]["precisions"]:
      ax_ne.plot(x + offset, ne, "o", color=colors[precision], label=names[precision])
  base = (rows[0].get("bf16") or {}) if rows and not rows[0]["mods"] else {}
  noise = result["noise"]
  if base.get("ne") is not None and noise["std"] is not None and base.get("logloss"):
    band = 2 * noise["std"] * base["ne"] / base["logloss"]  # log loss std in NE units
    ax_ne.axhspan(base["ne"] - band, base["ne"] + band, color="tab:blue", alpha=0.12,
                  label="bf16 baseline +- 2 seed std")
  ax_ne.set_xticks(x, labels, rotation=30, ha="right")
  ax_ne.set_ylabel("held-out NE (lower is better)")
  ax_ne.set_title("Quality per Mods combination")
  ax_ne.grid(axis="y", alpha=0.3)
  if ax_ne.get_legend_handles_labels()[0]:  # nothing drawn before any arm has finished
    ax_ne.legend(fontsize=8)

  if measured:
    ax_t = axes[0, 1]
    smoke = " - smoke, not results" if result["timing"].startswith("smoke") else ""
    for offset, precision in ((-0.18, "bf16"), (0.06, "fp8_all")):
      for mode, marker, shift in (("train", "o", 0.0), ("infer", "s", 0.12)):
        pts = [(i, r[precision][f"{mode}_speedup"], r[precision][f"{mode}_speedup_ci"])
               for i, r in enumerate(rows) if f"{mode}_speedup" in (r.get(precision) or {})]
        if not pts:
          continue
        xi = np.array([p[0] for p in pts]) + offset + shift
        yi = np.array([p[1] for p in pts])
        err = np.array([[p[1] - p[2][0], p[2][1] - p[1]] for p in pts]).T
        ax_t.errorbar(xi, yi, yerr=err, fmt=marker, color=colors[precision], capsize=2,
                      label=f"{names[precision]} {mode}")
    ax_t.axhline(1.0, color="gray", lw=0.8)
    ax_t.set_ylabel("speedup vs bf16 baseline (95% CI)")
    ax_t.legend(fontsize=8)
    ax_t.set_xticks(x, labels, rotation=30, ha="right")
    ax_t.set_title(f"Latency ({result['device']}{smoke})")
    ax_t.grid(axis="y", alpha=0.3)
  s = result["settings"]
  fig.suptitle(f"Mods ablation: {s['model']}/{s['preset']}, {s['steps']} steps x "
               f"{s['batch_size']}"
               + ("" if measured else f"\nno latency: timing {result['timing']}"))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _labels(rows, key: str, verdict: str) -> List[str]:
  return [r["label"] for r in rows if (r.get(key) or {}).get("verdict") == verdict]


def _sentence(title: str, rows, key: str) -> Optional[str]:
  judged = [r for r in rows if r.get(key)]
  if not judged:
    return None
  parts = [f"{verdict} for {', '.join(labels)}" for verdict in ("neutral", "better", "worse")
           if (labels := _labels(judged, key, verdict))]
  return f"{title} ({len(judged)} combination(s)): " + "; ".join(parts) + "."


def reading(result: Mapping[str, Any]) -> str:
  """A few sentences reading the ablation: loss verdicts, then latency where measured."""
  rows = result["rows"]
  noise = result["noise"]
  lines = [f"Neutral band: |delta log loss| <= {_fmt(noise['tolerance'])}"
           + (f" (2 x bf16 seed std {noise['std']:.5f} over {len(noise['logloss'])} seeds)."
              if noise["std"] is not None else " (0.02% relative; no seed noise floor).")]
  for title, key in (("FP8 vs bf16 with the same Mods", "fp8_vs_bf16"),
                     ("Mods alone (bf16) vs the bf16 baseline", "mods_vs_baseline"),
                     ("FP8 with Mods vs the bf16 baseline", "fp8_mods_vs_baseline")):
    sentence = _sentence(title, rows, key)
    if sentence:
      lines.append(sentence)
  pairs = [(r["label"], r["fp8_vs_bf16_speedup"]["train"]) for r in rows
           if "train" in (r.get("fp8_vs_bf16_speedup") or {})]
  if pairs:
    lines.append("FP8 vs bf16 train-step speedup with the same Mods: " + "; ".join(
        f"{label} {s[0]:.2f}x [{s[1]:.2f}, {s[2]:.2f}]" for label, s in pairs) + ".")
  timed = [(r["label"], p, r[p]["train_speedup"]) for r in rows for p in ("bf16", "fp8_all")
           if "train_speedup" in (r.get(p) or {})]
  if timed:
    label, precision, speedup = max(timed, key=lambda t: t[2])
    lines.append(f"Fastest train step: {label} in {precision}, {speedup:.2f}x the bf16 "
                 f"baseline ({result['timing']}).")
  else:
    lines.append(f"Latency: {result['timing']}.")
  return "\n".join(lines)


def write_outputs(result: Mapping[str, Any], workdir: str) -> Dict[str, str]:
  """ablation.json, ablation.md and ablation.png in `workdir`; returns their paths."""
  paths = {"json": os.path.join(workdir, "ablation.json"),
           "table": os.path.join(workdir, "ablation.md"),
           "plot": os.path.join(workdir, "ablation.png")}
  write_json(paths["json"], result)
  with open(paths["table"], "w") as f:
    f.write(markdown_table(result) + "\n")
  plot(result, paths["plot"])
  return paths
