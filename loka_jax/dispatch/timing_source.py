"""Where selection takes its speedups from: the probe report's own timings, a committed timing
table of the target device, or none (`resolve_timing`).

The report's timings are used when it was timed on the target device (`timing_valid`);
otherwise the target device's committed table (nearest measured shape, marked `estimated`);
otherwise none. `fill_from_table` adds the report device's committed table beside a valid
report: the kernel passes the probe left untimed (judged unsafe before the statistics that
cleared them existed, dominated within its run, or not yet in its candidate list) take the
table's timing there, each speedup against the table's own bf16 time of that shape, so a plan
can be selected again once the card's table has timed them, without probing again.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from loka_jax.probe import timing_table as tables_lib


@dataclasses.dataclass(frozen=True)
class TimingSource:
  """Where selection takes speedups from: 'report', 'table' or 'none'; `table`, where set,
  is the table looked up (with kind 'report': the one filling the passes it left untimed)."""
  kind: str
  info: Dict[str, Any]
  table: Optional[Dict[str, Any]] = None

  @property
  def reason(self) -> str:
    return self.info.get("reason", "")


def same_device(a: Optional[str], b: Optional[str]) -> bool:
  if not a or not b:
    return False
  return tables_lib.file_name(a) == tables_lib.file_name(b)


def _given_table(timing_table, table_dir: str) -> Tuple[Optional[str], Optional[Dict]]:
  """(path, table) of an explicitly named table: a path, a device kind or a loaded table (a
  named table that is missing is an error)."""
  if isinstance(timing_table, Mapping):
    return "<in memory>", tables_lib.validate(dict(timing_table), "<timing table>")
  return tables_lib.choose_table(os.fspath(timing_table), table_dir)


def _of_device(committed: Mapping, device: str) -> Tuple[Optional[str], Optional[Dict]]:
  """(path, table) of `device` among the committed tables, or (None, None)."""
  match = [v for k, v in committed.items() if same_device(k, device)]
  return match[0] if match else (None, None)


def _report_with_fill(report, info: Dict[str, Any], timing_table, table_dir: str
                      ) -> TimingSource:
  """The report's timings, and for the passes it left untimed its device's table."""
  device = report.get("device")
  path, table = (_given_table(timing_table, table_dir) if timing_table is not None
                 else _of_device(tables_lib.committed_tables(table_dir), device))
  if table is None:
    info["note"] = f"no committed timing table of {device} to fill the untimed passes from"
    return TimingSource("report", info)
  if not same_device(table["device_kind"], device):
    raise tables_lib.TimingTableError(
        f"{path}: holds timings of {table['device_kind']!r}, not the report's {device!r}")
  info.update(fill_table=path, reason=info["reason"] + (
      f"; the kernel passes it left untimed from the committed table of {device} (each "
      "against that table's bf16; nearest measured shape where not exact: estimated)"))
  return TimingSource("report", info, table)


def resolve_timing(report, *, timing_table=None, target_device: Optional[str] = None,
                   table_dir: str = tables_lib.TIMINGS_DIR,
                   fill_from_table: bool = False) -> TimingSource:
  """The report's timings when valid for the target device (with `fill_from_table`, its
  untimed passes from its device's table: `timing_table` or the committed one); else a
  committed table (given as a path, a device kind or a loaded table; by default the target
  device's, else the one the report fell back on, else the widest committed one); else
  none."""
  device = report.get("device")
  if report.get("timing_valid") and (target_device is None or same_device(device,
                                                                         target_device)):
    info = {"kind": "report", "device": device,
            "reason": f"measured by the probe on {device}"}
    if fill_from_table:
      return _report_with_fill(report, info, timing_table, table_dir)
    if timing_table is not None:
      info["note"] = "an explicit timing table was ignored: the report's timings are valid"
    return TimingSource("report", info)
  why_not = (f"the report's timings are not valid for dispatch (timing_valid=false, made on "
             f"{device})" if not report.get("timing_valid") else
             f"the report was timed on {device}, not the target {target_device}")
  table, path = None, None
  if timing_table is not None:
    path, table = _given_table(timing_table, table_dir)
  else:
    wanted = target_device
    if wanted is None and (report.get("timing_source") or {}).get("kind") == "table":
      wanted = report["timing_source"].get("device_kind")  # the table the probe fell back on
    if wanted is None:
      chosen = tables_lib.choose_table(None, table_dir)  # the widest committed table
      if chosen is not None:
        path, table = chosen
    else:
      kinds = tables_lib.committed_tables(table_dir)
      path, table = _of_device(kinds, wanted)
      if table is None:
        return TimingSource("none", {
            "kind": "none", "device": wanted,
            "reason": f"{why_not} and no committed timing table for {wanted} (committed: "
                      f"{sorted(kinds) or 'none'})"})
  if table is None:
    return TimingSource("none", {"kind": "none", "device": target_device or device,
                                 "reason": f"{why_not} and no timing table is committed "
                                           f"in {table_dir}"})
  if target_device is not None and not same_device(table["device_kind"], target_device):
    raise tables_lib.TimingTableError(
        f"{path}: holds timings of {table['device_kind']!r}, not the target {target_device!r}")
  return TimingSource("table", {
      "kind": "table", "device": table["device_kind"], "path": path,
      "reason": f"{why_not}; timings from the committed table of {table['device_kind']} "
                "(nearest measured shape where not exact: estimated)"}, table)
