"""The benchmark's targets as a function of the result rows: met or missed, with the number and CI;
quality by the paired rule, which may also leave a target unresolved or not applicable.

Speed ratios between two variants of one target come from their rows' raw samples, each
normalized by the bf16 baseline timed beside it (ratio = speedup_a / speedup_b), bootstrapped;
LoKA's ratios to the variants it is judged against come from the two timed in one
interleaving instead, where its row has that (`head_to_head`, see `over`).
"not slower" means the ratio's CI lower bound >= 0.98.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from experiments.bench import mods_set
from experiments.bench import quality_pairs, served_check
from experiments.bench.variants import PEERS
from loka_jax.train import verdict as verdict_lib
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

NOT_SLOWER = 0.98
MODES = ("train", "infer")
WUKONG_LARGE = {"train": 1.25, "infer": 1.5}
OVER_BEST_SINGLE = 1.05
SERVED = "bf16_mods_served"


def _boot_speedup(s: Mapping, rng, n_boot: int) -> np.ndarray:
  v = np.asarray(s["samples_us"], float)
  b = np.asarray(s["baseline_samples_us"], float)
  vb = np.median(rng.choice(v, size=(n_boot, v.size)), axis=1)
  bb = np.median(rng.choice(b, size=(n_boot, b.size)), axis=1)
  return bb / vb


def ratio(row_a: Mapping, row_b: Mapping, mode: str, *, n_boot: int = 2000,
          seed: int = 0) -> Dict[str, float]:
  """Speed of variant a over variant b (time_b / time_a) with a bootstrap 95% CI."""
  a, b = row_a[mode], row_b[mode]
  point = float(a["speedup"] / b["speedup"])
  if not all(k in s for s in (a, b) for k in ("samples_us", "baseline_samples_us")):
    lo, hi = (a["speedup_ci"][0] / b["speedup_ci"][1], a["speedup_ci"][1] / b["speedup_ci"][0])
    return {"ratio": point, "ci": [float(lo), float(hi)]}
  rng = np.random.default_rng(seed)
  r = _boot_speedup(a, rng, n_boot) / _boot_speedup(b, rng, n_boot)
  return {"ratio": point, "ci": [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]}


def interleaved_references(subject: str, variants: Mapping[str, Mapping]) -> List[str]:
  """The variants a target compares `subject` (LoKA) with, among its finished rows
  (`variants`: {variant: row}, one `speed_index` entry): bf16+Mods, served bf16+Mods and each
  mode's best peer. The bench times `subject` against each in one interleaving
  (`head_to_head`)."""
  others = {n: r for n, r in variants.items() if n != subject}
  names = [n for n in ("bf16_mods", SERVED) if n in others]
  for mode in MODES:
    best = _best_peer(others, mode)
    if best is not None and best not in names:
      names.append(best)
  return names


def over(row_a: Mapping, row_b: Mapping, mode: str) -> Dict:
  """Variant a's speed over b: from their timing in one interleaving where a's row has it
  (`head_to_head`, flagged `interleaved`), else the ratio of their rows (`ratio`)."""
  pair = (row_a.get("head_to_head") or {}).get(row_b["variant"], {}).get(mode)
  if pair:
    return {"ratio": float(pair["ratio"]), "ci": [float(c) for c in pair["ci"]],
            "interleaved": True}
  return ratio(row_a, row_b, mode)


def speed_index(rows: Sequence[Mapping]) -> Dict[Tuple, Dict[str, Mapping]]:
  """{(suite, model, preset, device, Mods-set label): {variant: row}} of the finished speed
  rows (the label None for the default Mods set)."""
  out: Dict[Tuple, Dict[str, Mapping]] = {}
  for r in rows:
    if r.get("suite") in ("towers", "models") and "error" not in r and "train" in r:
      key = (r["suite"], r["model"], r["preset"], r["device"], mods_set.of_row(r))
      out.setdefault(key, {})[r["variant"]] = r
  return out


def _sort_key(item) -> Tuple:
  (suite, model, preset, device, set_label), _ = item
  return (suite, model, preset, device, set_label or "")


# The fewest timings of one program in one call whose spread a note reports.
MIN_SPREAD_TIMINGS = 3


def timing_spread(row: Mapping, mode: str) -> Optional[Tuple[float, float, int]]:
  """(lowest, highest, count) of the medians of `row`'s own step, in microseconds, over its
  timings in one call: its pair with bf16 and each pair of its `head_to_head`; None below
  MIN_SPREAD_TIMINGS of them. Each pair's CI says how well that pair is resolved, not how far
  the same program moves between pairs: at DCNv2 `large` (H200) LoKA's train step read
  11.5-12.5 ms over five timings in one call (8.0% apart) while its pairs' CIs spanned
  1.6-4.3%."""
  medians = []
  samples = (row.get(mode) or {}).get("samples_us")
  if samples:
    medians.append(float(np.median(samples)))
  for pair in (row.get("head_to_head") or {}).values():
    median = (pair.get(mode) or {}).get("median_us")
    if median:
      medians.append(float(median))
  if len(medians) < MIN_SPREAD_TIMINGS:
    return None
  return min(medians), max(medians), len(medians)


def spread_note(spread: Optional[Tuple[float, float, int]], ci: Sequence[float]) -> str:
  """A note when LoKA's step moved more over its timings in the call (`timing_spread`) than
  a ratio's CI is wide, relative to its lower end; '' otherwise."""
  if spread is None:
    return ""
  low, high, count = spread
  if high / low - 1.0 <= ci[1] / ci[0] - 1.0:
    return ""
  return (f"LoKA's own step read {low / 1e3:.3g}-{high / 1e3:.3g} ms over its {count} "
          f"timings in this call ({high / low - 1.0:.1%} apart), wider than this CI")


