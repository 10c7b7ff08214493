"""The Mods ablation's report: the loka.ablation/2 dict from the arms' results and timing rows
(`summarize`), its markdown table, plot and reading, and the files they go to.

Every loss verdict is the project's quality rule, `loka_jax.train.verdict.paired_quality`:
per seed, (arm - reference) / reference of held-out log loss; met when the 95% Student-t
interval of the mean change ends at or below +0.02% (`NEUTRAL_REL_LOGLOSS`), missed when it
starts above it, otherwise unresolved, with the paired seeds the measured spread says would
resolve it (one seed measures no spread). An arm that diverged at a seed its reference
finished misses at any seed count; a seed the reference diverged at pairs with nothing.
Each combination is judged three ways: FP8 against bf16 with the same Mods, the Mods in bf16
against the bf16 baseline, and FP8 with the Mods against the bf16 baseline.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Mapping, Optional, Sequence

import jax
import numpy as np

from loka_jax import figures
from loka_jax.models.presets import get_config
from loka_jax.train import verdict as verdict_lib
from loka_jax.train.ablation_arms import (AblationConfig, Arm, arms, combination_key,
                                         combination_label, timing_enabled)
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

SCHEMA = "loka.ablation/2"
RULE = ("paired non-inferiority by seed (loka_jax.train.verdict.paired_quality): per seed "
        "(arm - reference) / reference of held-out log loss; met when the 95% Student-t "
        "interval of the mean change ends at or below the bound, missed when it starts above "
        "it, otherwise unresolved (pairs_to_resolve: the paired seeds that would resolve it; "
        "one seed measures no spread); an arm diverged at a seed its reference finished misses")
COMPARISONS = {  # row key: (arm, reference)
    "fp8_vs_bf16": "FP8 against bf16 with the same Mods",
    "mods_vs_baseline": "the Mods in bf16 against the bf16 baseline (no Mods)",
    "fp8_mods_vs_baseline": "FP8 with the Mods against the bf16 baseline (no Mods)",
}
METRICS = ("ne", "logloss", "auc")


def write_json(path: str, value) -> None:
  """`value` as indented JSON with sorted keys, written to a temporary file and renamed."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def _finite(value) -> Optional[float]:
  return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def check_schema(result: Mapping[str, Any], where: str = "the ablation result") -> None:
  """ValueError (one line, saying how to remake it) unless `result` is a loka.ablation/2 dict."""
  schema = result.get("schema") if isinstance(result, Mapping) else None
  if schema != SCHEMA:
    raise ValueError(
        f"{where} has schema {schema!r}, not {SCHEMA!r} (loss verdicts by paired seeds): "
        "rerun `python3 -m experiments.ablate_mods --workdir=DIR` on its work directory to "
        "rewrite it (finished arms are kept; add --config.ablation.seeds=0,1,2 for spread)")


def load(path: str) -> Dict[str, Any]:
  """An ablation.json written by `write_outputs` (ValueError naming the file otherwise)."""
  try:
    with open(path) as f:
      result = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: not a readable ablation JSON ({e})") from None
  check_schema(result, path)
  return result


def _losses(runs: Mapping[int, Optional[Mapping[str, Any]]]) -> Dict[int, float]:
  """{seed: held-out log loss} of the finished runs; a diverged one (its error record, or a
  non-finite loss) is +inf."""
  out = {}
  for seed, final in runs.items():
    if final is not None:
      loss = _finite(final.get("logloss"))
      out[seed] = math.inf if loss is None else loss
  return out


def _judge(arm: Mapping[int, Optional[Mapping]], reference: Mapping[int, Optional[Mapping]]
           ) -> Optional[Dict[str, Any]]:
  """`paired_quality` of the arm's held-out log loss against the reference's, by seed (None
  while no seed has finished both), plus `delta_logloss` (the mean arm - reference), the
  seeds the reference diverged at (`unpaired`) and those the arm did (`diverged`: missed)."""
  mine, theirs = _losses(arm), _losses(reference)
  common = sorted(set(mine) & set(theirs))
  if not common:
    return None
  unpaired = [s for s in common if math.isinf(theirs[s])]
  theirs = {s: v for s, v in theirs.items() if s not in unpaired}
  out = verdict_lib.paired_quality(mine, theirs)
  out["changes"] = [_finite(c) for c in out["changes"]]  # JSON has no infinity
  diffs = [mine[s] - theirs[s] for s in out["seeds"]]
  out["delta_logloss"] = _finite(float(np.mean(diffs))) if diffs else None
  diverged = [s for s in out["seeds"] if math.isinf(mine[s])]
  if diverged:
    out.update(verdict=verdict_lib.MISSED, diverged=diverged,
               why=f"diverged at seed(s) {', '.join(map(str, diverged))}")
    out.pop("pairs_to_resolve", None)
    out.pop("error", None)
  if unpaired:
    out["unpaired"] = {str(s): "the reference diverged" for s in unpaired}
    if not out["seeds"]:
      out["why"] = (f"the reference diverged at seed(s) {', '.join(map(str, unpaired))}; "
                    "no seed pairs")
  return out


