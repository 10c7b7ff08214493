r"""How far each quality verdict's paired changes spread from seed to seed, by recipe and by
whether the arm and its reference train with the same Mods.

  python3 -m experiments.report paired_spread docs/results/quality_movielens_*_cpu_*.jsonl

Per verdict (`experiments.bench.quality_pairs.judge_all`, the rule RESULTS judges by): its
paired seeds, mean change, and the standard deviation of the per-seed changes, which sets how
many seeds resolve it. Then that spread's range and median over the pairs whose arms share
their Mods (one architecture) and over the others; one arm's log loss alone from seed to
seed (its relative standard deviation); and, for each comparison the rows hold under more
than one recipe (warm-up, clipping, cooldown), its first recipe's spread over each other's,
with their geometric mean and the ratio of the summed variances.
"""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Mapping, Sequence

from absl import app

from experiments.bench import collect, quality, quality_pairs


def _same_mods(arm: str, reference: str) -> bool:
  return quality.ARMS[arm].mods == quality.ARMS[reference].mods


def spreads(rows: Sequence[Mapping]) -> List[Dict]:
  """One entry per verdict with two or more paired seeds: its comparison, arm, reference,
  seeds, mean and standard deviation of the changes, and whether the two share their Mods."""
  out = []
  for c, v in quality_pairs.judge_all(rows):
    if len(v["changes"]) >= 2:
      out.append({"comparison": c, "arm": v["arm"], "reference": v["reference"],
                  "n": len(v["changes"]), "mean": v["mean"],
                  "sd": statistics.stdev(v["changes"]),
                  "same_mods": _same_mods(v["arm"], v["reference"])})
  return out


def arm_spreads(rows: Sequence[Mapping]) -> List[float]:
  """Each comparison's arms' relative standard deviation of log loss over their seeds (two
  or more seeds)."""
  out = []
  for c in quality.comparisons(rows):
    for arm in quality.ARMS:
      losses = [r["logloss"] for r in quality_pairs.rows_by_seed(rows, c, arm).values()]
      if len(losses) >= 2:
        out.append(statistics.stdev(losses) / statistics.mean(losses))
  return out


def recipe_ratios(entries: Sequence[Mapping]) -> List[Dict]:
  """For each (data, model, preset, Mods set, arm, reference) under several recipes: the
  first recipe's spread over each other's (recipes in order, the plain one first)."""
  by_subject: Dict[tuple, Dict[tuple, Mapping]] = {}
  for e in entries:
    c = e["comparison"]
    by_subject.setdefault((c.data, c.model, c.preset, c.mods_set, e["arm"], e["reference"]),
                          {})[(c.warmup_steps, c.clip_norm, c.cooldown_steps)] = e
  out = []
  for recipes in by_subject.values():
    first, *others = [recipes[k] for k in sorted(recipes)]
    out += [{"first": first, "other": o, "ratio": first["sd"] / o["sd"]} for o in others]
  return out


def _pct(x: float) -> str:
  return f"{100 * x:.2f}%"


def _range(values: Sequence[float], what: str = "verdicts") -> str:
  return (f"{_pct(min(values))}-{_pct(max(values))} (median {_pct(statistics.median(values))}, "
          f"{len(values)} {what})") if values else "none"


def report(rows: Sequence[Mapping]) -> str:
  entries = spreads(rows)
  lines = ["| subject | arm | vs | same Mods | paired seeds | mean change | sd of the changes |",
           "|---|---|---|---|---|---|---|"]
  for e in entries:
    lines.append(f"| {e['comparison'].subject} | {quality_pairs.LABELS[e['arm']]} | "
                 f"{quality_pairs.LABELS[e['reference']]} | {'yes' if e['same_mods'] else 'no'} "
                 f"| {e['n']} | {100 * e['mean']:+.3f}% | {_pct(e['sd'])} |")
  lines += ["", "spread of the paired changes, arms with the same Mods: "
            + _range([e["sd"] for e in entries if e["same_mods"]]),
            "spread of the paired changes, arms with other Mods: "
            + _range([e["sd"] for e in entries if not e["same_mods"]]),
            "one arm's log loss from seed to seed (relative sd): "
            + _range(arm_spreads(rows), "arms")]
  ratios = recipe_ratios(entries)
  if ratios:
    values = [r["ratio"] for r in ratios]
    pooled = (sum(r["first"]["sd"] ** 2 for r in ratios)
              / sum(r["other"]["sd"] ** 2 for r in ratios))
    lines.append(f"first recipe's spread over another's, {len(values)} comparisons: "
                 f"{min(values):.2f}-{max(values):.2f}, geometric mean "
                 f"{math.exp(statistics.mean(math.log(x) for x in values)):.2f}; summed "
                 f"variances {pooled:.2f}")
  return "\n".join(lines)


def main(argv):
  paths = argv[1:]
  if not paths:
    raise app.UsageError("give one or more quality row files (JSONL)")
  rows = [r for r in collect.read_rows(paths) if r.get("suite") == "quality"]
  if not rows:
    raise app.UsageError(f"{', '.join(paths)}: no quality rows")
  print(report(rows))
