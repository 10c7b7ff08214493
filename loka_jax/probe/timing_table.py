"""Committed per-device kernel timing tables: `loka_jax/probe/timings/<device_kind>.json`.

GPU probe runs write them (merging with what is there); reports made where no GPU is at hand
(a CPU) fall back on them, taking the nearest measured shape and marking the number
`estimated`. Format (`loka.timings/1`):

  {"schema": "loka.timings/1", "device_kind": "NVIDIA H100 80GB HBM3",
   "entries": [{"kernel", "pass", "spec", "lhs_shape", "rhs_shape", "dtype", "median_us",
                "ci_us": [lo, hi], "backend", "repeats", "jax", "date"}, ...]}

`spec` is the pass's own einsum and the shapes are the pass's operands. One entry per
(kernel, pass, spec, lhs_shape, rhs_shape, dtype); a newer measurement replaces an older one.
An entry kept beside a newer run's entries of its problem carries `beside`: {kernel:
{"median_us", "ci_us"}}, the times of its own run that the newer run replaced, so its speedup
still divides two times of one run.

  python -m loka_jax.probe.timing_table merge DST.json SRC.json [SRC.json ...]
"""
from __future__ import annotations

import datetime
import math
import os
import sys
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from loka_jax import jsonio

SCHEMA = "loka.timings/1"
TIMINGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timings")
ENTRY_FIELDS = ("kernel", "pass", "spec", "lhs_shape", "rhs_shape", "dtype", "median_us",
                "ci_us", "backend")


class TimingTableError(ValueError):
  """A timing table that cannot be used: the message names the file and the problem."""


def file_name(device_kind: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'."""
  return "".join(c if c.isalnum() else "_" for c in device_kind) + ".json"


def table_path(device_kind: str, directory: str = TIMINGS_DIR) -> str:
  return os.path.join(directory, file_name(device_kind))


def entry_key(entry: Mapping) -> Tuple:
  return (entry["kernel"], entry["pass"], entry["spec"], tuple(entry["lhs_shape"]),
          tuple(entry["rhs_shape"]), entry.get("dtype", "bfloat16"))


def empty_table(device_kind: str) -> Dict:
  return {"schema": SCHEMA, "device_kind": device_kind, "entries": []}


def validate(table, where: str) -> Dict:
  """Raises TimingTableError naming `where` unless `table` is a loka.timings/1 table."""
  if not isinstance(table, dict):
    raise TimingTableError(f"{where}: expected a JSON object, got {type(table).__name__}")
  if table.get("schema") != SCHEMA:
    raise TimingTableError(f"{where}: schema {table.get('schema')!r}, expected {SCHEMA!r}")
  if not isinstance(table.get("device_kind"), str):
    raise TimingTableError(f"{where}: missing 'device_kind'")
  entries = table.get("entries")
  if not isinstance(entries, list):
    raise TimingTableError(f"{where}: 'entries' must be a list")
  for i, e in enumerate(entries):
    missing = [f for f in ENTRY_FIELDS if not isinstance(e, dict) or f not in e]
    if missing:
      raise TimingTableError(f"{where}: entry {i} lacks {missing}")
    if not _positive(e["median_us"]):
      raise TimingTableError(f"{where}: entry {i} ({e['kernel']}, {e['pass']}) has median_us "
                             f"{e['median_us']!r}; expected a positive number")
    beside = e.get("beside", {})
    if not (isinstance(beside, dict) and all(
        isinstance(t, dict) and _positive(t.get("median_us")) and isinstance(t.get("ci_us"), list)
        and len(t["ci_us"]) == 2 for t in beside.values())):
      raise TimingTableError(f"{where}: entry {i} ({e['kernel']}, {e['pass']}) has a malformed "
                             "'beside'; expected {kernel: {\"median_us\": positive, "
                             "\"ci_us\": [lo, hi]}}")
  return table


def _positive(value) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)


def load_table(path: str) -> Dict:
  """The table in `path` (validated; its sha256, when it has one, must match its content)."""
  remedy = "time the kernels again or restore the committed file"
  table = jsonio.read_json(path, "timing table", remedy, TimingTableError)
  jsonio.check_digest(table, path, "timing table", remedy, TimingTableError)
  if isinstance(table, dict):
    table.pop(jsonio.DIGEST_FIELD, None)
  return validate(table, path)