def _verdict(target: str, subject: str, mode: str, value: Optional[Dict], met: Optional[bool],
             need: str, note: str = "",
             spread: Optional[Tuple[float, float, int]] = None) -> Dict:
  if value is not None and value.get("interleaved"):
    note = "; ".join(n for n in (note, "timed in one interleaving",
                                 spread_note(spread, value["ci"])) if n)
  return {"target": target, "subject": subject, "mode": mode,
          "value": None if value is None else value["ratio"],
          "ci": None if value is None else value["ci"],
          "met": met, "need": need, "note": note}


def _best_peer(variants: Mapping[str, Mapping], mode: str) -> Optional[str]:
  peers = [p for p in PEERS if p in variants]
  return max(peers, key=lambda p: variants[p][mode]["speedup"]) if peers else None


def same_program_as_bf16_mods(loka_row: Mapping) -> bool:
  """Whether the LoKA row trained with xla_bf16 at every site (its `kernels`), i.e. ran the
  very bf16+Mods train step."""
  kernels = loka_row.get("kernels") or []
  return bool(kernels) and set(kernels) == {"xla_bf16"}


def exports_every_site_high(loka_row: Mapping) -> bool:
  """Whether the LoKA row served an export with every site "high" (its `export_modes`; a
  serving plan may put FP8 forwards under a bf16 training plan), i.e. the very served
  bf16+Mods model. Rows from before `export_modes` fall back on the training kernels."""
  modes = loka_row.get("export_modes")
  if modes is not None:
    return {m for m, n in modes.items() if n} == {"high"}
  return same_program_as_bf16_mods(loka_row)


def _identical_programs(r: Mapping, what: str, same_as: str) -> Tuple[bool, str]:
  """(met, note) of a ratio between two identical programs: they can only differ by timing
  noise, which a CI holding 1.0 shows; a CI excluding 1.0 is a measurement problem, not a
  slowdown, and is reported as not met."""
  met = r["ci"][0] <= 1.0 <= r["ci"][1]
  return met, (f"LoKA's plan is bf16 everywhere, so its {what} is {same_as}: "
               + ("the ratio's CI holds 1.0, timing noise" if met else
                  "yet the CI excludes 1.0, a measurement problem to look into"))