def _entry(runs: Mapping[int, Optional[Mapping[str, Any]]]) -> Dict[str, Any]:
  """One precision of a row: `by_seed` (each seed's status and scores), the mean NE, log
  loss and AUC over the finished seeds, the worst training step of any, and a status: pending
  while a seed is to run, else error if one diverged, else done."""
  by_seed = []
  for seed, final in runs.items():
    run = {"seed": seed}
    if final is None:
      run["status"] = "pending"
    elif _finite(final.get("logloss")) is None:
      run.update(status="error",
                 error=final.get("error") or "the held-out log loss is not finite")
    else:
      # peak_loss: the run's worst training step (absent from runs older than it).
      run.update(status="done", **{k: _finite(final.get(k)) for k in METRICS + ("peak_loss",)})
    by_seed.append(run)
  statuses = {r["status"] for r in by_seed}
  entry = {"status": "pending" if "pending" in statuses else
           "error" if "error" in statuses else "done", "by_seed": by_seed}
  done = [r for r in by_seed if r["status"] == "done"]
  for key in METRICS:
    values = [r[key] for r in done if r[key] is not None]
    entry[key] = float(np.mean(values)) if values else None
  peaks = [r["peak_loss"] for r in done if r["peak_loss"] is not None]
  entry["peak_loss"] = max(peaks) if peaks else None
  errors = [f"seed {r['seed']}: {r['error']}" for r in by_seed if r["status"] == "error"]
  if errors:
    entry["error"] = "; ".join(errors)
  return entry


def summarize(config: AblationConfig, finals: Mapping[str, Optional[Mapping[str, Any]]],
              timing_rows: Sequence[Mapping[str, Any]], device: str) -> Dict[str, Any]:
  """The loka.ablation/2 dict from per-arm final.json dicts (None: not run yet) and timing rows.

  Keys: settings (with `seeds`), device, timing ("measured" | "smoke (not on a GPU)" |
  "skipped (...)"), quality (the verdict rule, its bound, the seeds, what each comparison
  compares), rows (one per combination: per precision the mean ne/logloss/auc over the
  finished seeds, `by_seed`, status and, where timed, train/infer median_ms and speedup vs
  the bf16 baseline with its CI; the verdicts fp8_vs_bf16, mods_vs_baseline,
  fp8_mods_vs_baseline, each `paired_quality`'s dict or None while no seed pairs),
  complete, pending.
  """
  def runs(mods, precision):
    return {s: finals.get(Arm(mods, precision, s).name) for s in config.seeds}

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

  listed = lambda mods, precision: (precision in config.precisions
                                    and mods in config.combinations)
  base = runs((), "bf16") if listed((), "bf16") else None
  rows = []
  for mods in config.combinations:
    row = {"mods": list(mods), "key": combination_key(mods), "label": combination_label(mods)}
    t = timed.get(combination_key(mods))
    for precision in config.precisions:
      entry = _entry(runs(mods, precision))
      if t is not None:
        for mode in ("train", "infer"):
          s = t["variants"].get(f"{precision}__{combination_key(mods)}", {}).get(mode)
          if s:
            entry[f"{mode}_ms"] = s["median_us"] / 1e3
            entry[f"{mode}_speedup"] = s["speedup"]
            entry[f"{mode}_speedup_ci"] = s["speedup_ci"]
      row[precision] = entry
    bf16 = runs(mods, "bf16") if listed(mods, "bf16") else None
    fp8 = runs(mods, "fp8_all") if listed(mods, "fp8_all") else None
    judge = lambda a, r: _judge(a, r) if a is not None and r is not None else None
    row["fp8_vs_bf16"] = judge(fp8, bf16)
    row["mods_vs_baseline"] = judge(bf16, base) if mods else None
    row["fp8_mods_vs_baseline"] = judge(fp8, base) if mods else None
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
                                         precisions=list(config.precisions),
                                         seeds=list(config.seeds)),
      "device": device, "jax": jax.__version__, "timing": timing_note,
      "quality": {"rule": RULE, "bound": NEUTRAL_REL_LOGLOSS, "seeds": list(config.seeds),
                  "comparisons": dict(COMPARISONS)},
      "rows": rows, "complete": not pending, "pending": pending,
  }


