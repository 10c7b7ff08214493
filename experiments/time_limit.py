"""A wall-clock limit for the entry points, given to the library as its `should_stop` hook.

The library's long jobs (probe, validation, ablation) ask `should_stop(expected_s)` before
each unit of work and leave what they did not start pending for a rerun; how much time a run
may take is the caller's business, decided here from a flag.
"""
from __future__ import annotations

import time
from typing import Callable, Optional


def stop_after(seconds: Optional[float], start: Optional[float] = None
               ) -> Optional[Callable[[float], bool]]:
  """A hook that stops work which would end more than `seconds` after `start` (default: now);
  None (no limit) for a missing or non-positive `seconds`."""
  if not seconds or seconds <= 0:
    return None
  end = (time.time() if start is None else start) + seconds
  return lambda expected_s: time.time() + expected_s > end
