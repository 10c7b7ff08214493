"""When a benchmark row or quality run may start inside a GPU call of fixed length.

A call has a soft deadline (`pacing.max_minutes`) and a hard end (`pacing.end_by_minutes`:
its limit less the upload), at which the call is killed and whatever it was compiling is
lost. A fixed deadline must allow for the longest row, so it either leaves a call idle when
rows are short or lets a long one start too late: InterFormer `large`'s FP8 rows (a 96-127 s
compile, 2-3 minutes a row, H200) were killed at the hard end in two calls running, each
losing its compile. So once a row's length is known from the rows before it, it starts
exactly when it is expected to end in time.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

# A recorded time is a compile and a run on a host that may have had a warm compile cache; a
# fresh host compiles again, so the longest recorded time gets this margin.
MARGIN = 1.15


def expected_s(recorded: Iterable[Tuple[str, Optional[float]]], kind: str) -> Optional[float]:
  """How long the next row (or run) of `kind` may take, from `recorded` (kind, seconds)
  pairs, a pair without seconds skipped: the longest of its own kind's times, else of any
  kind's, times MARGIN; None before the first."""
  times = [(k, t) for k, t in recorded if isinstance(t, (int, float))]
  pool = [t for k, t in times if k == kind] or [t for _, t in times]
  return MARGIN * max(pool) if pool else None


def may_start(now: float, deadline: float, end_by: Optional[float],
              expected: Optional[float]) -> Tuple[bool, str]:
  """(whether a row may start now, why not). Without `end_by` (the call's hard end) or a
  time to expect, none starts after `deadline` (`pacing.max_minutes`). With both, a row starts
  whenever it is expected to end by `end_by`, also after `deadline`, and none that would
  not, also before it."""
  if end_by is not None and expected is not None:
    if now + expected <= end_by:
      return True, ""
    return False, (f"it may take {expected:.0f} s (the longest so far, with margin) and "
                   f"{max(end_by - now, 0.0):.0f} s are left")
  if now > deadline:
    return False, "past pacing.max_minutes"
  return True, ""
