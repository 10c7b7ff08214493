"""The rows of `experiments.report probe_overhead` (experiments/tools/overhead_run.py): the
statistics pass against the training step, from the JSON `experiments.measure
probe_overhead` writes. No flags, so tests and other tools import it freely."""
from typing import Any, Dict, Optional

from loka_jax import jsonio

MEASURED_IN = "experiments.measure probe_overhead"
# What a measurement must hold to make a row.
NEEDED = ("device", "jax", "model", "preset", "batch_size", "sites", "probe_config", "step_ms",
          "pass_ms", "pass_first_call_s", "parts_ms")

# The ProbeConfig fields a row states (`group_sites` is read as off where absent).
CONFIG_FIELDS = ("cadence", "weight_every", "one_program", "pass_compile")


class OverheadRowError(ValueError):
  """A measurement that cannot make a row (the message names the file and what is missing)."""


def row(path: str, commit: str, command: Optional[str] = None,
        date: Optional[str] = None) -> Dict[str, Any]:
  """One probe_overhead row from the JSON at `path`. The measurement's own date and command
  line are kept unless `date` or `command` are given (a measurement that records neither
  needs both)."""
  measured = jsonio.read_json(path, "probe-overhead measurement",
                              "give the JSON experiments.measure probe_overhead wrote "
                              "with --out", OverheadRowError)
  if not isinstance(measured, dict):
    raise OverheadRowError(f"{path}: not a probe-overhead measurement (a JSON object)")
  missing = [k for k in NEEDED if k not in measured]
  if missing:
    raise OverheadRowError(f"{path}: not a probe-overhead measurement: no {', '.join(missing)} "
                           f"(it is the JSON experiments.measure probe_overhead --out writes)")
  date, command = date or measured.get("date"), command or measured.get("command")
  if not date or not command:
    raise OverheadRowError(f"{path}: records no {'date' if not date else 'command'}; give it "
                           "(--date, --command)")
  config = measured["probe_config"]
  lacking = [k for k in CONFIG_FIELDS if not isinstance(config, dict) or k not in config]
  if lacking:
    raise OverheadRowError(f"{path}: its probe_config lacks {', '.join(lacking)} (the "
                           "ProbeConfig fields experiments.measure probe_overhead records)")
  return {"kind": "probe_overhead", "model": measured["model"], "preset": measured["preset"],
          "device": measured["device"], "jax": measured["jax"], "date": date,
          "commit": commit, "command": command, "measured_in": MEASURED_IN,
          "cadence": config["cadence"], "batch_size": measured["batch_size"],
          "sites": measured["sites"], "weight_every": config["weight_every"],
          "one_program": config["one_program"], "group_sites": config.get("group_sites", False),
          "pass_compile": config["pass_compile"],
          "first_call_s": measured["pass_first_call_s"], "pass_ms": measured["pass_ms"],
          "extract_ms": measured["parts_ms"].get("extract"), "step_ms": measured["step_ms"],
          **_update_parts(measured["parts_ms"])}


def _update_parts(parts_ms: Dict[str, float]) -> Dict[str, Any]:
  """{"parts_ms": ...} of a measurement taken with --parts (the update's parts beside the
  extract stage, each jitted alone and summed over the sites); nothing for one without."""
  return {"parts_ms": dict(parts_ms)} if set(parts_ms) - {"extract"} else {}
