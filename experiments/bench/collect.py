"""Benchmark rows gathered from several result files: the input of a report over many GPU calls.

The benchmark appends each row to the JSONL file of the run that measured it, and a target
measured over many GPU calls (or again, after a fix) leaves its rows in several committed
files. `read_rows` merges them in the order given: a later row with the key of an earlier
one (`suite.KEY_FIELDS` for speed rows, `quality.KEY_FIELDS` for quality rows) replaces it,
so listing files oldest first keeps each row's latest measurement. Unlike a run's own
results file, where a line cut by a killed write is skipped and measured again, a committed
file that does not parse is an error: nothing would measure the lost row again.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Sequence

from loka_jax import jsonio
from experiments.bench import quality, results, suite

SPEED_SUITES = ("towers", "models")


class RowsError(ValueError):
  """A results file that cannot be read as benchmark rows (the message names the file)."""


def row_key(row: Mapping) -> tuple:
  """The key a later row of the same measurement shares with an earlier one."""
  fields = quality.KEY_FIELDS if row["suite"] == "quality" else suite.KEY_FIELDS
  return tuple(row.get(f) for f in fields)


def _read_file(path: str) -> List[Dict]:
  if not os.path.isfile(path):
    raise RowsError(f"results file {path} does not exist")
  rows = []
  for number, row, error in jsonio.jsonl_rows(path):
    if error is not None:
      raise RowsError(f"{path}:{number} is not a JSON row ({error})") from error
    if not isinstance(row, dict) or row.get("suite") not in SPEED_SUITES + ("quality",):
      raise RowsError(f"{path}:{number} is not a benchmark row: its 'suite' is "
                      f"{row.get('suite') if isinstance(row, dict) else None!r}, expected "
                      f"one of {SPEED_SUITES + ('quality',)}")
    try:
      rows.append(results.checked_row(row, f"{path}:{number}"))
    except ValueError as e:
      raise RowsError(str(e)) from e
  return rows


def read_rows(paths: Sequence[str], device: Optional[str] = None) -> List[Dict]:
  """Rows of every file in order, a later row replacing an earlier one of the same key;
  `device`: only rows measured on that device kind (e.g. 'NVIDIA H200')."""
  merged: Dict[tuple, Dict] = {}
  for path in paths:
    for row in _read_file(path):
      if device is None or row.get("device") == device:
        merged[row_key(row)] = row
  return list(merged.values())


def devices(rows: Sequence[Mapping]) -> List[str]:
  return sorted({r["device"] for r in rows if r.get("device")})
