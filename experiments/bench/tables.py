"""Markdown tables of the benchmark rows: speed, quality, targets."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from experiments.bench import quality as quality_lib
from experiments.bench import quality_pairs
from experiments.bench.mods_set import of_row, preset_label, row_subject
from experiments.bench.variants import LABELS, VARIANTS

# A row's ratio is over the bf16 timed in its own pair. Where that pair's bf16 ran far from
# the bf16 of the target's other pairs timed the same way, the ratio carries the drift: on
# DLRM `large` (H200, 2026-11-28) bf16 ran at 5.4-6.5 ms in one pair against 6.8-7.8 ms in
# the other five, and that row read 0.77x while its median step was 0.97x bf16's. The table
# marks such ratios.
BASELINE_DRIFT = 0.10
DRIFT_MARK = "†"
MIN_PAIRS = 3   # pairs of a target (timed alike) needed before one of them is called off


def _ci(s: Mapping) -> str:
  return f"{s['speedup']:.2f} [{s['speedup_ci'][0]:.2f}, {s['speedup_ci'][1]:.2f}]"


def _gib(x) -> str:
  return "-" if x is None else f"{x / 2**30:.2f}"


def _variant_order(name: str) -> int:
  names = list(VARIANTS)
  return names.index(name) if name in names else len(names)


def _pair_baseline_us(row: Mapping, mode: str) -> Optional[float]:
  samples = (row.get(mode) or {}).get("baseline_samples_us")
  return float(np.median(samples)) if samples else None


def _preset(row: Mapping) -> str:
  return preset_label(row["preset"], of_row(row))


def _timed_alike(row: Mapping) -> Tuple:
  return (row_subject(row), row.get("device"), str(row.get("inner")), row.get("min_call_s"),
          str(row.get("calls_per_sample")))


def baseline_drift(rows: Sequence[Mapping]) -> Dict[Tuple[int, str], float]:
  """{(index in rows, mode): drift}: how far the bf16 timed in a row's pair ran from the
  median of the bf16 of every pair of that target timed alike (same device, steps a call and
  minimum call; at least MIN_PAIRS of them), as that pair's median over the median of them
  all, less 1 (negative: faster in this pair). Rows without samples are left out."""
  groups: Dict[Tuple, List[Tuple[int, str, float]]] = {}
  for index, r in enumerate(rows):
    if "error" in r:
      continue
    for mode in ("train", "infer"):
      us = _pair_baseline_us(r, mode)
      if us is not None:
        groups.setdefault(_timed_alike(r) + (mode,), []).append((index, mode, us))
  drift = {}
  for members in groups.values():
    if len(members) < MIN_PAIRS:
      continue
    reference = float(np.median([us for _, _, us in members]))
    drift.update({(index, mode): us / reference - 1.0 for index, mode, us in members})
  return drift


def speed_table(rows: Sequence[Mapping], suite: str) -> str:
  """One line per (target, variant): examples/s and speedup vs the same run's bf16. A ratio
  whose pair's bf16 drifted past BASELINE_DRIFT (`baseline_drift`) is marked, with a note
  under the table."""
  lines = [f"| {'tower' if suite == 'towers' else 'model'} | preset | variant | batch | "
           "train ex/s | train vs bf16 [95% CI] | infer ex/s | infer vs bf16 [95% CI] | "
           "train mem GiB | kernels | device |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  chosen = [r for r in rows if r.get("suite") == suite]
  chosen.sort(key=lambda r: (row_subject(r), _variant_order(r["variant"])))
  marks = {key: d for key, d in baseline_drift(chosen).items() if abs(d) > BASELINE_DRIFT}
  notes = []
  for index, r in enumerate(chosen):
    if "error" in r:
      lines.append(f"| {r['model']} | {_preset(r)} | {LABELS.get(r['variant'], r['variant'])} "
                   f"| {r.get('batch_size', '-')} | error: {r['error'][:80]} | | | | | | "
                   f"{r['device']} |")
      continue
    t, i = r["train"], r["infer"]
    kernels = ", ".join(r.get("kernels") or ([r["kernel"]] if r.get("kernel") else []))
    if r.get("export"):
      modes = ", ".join(f"{n} {m}" for m, n in sorted((r.get("export_modes") or {}).items()))
      kernels += f" (infer: exported, {modes or 'no sites'})"
    ratio = {}
    for mode, summary in (("train", t), ("infer", i)):
      ratio[mode] = _ci(summary)
      if (index, mode) in marks:
        ratio[mode] += f" {DRIFT_MARK}"
        drift = marks[(index, mode)]
        notes.append(f"{DRIFT_MARK} {row_subject(r)} "
                     f"{LABELS.get(r['variant'], r['variant'])}, {mode}: bf16 ran "
                     f"{abs(drift):.0%} {'faster' if drift < 0 else 'slower'} in this pair than "
                     "the median of this target's pairs, and the ratio carries that drift; the "
                     "ex/s columns compare medians timed apart.")
    lines.append(
        f"| {r['model']} | {_preset(r)} | {LABELS.get(r['variant'], r['variant'])} | "
        f"{r['batch_size']} | {t['examples_per_s']:,.0f} | {ratio['train']} | "
        f"{i['examples_per_s']:,.0f} | {ratio['infer']} | {_gib(r.get('train_memory_bytes'))} | "
        f"{kernels or '-'} | {r['device']} |")
  return "\n".join(lines + ([""] + notes if notes else []))


def quality_table(rows: Sequence[Mapping]) -> str:
  """Per data/model/preset and arm: mean held-out log loss, NE, AUC over its seeds, and the
  worst training step of its runs (the verdicts pair them by seed: `quality_verdicts_table`)."""
  lines = ["| data | model | preset | arm | seeds | log loss | NE | AUC | worst step's loss |",
           "|---|---|---|---|---|---|---|---|---|"]
  for c in quality_lib.comparisons(rows, scored_only=False):
    means = quality_lib.arm_means(rows, c)
    for arm in quality_lib.ARMS:
      if arm not in means:
        continue
      m = means[arm]
      peak = (f"{m['peak_loss']:.3g} (seed {m['peak_seed']})" if "peak_loss" in m else "-")
      label = arm + (f" (bf16_mods' runs at seeds {m['twin_seeds']}: no FP8 site)"
                     if m["twin_seeds"] else "")
      lines.append(f"| {c.data} | {c.model} | {c.preset_label} | {label} | "
                   f"{','.join(map(str, m['seeds']))} | {m['logloss']:.5f} | "
                   f"{m.get('ne', float('nan')):.5f} | {m.get('auc', float('nan')):.4f} | "
                   f"{peak} |")
  errors = [r for r in rows if r.get("suite") == "quality" and "error" in r]
  for r in errors:
    lines.append(f"| {r['data']} | {r['model']} | {r['preset']} | {r['arm']} | seed {r['seed']} "
                 f"| error: {r['error'][:80]} | | | |")
  return "\n".join(lines)


def _pct(x: Optional[float]) -> str:
  return "-" if x is None else f"{100 * x:+.3f}%"


def _seeds_needed(v: Mapping) -> str:
  if v["verdict"] != "unresolved":
    return "-"
  if v["n"] < 2:
    return ">= 2 (no spread yet)"
  need = v.get("seeds_needed")
  if need is None:
    return "not resolvable"
  more = max(need - v["n"], 0)
  if not more or v.get("seed_s") is None:
    return str(need)
  seconds = more * v["seed_s"]
  return f"{need} ({more} more, " + (f"~{seconds / 60:.0f} min)" if seconds >= 60 else
                                     f"~{seconds:.0f} s)")


def quality_verdicts_table(verdicts: Sequence[Mapping]) -> str:
  """Per quality comparison, arm and reference: paired seeds, the mean paired relative change
  of held-out log loss, its 95% CI, the verdict and, for an unresolved one, the paired seeds
  its measured mean and spread say would resolve it."""
  lines = ["| subject | arm | vs | paired seeds | mean change | 95% CI | verdict | seeds needed |",
           "|---|---|---|---|---|---|---|---|"]
  for v in verdicts:
    if v["mode"] != "quality" or "verdict" not in v:
      continue
    arm, _, reference = v["target"].partition("_quality_vs_")
    ci = "-" if v["ci"] is None else f"[{_pct(v['ci'][0])}, {_pct(v['ci'][1])}]"
    verdict = v["verdict"] + ("" if v.get("judged") else " (peer)")
    lines.append(f"| {v['subject']} | {quality_pairs.LABELS.get(arm, arm)} | "
                 f"{quality_pairs.LABELS.get(reference, reference)}"
                 f" | {v['n']} | {_pct(v['value'])} | {ci} | {verdict} | {_seeds_needed(v)} |")
  return "\n".join(lines)


def curves_table(rows: Sequence[Mapping], runs_roots: Sequence[str]) -> str:
  """Per quality comparison, each run whose logged curve is found under `runs_roots`: its
  first and last windows' mean training loss, the step it got down to the comparison's
  common mark (`quality.descent_mark`: a quarter of the runs' mean descent left; `descent_step`)
  and its held-out log loss, runs ordered by that loss, so a reader sees whether the
  held-out order is the order in which runs came down. Empty when no run is found."""
  lines = []
  for c in quality_lib.comparisons(rows):
    curves = quality_lib.run_curves(rows, runs_roots, c)
    runs = sorted((r for r in rows if c.holds(r) and r["arm"] in curves.get(r["seed"], {})),
                  key=lambda r: r["logloss"])
    mark = quality_lib.descent_mark([curves[r["seed"]][r["arm"]] for r in runs])
    for r in runs:
      curve = curves[r["seed"]][r["arm"]]
      step = (None if mark is None else
              quality_lib.descent_step(curve["step"], curve["loss"], mark))
      lines.append(f"| {c.subject} | {r['arm']} | {r['seed']} | "
                   f"{curve['loss'][0]:.4f} ({curve['step'][0]}) | "
                   f"{'-' if step is None else f'{step:.0f}'} | "
                   f"{'-' if mark is None else f'{mark:.4f}'} | "
                   f"{curve['loss'][-1]:.4f} ({curve['step'][-1]}) | {r['logloss']:.5f} |")
  if not lines:
    return ""
  return "\n".join(["| subject | arm | seed | first window's loss (step) | step down to the "
                    "mark | the comparison's mark | last window's loss (step) | held-out log "
                    "loss |", "|---|---|---|---|---|---|---|---|"] + lines)


def verdict_word(v: Mapping) -> str:
  """met, MISSED, unresolved or not applicable; a target reported without a bar: its rule's
  verdict where it has one (the FP8 peers' quality), else '-'."""
  if v["met"] is not None:
    return "met" if v["met"] else "MISSED"
  return v.get("verdict") or "-"


def targets_table(verdicts: Sequence[Mapping]) -> str:
  lines = ["| target | subject | mode | value | 95% CI / bound | need | verdict | note |",
           "|---|---|---|---|---|---|---|---|"]
  for v in verdicts:
    fmt = _pct if v["mode"] == "quality" else (lambda x: f"{x:.4g}")
    value = "-" if v["value"] is None else fmt(v["value"])
    ci = "-" if v["ci"] is None else f"[{fmt(v['ci'][0])}, {fmt(v['ci'][1])}]"
    verdict = verdict_word(v)
    lines.append(f"| {v['target']} | {v['subject']} | {v['mode']} | {value} | {ci} | "
                 f"{v['need']} | {verdict} | {v['note']} |")
  return "\n".join(lines)


# Columns of the at-a-glance table: (header, target, mode); each cell is LoKA's ratio (speed)
# or log-loss change (quality) against what that target compares it with.
GLANCE = (("train vs bf16+Mods", "loka_not_slower_than_bf16_mods", "train"),
          ("train vs best peer", "loka_at_least_best_peer", "train"),
          ("infer vs bf16+Mods", "loka_not_slower_than_bf16_mods", "infer"),
          ("infer vs served bf16+Mods", "loka_not_slower_than_bf16_mods_served", "infer"),
          ("infer vs best peer", "loka_at_least_best_peer", "infer"),
          ("quality vs bf16+Mods (paired)", "loka_quality_vs_bf16_mods", "quality"),
          ("quality vs bf16 (paired)", "loka_quality_vs_bf16", "quality"),
          ("served quality vs served bf16+Mods", "loka_served_quality", "served"))


def _glance_cell(v: Mapping) -> str:
  if v["mode"] == "quality":   # the paired verdict, with the mean relative change
    return verdict_word(v) + ("" if v["value"] is None else f" ({_pct(v['value'])})")
  if v["value"] is None:
    return "-"
  text = {"served": f"{v['value']:+.3%}"}.get(v["mode"], f"{v['value']:.3f}x")  # relative
  return text + (" MISSED" if v["met"] is False else "")


def glance_table(verdicts: Sequence[Mapping]) -> str:
  """One line per target measured: LoKA against what its targets compare it with, and every
  target it misses (the full list, with CIs and notes, is `targets_table`). A synthetic
  quality subject shares its model's line."""
  subjects: List[str] = []
  cells: dict = {}
  missed: dict = {}
  for v in verdicts:
    subject = v["subject"].split(":", 1)[1] if v["subject"].startswith("synthetic:") \
        else v["subject"]
    if subject not in subjects:
      subjects.append(subject)
    cells[(subject, v["target"], v["mode"])] = v
    said = missed.setdefault(subject, [])
    text = (f"{v['target']} ({v['mode']})" if v["met"] is False else
            v["note"] if v["value"] is None and v["mode"] != "quality" else None)
    if text and text not in said:
      said.append(text)
  lines = ["| subject | " + " | ".join(h for h, _, _ in GLANCE) + " | missed |",
           "|---|" + "---|" * (len(GLANCE) + 1)]
  for subject in sorted(subjects):
    row = [_glance_cell(cells[key]) if key in cells else "-"
           for key in ((subject, t, m) for _, t, m in GLANCE)]
    lines.append(f"| {subject} | " + " | ".join(row) + " | "
                 + ("; ".join(missed.get(subject, [])) or "none") + " |")
  return "\n".join(lines)


QUALITY_RULE = (
    "Every quality verdict is paired by seed: at each seed an arm and its reference train from "
    "the same initialization, data order and held-out set. Per seed s, d_s = (arm - "
    "reference) / reference of held-out log loss; the 95% confidence interval of mean(d) is "
    "Student's t with n - 1 degrees of freedom. **Met**: the interval's upper end <= +0.02%. "
    "**Missed**: its lower end > +0.02%. Otherwise **unresolved**, with the paired seeds at "
    "which the half-width t(n-1) sd / sqrt(n) would put the interval wholly on one side of "
    "+0.02% at the measured mean (\"not resolvable\" where the mean sits at the margin; one "
    "seed measures no spread), with how many more that is and about how long they would "
    "run (per seed, the arm's and its reference's median training time on the rows' card). "
    "Being better than the reference is never a miss. A LoKA plan "
    "with no FP8 kernel runs its reference's program: **not applicable**. LoKA's verdicts are "
    "targets; naive FP8 and Flax delayed scaling everywhere are judged by the same rule beside "
    "it (peer). A subject of another Mods set than the default lists the verdicts its Mods "
    "change; those of two arms without Mods (naive FP8 against bf16) are under the default "
    "set's subject. The rule is `loka_jax.train.verdict.paired_quality`.")


def report(rows: Sequence[Mapping], verdicts: Sequence[Mapping],
           quality_runs: Sequence[str] = ()) -> str:
  """The whole markdown report: towers, models, quality (with `quality_runs`, the quality
  suites' run folders, also each run's training curve in numbers), targets."""
  parts: List[str] = ["# Benchmark results", ""]
  devices = sorted({r.get("device") for r in rows if r.get("device")})
  parts += [f"Devices: {', '.join(devices) or '-'}", ""]
  for suite, title in (("towers", "MLP towers"), ("models", "Models")):
    if any(r.get("suite") == suite for r in rows):
      parts += [f"## {title}", "", speed_table(rows, suite), ""]
  if any(r.get("suite") == "quality" for r in rows):
    parts += ["## Quality", "", QUALITY_RULE, "", quality_pairs.pairing_summary(rows), "",
              quality_verdicts_table(verdicts), "",
              "### Arms by seed", "", quality_table(rows), ""]
    curves = curves_table(rows, quality_runs)
    if curves:
      parts += ["### Training curves", "", curves, ""]
  if verdicts:
    parts += ["## Targets at a glance", "", glance_table(verdicts), "",
              "## Targets", "", targets_table(verdicts), ""]
  return "\n".join(parts)
