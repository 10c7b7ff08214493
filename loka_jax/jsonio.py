"""Reading the project's JSON files (reports, plans) with errors that name the file."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Tuple, Type

GZIP_MAGIC = b"\x1f\x8b"


def read_json(path: str, what: str, remedy: str, error: Type[Exception]) -> Any:
  """Parses `path` (plain or gzipped); an unreadable, empty, truncated or corrupt file raises
  `error` naming the file, saying which `what` it was and what to do (`remedy`)."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise error(f"{path}: cannot read the {what} ({e}); check the path: {remedy}") from e
  if raw[:2] == GZIP_MAGIC:  # committed reports travel gzipped (docs/results/*.json.gz)
    try:
      raw = gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
      raise error(f"{path}: a damaged gzip file ({e}); the {what} is truncated or corrupt: "
                  f"{remedy}") from e
  if not raw.strip():
    raise error(f"{path}: the {what} file is empty (a run killed while writing it?): "
                f"{remedy}")
  try:
    return json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise error(f"{path}: not valid JSON ({e}); the {what} is truncated or corrupt: "
                f"{remedy}") from e


def jsonl_rows(path: str) -> Iterator[Tuple[int, Any, Optional[json.JSONDecodeError]]]:
  """(line number, value, None) for every non-blank line of a JSON-lines file, or (line
  number, None, the error) for one that does not parse: the caller decides whether such a
  line (an append cut by a killed run) is skipped or an error."""
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield number, json.loads(line), None
      except json.JSONDecodeError as e:
        yield number, None, e


def same_json(a: Any, b: Any) -> bool:
  """Whether two JSON-ready values are equal as JSON (key order aside)."""
  return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def write_json_atomic(path: str, data: Any, *, indent: int | None = 1,
                      sort_keys: bool = False) -> None:
  """Writes `data` to a temporary file and renames it over `path`, so a killed run never
  leaves half a file; NaN/Inf are refused (callers turn them into null + an error string)."""
  write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys,
                                     allow_nan=False) + "\n")


def write_text_atomic(path: str, text: str) -> None:
  """Writes `text` to a temporary file, flushed to disk, and renames it over `path`: a killed
  run leaves the old file or the new one, never half of either."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:   # a full disk, a quota: the old file is untouched
    if os.path.exists(tmp):
      os.remove(tmp)
    kept = "the previous one is intact" if os.path.exists(path) else "nothing was written"
    raise OSError(e.errno, f"cannot write {path} ({e.strerror or e}); {kept}") from e
  os.replace(tmp, path)


DIGEST_FIELD = "sha256"


def content_digest(data: Mapping) -> str:
  """sha256 of a JSON object's canonical form (sorted keys, no spaces), its own `sha256`
  field left out: a digest that travels inside the file it checks."""
  body = {k: v for k, v in data.items() if k != DIGEST_FIELD}
  return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                   allow_nan=False).encode()).hexdigest()


def with_digest(data: Mapping) -> Dict[str, Any]:
  """`data` with its `sha256` field set to its content digest."""
  return {**{k: v for k, v in data.items() if k != DIGEST_FIELD},
          DIGEST_FIELD: content_digest(data)}


def append_lines(path: str, lines: Iterable[str], sync: bool = False) -> None:
  """Appends each line (without its newline) to `path`, the first starting on a line of its
  own: a line a killed writer left torn stays a line by itself (skipped when read) rather
  than swallowing the first line appended after it. `sync`: flushed to disk before
  returning."""
  with open(path, "ab+") as f:
    if f.seek(0, os.SEEK_END):
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")
    for line in lines:
      f.write(line.encode() + b"\n")
    if sync:
      f.flush()
      os.fsync(f.fileno())


def append_rows(path: str, rows: Iterable[Mapping]) -> None:
  """Appends each row to the JSONL file at `path`, one line each with its `sha256`, flushed to
  disk before returning (a row a reader finds is whole; `append_lines`)."""
  append_lines(path, (json.dumps(with_digest(row)) for row in rows), sync=True)


def check_digest(data: Any, where: str, what: str, remedy: str,
                 error: Type[Exception]) -> None:
  """Raises `error` when `data` carries a `sha256` field that its content does not match: a
  changed byte or a deleted field that still parses. Files written before the field existed
  carry none and pass."""
  if not isinstance(data, Mapping) or DIGEST_FIELD not in data:
    return
  if data[DIGEST_FIELD] != content_digest(data):
    raise error(f"{where}: the {what} does not match its sha256 (changed or damaged after it "
                f"was written): {remedy}")


def file_sha256(path: str) -> str:
  """sha256 of a file's bytes, read in 1 MiB blocks (checksums of caches and exports)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()