def _fmt(value, spec=".5f", missing="-"):
  return missing if value is None else format(value, spec)


def _unresolved_note(v: Mapping[str, Any]) -> str:
  """Why an unresolved verdict is: the paired seeds that would resolve it, or why none can."""
  if v.get("pairs_to_resolve"):
    return f"{v['pairs_to_resolve']} paired seeds would resolve it"
  if v["n"] < 2:
    return v.get("why") if not v["n"] else "one paired seed measures no spread"
  return "the mean sits on the bound: more seeds will not resolve it"


def _fmt_verdict(v: Optional[Mapping[str, Any]]) -> str:
  """A verdict's table cell: mean relative change [95% CI] verdict (note)."""
  if v is None:
    return "-"
  text = "" if v.get("mean") is None else f"{100 * v['mean']:+.3f}%"
  if v.get("ci"):
    text += f" [{100 * v['ci'][0]:+.3f}, {100 * v['ci'][1]:+.3f}]"
  text += f" {v['verdict']}"
  if v["verdict"] == verdict_lib.UNRESOLVED:
    text += f" ({_unresolved_note(v) if v['n'] != 1 else '1 seed: no spread'})"
  elif v.get("diverged"):
    text += f" ({v['why']})"
  return text.strip()


def _fmt_time(entry) -> str:
  if "train_ms" not in entry:
    return "-"
  return (f"{entry['train_ms']:.2f} ({entry['train_speedup']:.2f}x) / "
          f"{entry['infer_ms']:.2f} ({entry['infer_speedup']:.2f}x)")