def _served_quality(subject: str, loka: Mapping,
                    reports: Mapping[served_check.ReportKey, Mapping]) -> Tuple[List[Dict],
                                                                                Optional[str]]:
  """(the served-quality verdict of the model LoKA's row served, where one measured it; why
  its inference verdicts do not count: a served model outside the quality budget)."""
  score = served_check.for_row(loka, reports)
  if score is None:
    return [], None
  need = "|served change| <= budget"
  if "mismatch" in score:
    return [_verdict("loka_served_quality", subject, "served", None, None, need,
                     "not applied: " + score["mismatch"])], None
  value = {"ratio": score["rel_logloss_change"], "ci": [-score["budget"], score["budget"]]}
  verdict = _verdict("loka_served_quality", subject, "served", value, score["within_budget"],
                     need, served_check.describe(score))
  return [verdict], (None if score["within_budget"] else
                     "not counted: the inference was timed on a served model outside the "
                     "quality budget, " + served_check.describe(score))


def _void_inference(verdicts: List[Dict], why: Optional[str]) -> List[Dict]:
  """`verdicts` with every inference verdict missed (and `why` in its note) when `why`."""
  if why is None:
    return verdicts
  return [v if v["mode"] != "infer" else
          {**v, "met": False if v["met"] is not None else None,
           "note": "; ".join(n for n in (v["note"], why) if n)} for v in verdicts]


def check_speed(rows: Sequence[Mapping],
                served_reports: Optional[Mapping[served_check.ReportKey, Mapping]] = None
                ) -> List[Dict]:
  """The speed targets for every target that has a LoKA row, and the quality of the model its
  inference served (`served_check`: the row's own gate score, else `served_reports`)."""
  out = []
  for (_, model, preset, _, set_label), variants in sorted(speed_index(rows).items(),
                                                          key=_sort_key):
    subject = mods_set.subject(model, preset, set_label)
    verdicts = _speed_verdicts(subject, model, preset, variants)
    loka = variants.get("loka")
    if loka is not None:
      served, why = _served_quality(subject, loka, served_reports or {})
      verdicts = _void_inference(verdicts, why) + served
    out.extend(verdicts)
  return out


def _speed_verdicts(subject: str, model: str, preset: str,
                    variants: Mapping[str, Mapping]) -> List[Dict]:
  """One target's speed verdicts (`variants`: its finished rows by variant)."""
  out = []
  loka = variants.get("loka")
  for mode in MODES:
    if loka is None:
      out.append(_verdict("loka_not_slower_than_bf16_mods", subject, mode, None, None,
                          f"CI low >= {NOT_SLOWER}", "no LoKA row yet"))
      continue
    spread = timing_spread(loka, mode)
    if "bf16_mods" in variants:
      r = over(loka, variants["bf16_mods"], mode)
      met, note = r["ci"][0] >= NOT_SLOWER, ""
      if not met and mode == "train" and same_program_as_bf16_mods(loka):
        met, note = _identical_programs(r, "train step", "the bf16+Mods step")
      out.append(_verdict("loka_not_slower_than_bf16_mods", subject, mode, r, met,
                          f"CI low >= {NOT_SLOWER}", note, spread))
    if mode == "infer" and SERVED in variants:
      # LoKA infers from its export (weights stored once in e4m3 or bf16); bf16+Mods served
      # the same way separates what FP8 gains from what storing the weights once gains.
      r = over(loka, variants[SERVED], mode)
      met, note = r["ci"][0] >= NOT_SLOWER, "both infer from exported weights"
      if not met and exports_every_site_high(loka):
        met, note = _identical_programs(r, "exported model", "served bf16+Mods'")
      out.append(_verdict(f"loka_not_slower_than_{SERVED}", subject, mode, r, met,
                          f"CI low >= {NOT_SLOWER}", note, spread))
    best = _best_peer(variants, mode)
    if best is not None:
      r = over(loka, variants[best], mode)
      out.append(_verdict("loka_at_least_best_peer", subject, mode, r,
                          r["ci"][0] >= NOT_SLOWER, f"CI low >= {NOT_SLOWER}",
                          f"best peer: {best}", spread))
      out.append(_verdict("loka_over_best_single_kernel", subject, mode, r,
                          r["ratio"] >= OVER_BEST_SINGLE, f">= {OVER_BEST_SINGLE}x",
                          f"best single kernel everywhere: {best}", spread))
    if model == "wukong" and preset == "large":
      for base in ("bf16_mods", "bf16", SERVED):
        if base not in variants or (base == SERVED and mode == "train"):
          continue
        r = over(loka, variants[base], mode)
        need = WUKONG_LARGE[mode]
        # The bar is set over bf16+Mods; over plain bf16 (and served bf16+Mods, for
        # inference) it is reported beside it.
        out.append(_verdict(f"wukong_large_over_{base}", subject, mode, r,
                            r["ratio"] >= need if base == "bf16_mods" else None,
                            f">= {need}x" if base == "bf16_mods" else "reported",
                            spread=spread))
  return out


