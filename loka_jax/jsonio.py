"""Reading the project's JSON files (reports, plans) with errors that name the file."""
from __future__ import annotations

import json
from typing import Any, Type


def read_json(path: str, what: str, remedy: str, error: Type[Exception]) -> Any:
  """Parses `path`; an unreadable, empty, truncated or corrupt file raises `error` naming the
  file, saying which `what` it was and what to do (`remedy`)."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise error(f"{path}: cannot read the {what} ({e})") from e
  if not raw.strip():
    raise error(f"{path}: the {what} file is empty")
  try:
    return json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise error(f"{path}: not valid JSON ({e}); the {what} is truncated or corrupt: "
                f"{remedy}") from e
