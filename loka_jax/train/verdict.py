"""Paired non-inferiority: is an arm no worse than its reference by more than a bound?

Each pair (one seed, or one held-out batch) gives the relative change
(arm - reference) / reference of a loss. With the 95% confidence interval of the mean change
(Student's t): *met* when its upper end is at most the bound, *missed* when its lower end is
above it, otherwise *unresolved*, with the number of pairs the measured spread says would
resolve it. Being better than the reference is never a miss.

`paired_quality` is the quality rule every verdict on held-out log loss uses (the bench's
quality targets, RESULTS): pairs are seeds, each arm and its reference trained from the same
initialization, data order and held-out set; the bound is +0.02% (`NEUTRAL_REL_LOGLOSS`). A
plan with no FP8 site runs its reference's program, so the rule does not apply to it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

MET, MISSED, UNRESOLVED = "met", "missed", "unresolved"
NOT_APPLICABLE = "not applicable"
VERDICTS = (MET, MISSED, UNRESOLVED, NOT_APPLICABLE)

# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); above 30 the normal
# quantile is within 4% of t's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
  if df < 1:
    raise ValueError(f"a confidence interval needs at least 2 pairs (df={df})")
  return _T975[df - 1] if df <= len(_T975) else 1.960


def relative_changes(arm: Sequence[float], reference: Sequence[float]) -> np.ndarray:
  """Per pair (arm - reference) / reference."""
  a, r = np.asarray(arm, np.float64), np.asarray(reference, np.float64)
  if a.shape != r.shape or a.ndim != 1:
    raise ValueError(f"paired values need equal 1-D shapes, got {a.shape} and {r.shape}")
  return (a - r) / r


# Beyond this many pairs a verdict is "not resolvable": the mean sits (nearly) on the bound.
MAX_PAIRS = 100_000


def _pairs_to_resolve(mean: float, sd: float, bound: float) -> Optional[int]:
  """Pairs whose interval would exclude the bound at this mean and spread (None: never, the
  mean sits on the bound)."""
  gap = abs(bound - mean)
  if gap == 0:
    return None
  resolves = lambda n: t975(n - 1) * sd / math.sqrt(n) < gap  # true from some n on
  hi = 2
  while not resolves(hi):
    if hi > MAX_PAIRS:
      return None
    hi *= 2
  lo = max(2, hi // 2)
  while lo < hi:  # the least n that resolves
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if resolves(mid) else (mid + 1, hi)
  return lo if lo <= MAX_PAIRS else None


def noninferiority(changes: Sequence[float], bound: float) -> Dict[str, Any]:
  """The verdict of paired relative changes against `bound` (e.g. 2e-4 for 0.02%)."""
  x = np.asarray(changes, np.float64)
  if x.ndim != 1 or len(x) < 2:
    raise ValueError(f"non-inferiority needs at least 2 paired changes, got {len(x)}")
  if not np.all(np.isfinite(x)):
    return {"verdict": MISSED, "n": len(x), "mean": None, "ci": None, "bound": bound,
            "error": "a paired change is not finite"}
  mean, sd = float(x.mean()), float(x.std(ddof=1))
  half = t975(len(x) - 1) * sd / math.sqrt(len(x))
  lo, hi = mean - half, mean + half
  verdict = MET if hi <= bound else MISSED if lo > bound else UNRESOLVED
  out = {"verdict": verdict, "n": len(x), "mean": mean, "ci": [lo, hi], "bound": bound}
  if verdict == UNRESOLVED:
    out["pairs_to_resolve"] = _pairs_to_resolve(mean, sd, bound)
  return out


def paired_by_seed(arm: Mapping[int, float], reference: Mapping[int, float]
                   ) -> Tuple[List[int], np.ndarray]:
  """(the seeds both arms hold, sorted; (arm - reference) / reference of each)."""
  seeds = sorted(set(arm) & set(reference))
  return seeds, relative_changes([arm[s] for s in seeds], [reference[s] for s in seeds])


def paired_quality(arm: Mapping[int, float], reference: Mapping[int, float],
                   bound: float = NEUTRAL_REL_LOGLOSS, applicable: bool = True
                   ) -> Dict[str, Any]:
  """The quality verdict of an arm against its reference from held-out log loss by seed
  ({seed: loss}; only seeds both hold pair): `noninferiority` of the paired relative
  changes against `bound`, plus `seeds` and `changes`. Fewer than two pairs measure no
  spread: unresolved, with `why` and no seed count. `applicable=False` (a plan with no FP8
  site): NOT_APPLICABLE, the changes still listed."""
  seeds, changes = paired_by_seed(arm, reference)
  listed = {"seeds": seeds, "changes": [float(c) for c in changes]}
  mean = float(changes.mean()) if len(changes) and np.all(np.isfinite(changes)) else None
  if not applicable:
    return {"verdict": NOT_APPLICABLE, "n": len(seeds), "mean": mean, "ci": None,
            "bound": bound, **listed}
  if len(seeds) < 2:
    return {"verdict": UNRESOLVED, "n": len(seeds), "mean": mean, "ci": None, "bound": bound,
            "pairs_to_resolve": None, **listed,
            "why": ("no seed holds both arms" if not seeds else
                    "one paired seed measures no spread; the seed count is sized from two")}
  return {**noninferiority(changes, bound), **listed}