def check_quality(rows: Sequence[Mapping]) -> List[Dict]:
  """LoKA's quality against bf16+Mods and bf16 by the paired rule (`quality_pairs.judge`):
  `verdict` met, missed, unresolved or not applicable (a plan with no FP8 site); `met` True or
  False only where the rule resolved it. The naive and delayed FP8 arms are judged by the
  same rule beside it (reported: `judged` False, `met` None)."""
  out = []
  for c, v in quality_pairs.judge_all(rows):
    judged = v["arm"] == "loka"
    met = {verdict_lib.MET: True, verdict_lib.MISSED: False}.get(v["verdict"]) \
        if judged else None
    out.append({"target": f"{v['arm']}_quality_vs_{v['reference']}", "subject": c.subject,
                "mode": "quality", "value": v["mean"], "ci": v["ci"], "met": met,
                "verdict": v["verdict"], "judged": judged,
                "need": QUALITY_NEED if judged else "reported (same rule)",
                "note": quality_note(v), "n": v["n"], "seeds": v["seeds"],
                "changes": v["changes"], "seeds_needed": v.get("pairs_to_resolve"),
                "seed_s": v.get("seed_s")})
  return out


QUALITY_NEED = (f"95% CI of the mean paired change <= +{100 * NEUTRAL_REL_LOGLOSS:g}% "
                "(missed: its low end above)")


def seeds_needed_text(v: Mapping) -> str:
  """How many paired seeds would resolve an unresolved verdict, in words ('' otherwise)."""
  if v["verdict"] != verdict_lib.UNRESOLVED:
    return ""
  if v.get("why"):
    return v["why"]
  need = v.get("pairs_to_resolve")
  return ("not resolvable: the mean sits at the margin" if need is None else
          f"{need} paired seeds would resolve it at this mean and spread")


def quality_note(v: Mapping) -> str:
  """The paired seeds, each seed's change, its runs' worst training steps where recorded (a
  mean over three seeds can rest on one spike: DCNv2 `large` on an H200), seeds left
  unpaired and why, and what would resolve an unresolved verdict."""
  parts = [f"seeds {v['seeds']}" + ("" if not v["seeds"] else ": by seed " + ", ".join(
      f"{100 * d:+.3f}%" for d in v["changes"]))]
  peaks = v.get("peaks") or {}
  if v["seeds"] and all(p is not None for ps in peaks.values() for p in ps):
    parts.append("worst step's training loss by seed " + "; ".join(
        f"{a} " + ", ".join(f"{p:.3g}" for p in ps) for a, ps in peaks.items()))
  if v.get("unpaired"):
    parts.append("not paired: " + ", ".join(f"seed {s} ({why})"
                                            for s, why in v["unpaired"].items()))
  if v["verdict"] == verdict_lib.NOT_APPLICABLE:
    parts.append("the plan runs no FP8 kernel (it trains bf16+Mods' program)")
  elif v.get("fp8") is None:
    parts.append("the plan's kernels are not recorded: judged as an FP8 plan")
  if v.get("twin_seeds"):
    parts.append(f"at seeds {v['twin_seeds']} its rows are the bf16+Mods runs")
  parts.append(seeds_needed_text(v))
  return "; ".join(p for p in parts if p)


def check_all(rows: Sequence[Mapping],
              served_reports: Optional[Mapping[served_check.ReportKey, Mapping]] = None
              ) -> List[Dict]:
  return check_speed(rows, served_reports) + check_quality(rows)