def markdown_table(result: Mapping[str, Any]) -> str:
  """The ablation as a markdown table with a header line of its settings."""
  check_schema(result)
  s = result["settings"]
  seeds = ", ".join(map(str, s["seeds"]))
  lines = [
      f"Mods ablation: {s['model']}/{s['preset']}, {s['steps']} steps x batch {s['batch_size']}"
      + (f" (learning-rate warm-up {s['warmup_steps']} steps)" if s.get("warmup_steps") else "")
      + (" with deterministic XLA ops" if s.get("xla_deterministic") else "")
      + ", "
      f"{s['num_eval']} held-out examples, seed(s) {seeds}; FP8 = fp8_all with {s['kernel']}; "
      f"BlockNorm block {s['block_size']}; device {result['device']}, jax {result['jax']}.",
      "NE and log loss: means over the seeds. Verdicts pair the arms by seed: per seed the "
      "relative change of held-out log loss against the reference; cells are its mean "
      "[95% CI], met when the interval ends at or below "
      f"{100 * result['quality']['bound']:+.2f}%, missed when it starts above, otherwise "
      "unresolved.",
      f"Timing: {result['timing']}; cells are train / inference step ms (speedup vs the bf16 "
      "baseline timed in the same run).",
      "",
      "| mods | bf16 NE | FP8 NE | bf16 log loss | FP8 log loss | FP8 vs bf16 | "
      "mods vs baseline (bf16) | FP8+mods vs bf16 baseline | bf16 train / infer ms | "
      "FP8 train / infer ms | worst step's loss (bf16 / FP8) |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in result["rows"]:
    b, f = row.get("bf16") or {}, row.get("fp8_all") or {}
    lines.append(
        f"| {row['label']} | {_fmt(b.get('ne'))} | {_fmt(f.get('ne'))} | "
        f"{_fmt(b.get('logloss'))} | {_fmt(f.get('logloss'))} | "
        f"{_fmt_verdict(row['fp8_vs_bf16'])} | {_fmt_verdict(row['mods_vs_baseline'])} | "
        f"{_fmt_verdict(row['fp8_mods_vs_baseline'])} | {_fmt_time(b)} | {_fmt_time(f)} | "
        f"{_fmt(b.get('peak_loss'), '.3g')} / {_fmt(f.get('peak_loss'), '.3g')} |")
  errors = [(row["label"], p, row[p]["error"]) for row in result["rows"]
            for p in ("bf16", "fp8_all") if (row.get(p) or {}).get("error")]
  for label, precision, error in errors:
    lines.append(f"\nerror {label} {precision}: {error}")
  if not result["complete"]:
    lines.append(f"\nIncomplete: {len(result['pending'])} unit(s) pending; rerun to continue.")
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str) -> str:
  """NE per combination (bf16 vs FP8: each seed's, and their mean labelled with the FP8 vs
  bf16 verdict) and, where measured, the train / inference speedup vs the bf16 baseline;
  saved as a PNG at `path`."""
  check_schema(result)

  rows = result["rows"]
  labels = [r["label"] for r in rows]
  x = np.arange(len(rows))
  colors = {"bf16": "tab:blue", "fp8_all": "tab:orange"}
  # Without timing rows the latency panel would be an empty frame: the figure is the quality
  # panel alone, and its title says why there is no latency.
  measured = any("train_ms" in (r.get(p) or {}) for r in rows for p in colors)
  fig, axes = figures.subplots(1, 2 if measured else 1, squeeze=False,
                               figsize=(12, 4.2) if measured else (7, 4.4))
  ax_ne = axes[0, 0]
  names = {"bf16": "bf16", "fp8_all": f"FP8 ({result['settings']['kernel']})"}
  for offset, precision in ((-0.12, "bf16"), (0.12, "fp8_all")):
    if precision not in result["settings"]["precisions"]:
      continue
    ne = [np.nan if (r.get(precision) or {}).get("ne") is None else r[precision]["ne"]
          for r in rows]
    if np.all(np.isnan(ne)):
      continue
    ax_ne.plot(x + offset, ne, "o", color=colors[precision], label=f"{names[precision]} mean")
    seeds = [(i, run["ne"]) for i, r in enumerate(rows)
             for run in (r.get(precision) or {}).get("by_seed", ()) if run.get("ne") is not None]
    if len(seeds) > sum(np.isfinite(ne)):  # more than one seed somewhere
      ax_ne.plot(x[[i for i, _ in seeds]] + offset, [v for _, v in seeds], ".",
                 color=colors[precision], alpha=0.35, ms=4)
    if precision == "fp8_all":
      for i, r in enumerate(rows):
        if r.get("fp8_vs_bf16") and np.isfinite(ne[i]):
          ax_ne.annotate(r["fp8_vs_bf16"]["verdict"], (x[i] + offset, ne[i]), fontsize=7,
                         xytext=(3, 4), textcoords="offset points", color=colors[precision])
  ax_ne.set_xticks(x, labels, rotation=30, ha="right")
  ax_ne.set_ylabel("held-out NE (lower is better)")
  seeds = ", ".join(map(str, result["settings"]["seeds"]))
  ax_ne.set_title(f"Quality per Mods combination (seeds {seeds}; label: FP8 vs bf16)",
                  fontsize=10)
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
  return path


def _judged(label: str, v: Mapping[str, Any]) -> str:
  if v["verdict"] == verdict_lib.UNRESOLVED:
    return f"{label} ({_unresolved_note(v)})"
  return f"{label} ({v['why']})" if v.get("diverged") else label


def _sentence(title: str, rows, key: str) -> Optional[str]:
  judged = [r for r in rows if r.get(key)]
  if not judged:
    return None
  parts = [f"{verdict} for {', '.join(labels)}"
           for verdict in (verdict_lib.MET, verdict_lib.MISSED, verdict_lib.UNRESOLVED)
           if (labels := [_judged(r["label"], r[key]) for r in judged
                          if r[key]["verdict"] == verdict])]
  return f"{title} ({len(judged)} combination(s)): " + "; ".join(parts) + "."


def reading(result: Mapping[str, Any]) -> str:
  """A few sentences reading the ablation: loss verdicts, then latency where measured."""
  check_schema(result)
  rows = result["rows"]
  q = result["quality"]
  lines = [f"Loss verdicts pair the arms by seed (seeds {', '.join(map(str, q['seeds']))}): "
           f"met when the 95% interval of the mean relative change of held-out log loss ends "
           f"at or below {100 * q['bound']:+.2f}%, missed when it starts above it."]
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