def committed_tables(directory: str = TIMINGS_DIR) -> Dict[str, Tuple[str, Dict]]:
  """{device_kind: (path, table)} of the committed tables, each read once."""
  out = {}
  if not os.path.isdir(directory):
    return out
  for name in sorted(os.listdir(directory)):
    if name.endswith(".json"):
      path = os.path.join(directory, name)
      table = load_table(path)
      out[table["device_kind"]] = (path, table)
  return out


def problem_key(entry: Mapping) -> Tuple:
  """What one measurement run times every kernel on: pass, spec, shapes and dtype."""
  return entry_key(entry)[1:]


def merge_entries(table: Mapping, entries: Iterable[Mapping]) -> Dict:
  """`table` with `entries` added. A speedup divides the baseline's time by a kernel's, and
  at launch-bound sizes two runs on the same card differ by more than the 1.05x eligibility
  margin (on the H200, bf16 at 4096x13x512: 35 us in one run, 60 us in another), so both
  times must come from one run. Where `entries` measure a problem (pass, spec, shapes,
  dtype) again, they replace the entries of the kernels they measured; an older entry of a
  kernel they did not measure stays, carrying in `beside` the times of its own run that
  they replaced (its baseline's among them), which `lookup` divides by. A table so keeps
  what each run learned: a probe that re-times a problem for one kernel does not send the
  next probe back to time the others."""
  entries = list(entries)
  for e in entries:
    missing = [f for f in ENTRY_FIELDS if f not in e]
    if missing:
      raise TimingTableError(f"timing entry for {e.get('kernel')} lacks {missing}")
  new_keys = {entry_key(e) for e in entries}
  remeasured = {problem_key(e) for e in entries}
  replaced: Dict[Tuple, Dict[str, Dict]] = {}
  for e in table["entries"]:
    if entry_key(e) in new_keys:
      replaced.setdefault(problem_key(e), {})[e["kernel"]] = {
          "median_us": e["median_us"], "ci_us": list(e["ci_us"])}
  merged: Dict[Tuple, Dict] = {}
  for e in table["entries"]:
    key = entry_key(e)
    if key in new_keys:
      continue
    kept = dict(e)
    if replaced.get(problem_key(e)):
      # Times this entry already carries are of its own run: a later replacement is not.
      kept["beside"] = {**replaced[problem_key(e)], **e.get("beside", {})}
    merged[key] = kept
  for e in entries:   # an entry that carries `beside` (another table's) keeps its own run's
    merged[entry_key(e)] = {**dict(e), "lhs_shape": list(e["lhs_shape"]),
                            "rhs_shape": list(e["rhs_shape"])}
  ordered = sorted(merged.values(), key=lambda e: (e["kernel"], e["pass"], e["spec"],
                                                    e["lhs_shape"], e["rhs_shape"]))
  return {"schema": SCHEMA, "device_kind": table["device_kind"], "entries": ordered}


def save_table(table: Mapping, path: str) -> None:
  """Writes atomically (a killed run never leaves half a table)."""
  validate(dict(table), path)
  jsonio.write_json_atomic(path, jsonio.with_digest(table))


def update_file(path: str, device_kind: str, entries: Sequence[Mapping]) -> Dict:
  """Merges `entries` into the table at `path` (created if absent) and saves it."""
  table = load_table(path) if os.path.exists(path) else empty_table(device_kind)
  if table["device_kind"] != device_kind:
    raise TimingTableError(f"{path} holds timings of {table['device_kind']!r}, not "
                           f"{device_kind!r}")
  table = merge_entries(table, entries)
  save_table(table, path)
  return table


def today() -> str:
  return datetime.date.today().isoformat()


# ----------------------------------------------------------------------------- lookup


def problem_sizes(spec: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]
                  ) -> Tuple[int, int, int, int]:
  """(batch, m, k, n) of a two-operand einsum: batch, lhs-free, contracted, rhs-free sizes."""
  inputs, out = spec.replace(" ", "").split("->")
  lhs, rhs = inputs.split(",")
  sizes = dict(zip(lhs, lhs_shape))
  sizes.update(zip(rhs, rhs_shape))
  prod = lambda labels: math.prod(int(sizes[i]) for i in labels)
  batch = "".join(i for i in lhs if i in rhs and i in out)
  contract = "".join(i for i in lhs if i in rhs and i not in out)
  m = "".join(i for i in lhs if i not in rhs)
  n = "".join(i for i in rhs if i not in lhs)
  return prod(batch), prod(m), prod(contract), prod(n)


