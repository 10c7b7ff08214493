"""Two or more kernel timing caches side by side: how far one card's measurements of the same
kernel passes agree (`compare_caches`, `experiments.timing_cache compare`) and one cache
made of several (`merge_caches`, `experiments.timing_cache merge`); `read_cache` opens one
of any card."""
from __future__ import annotations

import json
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from loka_jax.probe.candidates import BASELINE
from loka_jax.probe.eligibility import FUSED_SCOPE
from loka_jax.probe.kernel_timing import TimingCache, TimingCacheError, cache_key, usable


def read_cache(path: str) -> TimingCache:
  """The timing cache at `path`, of the card it names; TimingCacheError naming the file when
  it is not a readable timing cache."""
  try:
    with open(path) as f:
      kind = json.load(f).get("device_kind")
  except (OSError, ValueError, AttributeError) as e:
    raise TimingCacheError(f"{path}: not a readable timing cache ({e})") from e
  return TimingCache(path, kind)


def compare_caches(first: Mapping[str, Dict], second: Mapping[str, Dict]) -> Dict:
  """Two timing caches' entries ({key: entry}) of the same kernel passes, measured apart
  (say with one and with several compile workers): per entry both medians, their ratio
  (second / first) and whether the 95% CIs overlap; and per kernel pass its speedup over
  the baseline's same pass in each cache, which is what selection reads. `summary`: how many
  entries, the ratios' median and 5-95% range, the share of overlapping CIs, and the
  largest speedup change."""
  rows = []
  for key in sorted(set(first) & set(second)):
    a, b = first[key], second[key]
    if not (usable(a) and usable(b)):
      continue
    overlap = a["ci_us"][0] <= b["ci_us"][1] and b["ci_us"][0] <= a["ci_us"][1]
    row = {"kernel": a["kernel"], "pass": a["pass"], "lhs_shape": a["lhs_shape"],
           "rhs_shape": a["rhs_shape"], "first_us": a["median_us"],
           "second_us": b["median_us"], "ratio": b["median_us"] / a["median_us"],
           "ci_overlap": bool(overlap)}
    # A fused op's backward (both gradients in one call, filed under each gradient pass)
    # against the baseline's backward timed the same way, keyed by the grad_lhs problem.
    whole_bwd = a.get("time_scope") == FUSED_SCOPE
    base = (None if whole_bwd and a["pass"] != "grad_lhs" else
            cache_key(BASELINE, FUSED_SCOPE if whole_bwd else a["pass"], a["spec"],
                      a["lhs_shape"], a["rhs_shape"], a["dtype"]))
    if (a["kernel"] != BASELINE and base is not None and usable(first.get(base))
        and usable(second.get(base))):
      row["speedup_first"] = first[base]["median_us"] / a["median_us"]
      row["speedup_second"] = second[base]["median_us"] / b["median_us"]
    rows.append(row)
  if not rows:
    raise ValueError("compare_caches: the two caches share no measured kernel pass")
  ratios = np.array([r["ratio"] for r in rows])
  changes = [abs(r["speedup_second"] / r["speedup_first"] - 1) for r in rows
             if "speedup_first" in r]
  summary = {"entries": len(rows), "median_ratio": float(np.median(ratios)),
             "ratio_p5": float(np.percentile(ratios, 5)),
             "ratio_p95": float(np.percentile(ratios, 95)),
             "ci_overlap_share": float(np.mean([r["ci_overlap"] for r in rows])),
             "max_speedup_change": float(max(changes)) if changes else None}
  return {"rows": rows, "summary": summary}


def _problem(entry: Mapping) -> Tuple:
  return (entry["spec"], tuple(entry["lhs_shape"]), tuple(entry["rhs_shape"]), entry["dtype"])


def merge_caches(sources: Sequence[Mapping[str, Dict]]) -> Tuple[Dict[str, Dict], List[int]]:
  """One cache's entries from several of the same device kind ({key: entry} each, first
  first): each product problem (spec, shapes, dtype) takes every entry of the first source
  that timed it, so a problem's kernels and its baseline stay one interleaved measurement,
  never one source's kernel over another's baseline. Returns (entries, problems taken from
  each source). Models share shapes (DLRM and DCNv2 `large` share their bottom MLP and four
  top-MLP layers), and a probe finds a shape in its cache and does not time it again.
  A site shape timed whole by one source keeps all its problems from it, unless an earlier
  source timed another shape with one of the same problems: then a fused op's grad_rhs
  entry (its one-call backward) meets the baseline backward of another run."""
  owner: Dict[Tuple, int] = {}
  for i, entries in enumerate(sources):
    for entry in entries.values():
      owner.setdefault(_problem(entry), i)
  merged = {key: entry for i, entries in enumerate(sources) for key, entry in entries.items()
            if owner[_problem(entry)] == i}
  taken = [sum(1 for o in owner.values() if o == i) for i in range(len(sources))]
  return merged, taken
