"""Resumable JSONL results: every finished row is appended at once, with the sha256 of its
content; a rerun skips it. A row that does not parse, or no longer matches its sha256, is
ignored with a warning and measured again."""
from __future__ import annotations

import os
from typing import Dict, Iterator, Mapping, Tuple

from loka_jax import jsonio


def checked_row(row, where: str) -> dict:
  """`row` without its sha256, which must match its content (rows written before rows
  carried one pass); else ValueError naming `where`."""
  jsonio.check_digest(row, where, "row", "measure it again", ValueError)
  return {k: v for k, v in row.items() if k != jsonio.DIGEST_FIELD} if isinstance(
      row, dict) else row


class ResultsFile:
  """Rows keyed by a tuple of fields; `done(key)` says whether a row already exists."""

  def __init__(self, path: str, key_fields: Tuple[str, ...]):
    self.path = path
    self.key_fields = key_fields
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._rows: Dict[tuple, dict] = {}
    if os.path.exists(path):
      for number, row, error in jsonio.jsonl_rows(path):
        if error is not None:
          # A line cut by a killed run: ignore it (it will be measured again), say so.
          print(f"warning: {path}:{number} is not JSON (an interrupted write?); ignored")
          continue
        try:
          row = checked_row(row, f"{path}:{number}")
        except ValueError as e:
          print(f"warning: {e}; ignored (it will be measured again)")
          continue
        self._rows[self.key(row)] = row

  def key(self, row: Mapping) -> tuple:
    return tuple(row.get(f) for f in self.key_fields)

  def done(self, key: tuple) -> bool:
    return key in self._rows

  def get(self, key: tuple):
    """The row of `key` (a copy), or None."""
    row = self._rows.get(key)
    return None if row is None else dict(row)

  def append(self, row: Mapping) -> None:
    jsonio.append_rows(self.path, [row])
    self._rows[self.key(row)] = dict(row)

  def rows(self) -> Iterator[dict]:
    return iter(self._rows.values())