def _distance(a, b) -> float:
  return sum(abs(math.log(max(x, 1)) - math.log(max(y, 1))) for x, y in zip(a, b))


def _flops(sizes) -> float:
  return 2.0 * math.prod(sizes)


def lookup(table: Mapping, kernel: str, pass_name: str, spec: str, lhs_shape, rhs_shape,
           dtype: str = "bfloat16", baseline: str = "xla_bf16") -> Optional[Dict]:
  """The kernel's time and speedup vs `baseline` for this problem, or None.

  Exact entries first; otherwise the nearest problem (log-size distance over batch, m, k, n;
  the same spec preferred) where both the kernel and the baseline were measured, with the
  time scaled by the FLOP ratio and the speedup taken as measured there (`estimated`: True).
  """
  want = problem_sizes(spec, lhs_shape, rhs_shape)
  by_key: Dict[Tuple, Dict] = {}
  for e in table["entries"]:
    if e["pass"] == pass_name and e.get("dtype", "bfloat16") == dtype:
      by_key[(e["kernel"], e["spec"], tuple(e["lhs_shape"]), tuple(e["rhs_shape"]))] = e
  candidates = []
  for (k, s, l, r), e in by_key.items():
    if k != kernel:
      continue
    # The baseline of the entry's own run: kept beside it where a later run replaced it.
    base = e.get("beside", {}).get(baseline) or by_key.get((baseline, s, l, r))
    if base is None:
      continue
    have = problem_sizes(s, l, r)
    exact = s == spec and l == tuple(lhs_shape) and r == tuple(rhs_shape)
    candidates.append((not exact, s != spec, _distance(want, have), e, base, have))
  if not candidates:
    return None
  inexact, _, _, e, base, have = min(candidates, key=lambda c: c[:3])
  scale = _flops(want) / _flops(have)
  speedup = base["median_us"] / e["median_us"]
  # Conservative range from the two medians' CIs (the raw samples are not committed).
  speedup_range = [base["ci_us"][0] / e["ci_us"][1], speedup, base["ci_us"][1] / e["ci_us"][0]]
  return {"time_us": e["median_us"] * scale,
          "ci_us": [c * scale for c in e["ci_us"]],
          "speedup": speedup, "speedup_range": speedup_range, "backend": e["backend"],
          "estimated": bool(inexact),
          "from": {"spec": e["spec"], "lhs_shape": list(e["lhs_shape"]),
                   "rhs_shape": list(e["rhs_shape"])}}


def choose_table(preferred: Optional[str] = None, directory: str = TIMINGS_DIR
                 ) -> Optional[Tuple[str, Dict]]:
  """(path, table) to fall back on: `preferred` (a path or device kind), else the committed
  table with the most entries (the widest cover of kernels and shapes, so the nearest measured
  shape is nearest); None when there is none."""
  if preferred:
    if os.path.exists(preferred):
      return preferred, load_table(preferred)
    tables = committed_tables(directory)
    for kind, chosen in tables.items():
      if preferred in (kind, file_name(kind)[:-5]):
        return chosen
    raise TimingTableError(f"no timing table {preferred!r}; committed: {sorted(tables) or 'none'}")
  tables = committed_tables(directory)
  if not tables:
    return None
  return max(tables.values(), key=lambda chosen: (len(chosen[1]["entries"]),
                                                  chosen[1]["device_kind"]))


def _main(argv: List[str]) -> int:
  if len(argv) < 3 or argv[0] != "merge":
    print(__doc__.strip().splitlines()[-1], file=sys.stderr)
    return 2
  dst, sources = argv[1], argv[2:]
  tables = [load_table(s) for s in sources]
  kinds = {t["device_kind"] for t in tables}
  if len(kinds) != 1:
    print(f"error: the sources hold different devices {sorted(kinds)}", file=sys.stderr)
    return 1
  merged = load_table(dst) if os.path.exists(dst) else empty_table(kinds.pop())
  for t in tables:
    if t["device_kind"] != merged["device_kind"]:
      print(f"error: {dst} holds {merged['device_kind']!r}, a source holds {t['device_kind']!r}",
            file=sys.stderr)
      return 1
    merged = merge_entries(merged, t["entries"])
  save_table(merged, dst)
  print(f"{dst}: {len(merged['entries'])} entries ({merged['device_kind']})")
  return 0


if __name__ == "__main__":
  sys.exit(_main(sys.argv[1:]))
