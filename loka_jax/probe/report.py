"""ProbeReport (`loka.probe/2`, docs/FORMATS.md): build, save, load, validate, summarize.

The report is plain JSON. Non-finite numbers never enter it as numbers: they become null and
the enclosing object gets an `error` string. Loading checks the schema and the structure and
names the file and the first problem found.
"""
from __future__ import annotations

import datetime
import math
from typing import Dict, List, Mapping

import numpy as np

from loka_jax import jsonio
from loka_jax.kernels import KINDS, PASSES
from loka_jax.probe import eligibility

SCHEMA = "loka.probe/2"
# Versions this reader accepts. A loka.probe/1 report may have judged delayed-scaling ops
# with a scale history warmed on the sample itself (no `evaluation.evaluator`); every field
# reads the same otherwise.
READABLE_SCHEMAS = ("loka.probe/1", SCHEMA)
TRIPLETS = ("sqnr_db", "rel_fro", "mere", "median_rel", "underflow", "time_us", "speedup",
            "baseline_us")
REQUIRED = {"model": str, "preset": str, "device": str, "jax": str, "timing_valid": bool,
            "sites": dict}
PASS_LABELS = {"fwd": "fwd", "grad_lhs": "dgrad", "grad_rhs": "wgrad"}


class ProbeReportError(ValueError):
  """A report that cannot be used; the message names the file and what is wrong."""


# ----------------------------------------------------------------------------- JSON safety


def _non_finite(value) -> bool:
  return isinstance(value, (float, np.floating)) and not math.isfinite(float(value))


def _clean(obj, path: str, bad: List[str]):
  if isinstance(obj, dict):
    out, broken = {}, []
    for k, v in obj.items():
      if k in TRIPLETS and isinstance(v, (list, tuple, np.ndarray)) and any(
          _non_finite(x) for x in np.asarray(v, dtype=object).ravel()):
        broken.append(f"{k}={[float(x) for x in v]}")  # a CI with a hole is no CI: null
        out[str(k)] = None
        continue
      out[str(k)] = _clean(v, f"{path}.{k}" if path else str(k), bad)
    if broken:
      message = "non-finite " + ", ".join(broken)
      out["error"] = f"{out['error']}; {message}" if out.get("error") else message
    return out
  if isinstance(obj, (list, tuple)):
    return [_clean(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
  if isinstance(obj, (np.bool_, bool)):
    return bool(obj)
  if isinstance(obj, (np.integer, int)):
    return int(obj)
  if isinstance(obj, (np.floating, float)):
    value = float(obj)
    if not math.isfinite(value):
      bad.append(f"{path}={value}")
      return None
    return value
  if isinstance(obj, np.ndarray):
    return _clean(obj.tolist(), path, bad)
  if obj is None or isinstance(obj, str):
    return obj
  raise TypeError(f"report field {path}: {type(obj).__name__} is not JSON data")


def json_ready(report: Mapping) -> Dict:
  """A copy fit for JSON: numpy scalars converted, non-finite floats -> null + `errors`."""
  bad: List[str] = []
  out = _clean(dict(report), "", bad)
  if bad:
    out.setdefault("errors", []).append(
        "non-finite values replaced by null: " + ", ".join(bad[:20])
        + (f" (+{len(bad) - 20} more)" if len(bad) > 20 else ""))
  return out


def save_report(report: Mapping, path: str) -> Dict:
  """Validates and writes the report atomically; returns what was written."""
  data = json_ready(report)
  validate_report(data, path)
  jsonio.write_json_atomic(path, jsonio.with_digest(data))
  return data


def load_report(path: str) -> Dict:
  """Reads and validates a ProbeReport; raises ProbeReportError naming the file."""
  remedy = "rerun `python -m experiments.probe` to rewrite it"
  data = jsonio.read_json(path, "probe report", remedy, ProbeReportError)
  jsonio.check_digest(data, path, "probe report", remedy, ProbeReportError)
  if isinstance(data, dict):
    data.pop(jsonio.DIGEST_FIELD, None)   # the report is its content; the digest is the file's
  validate_report(data, path)
  return data


def _check_triplet(value, where: str):
  if value is None:
    return
  if not (isinstance(value, list) and len(value) in (2, 3)
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  for v in value)):
    raise ProbeReportError(f"{where}: expected null or [lo, mid, hi] finite numbers, got "
                           f"{value!r}")
  if value[0] > value[-1] * (1 + 1e-9) + 1e-12:
    raise ProbeReportError(f"{where}: lower bound {value[0]} above upper bound {value[-1]}")


def validate_report(report, where: str) -> None:
  """Raises ProbeReportError naming `where` and the first problem."""
  if not isinstance(report, dict):
    raise ProbeReportError(f"{where}: a probe report is a JSON object, got "
                           f"{type(report).__name__}")
  schema = report.get("schema")
  if schema not in READABLE_SCHEMAS:
    raise ProbeReportError(
        f"{where}: schema {schema!r} is not one of {', '.join(map(repr, READABLE_SCHEMAS))}"
        + ("; this file is not a probe report" if schema is None else
           "; it was written by another version: rerun `python -m experiments.probe`"))
  for key, typ in REQUIRED.items():
    if key not in report:
      raise ProbeReportError(f"{where}: missing field {key!r}")
    if not isinstance(report[key], typ):
      raise ProbeReportError(f"{where}: field {key!r} must be {typ.__name__}, got "
                             f"{type(report[key]).__name__}")
  for name, site in report["sites"].items():
    here = f"{where}: site {name!r}"
    if not isinstance(site, dict):
      raise ProbeReportError(f"{here}: expected an object")
    if site.get("kind") not in KINDS:
      raise ProbeReportError(f"{here}: kind {site.get('kind')!r} is not one of {KINDS}")
    shapes = site.get("shapes")
    if not isinstance(shapes, dict) or any(
        not isinstance(shapes.get(k), list) for k in ("lhs", "rhs", "out")):
      raise ProbeReportError(f"{here}: 'shapes' must hold lhs, rhs and out lists")
    passes = site.get("passes")
    if not isinstance(passes, dict):
      raise ProbeReportError(f"{here}: 'passes' must be an object")
    for p, kernels in passes.items():
      if p not in PASSES:
        raise ProbeReportError(f"{here}: unknown pass {p!r}; passes are {PASSES}")
      if not isinstance(kernels, dict):
        raise ProbeReportError(f"{here}, {p}: expected {{kernel: entry}}")
      for k, entry in kernels.items():
        if not isinstance(entry, dict):
          raise ProbeReportError(f"{here}, {p}, {k}: expected an object")
        for field in TRIPLETS:
          _check_triplet(entry.get(field), f"{here}, {p}, {k}, {field}")


# ----------------------------------------------------------------------------- building


def new_report(*, model: str, preset: str, device: str, device_kind: str, platform: str,
               jax_version: str, timing_valid: bool, timing_source: Mapping,
               run: Mapping, probe_config: Mapping, evaluation: Mapping, criteria: Mapping,
               overhead: Mapping, kernels: Mapping, excluded_kernels: Mapping) -> Dict:
  return {"schema": SCHEMA, "model": model, "preset": preset, "device": device,
          "device_kind": device_kind, "platform": platform, "jax": jax_version,
          "created": datetime.datetime.now().isoformat(timespec="seconds"),
          "timing_valid": bool(timing_valid), "timing_source": dict(timing_source),
          "complete": True, "pending": [], "run": dict(run), "probe": dict(probe_config),
          "evaluation": dict(evaluation), "criteria": dict(criteria),
          "overhead": dict(overhead), "kernels": dict(kernels),
          "excluded_kernels": dict(excluded_kernels), "sites": {}, "errors": []}


def attach_best(report: Dict, criteria: eligibility.Criteria) -> None:
  """Adds each site's `best` kernel per pass (and its verdict) under the given criteria."""
  for site in report["sites"]:
    verdicts = eligibility.assess_site(report, site, criteria)
    report["sites"][site]["best"] = {}
    for p, v in verdicts.items():
      best = eligibility.best_kernel(v)
      report["sites"][site]["best"][p] = {
          "kernel": best.kernel, "eligible": best.eligible, "safe": best.safe,
          "fast": best.fast, "sqnr_db_lo": best.sqnr_lo,
          "speedup_lo": best.speedup_lo, "speedup": best.speedup_mid,
          "rejected": {k: list(x.reasons) for k, x in v.items() if not x.eligible}}


# ----------------------------------------------------------------------------- text


def _shape(site: Mapping) -> str:
  s = site["shapes"]
  fmt = lambda t: "x".join(str(d) for d in t)
  return f"{fmt(s['lhs'])} . {fmt(s['rhs'])}"


def _best_cell(site: Mapping, p: str) -> str:
  best = site.get("best", {}).get(p)
  if not best:
    return "-"
  entry = site["passes"].get(p, {}).get(best["kernel"], {})
  sqnr = entry.get("sqnr_db")
  speed = entry.get("speedup")
  text = best["kernel"]
  text += f" {sqnr[0]:.1f}dB" if sqnr else ""
  text += f" x{speed[1]:.2f}{_scope_note(entry)}" if speed else ""
  if not best.get("eligible") and best.get("safe") and best.get("fast") is None \
      and best["kernel"] != "xla_bf16":
    text += " (safe, speed unknown)"
  return text


def _scope_note(entry: Mapping) -> str:
  """Marks a fused op's backward: timed once for both gradients, so its speedup is the whole
  backward's over the baseline's (`speedup_vs` says how that was timed), not this pass's."""
  return " (whole bwd)" if entry.get("time_scope") else ""


def site_table(report: Mapping, max_site_width: int = 44) -> str:
  """The per-site table the CLI prints: site, shape, best (safe) kernel per pass with its
  pessimistic SQNR and median speedup."""
  rows = []
  for name, site in report["sites"].items():
    shown = name if len(name) <= max_site_width else "..." + name[-(max_site_width - 3):]
    rows.append([shown, _shape(site)] + [_best_cell(site, p) for p in PASSES])
  header = ["site", "shape"] + [PASS_LABELS[p] for p in PASSES]
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  return "\n".join([line(header), "-" * len(line(header))] + [line(r) for r in rows])


def _fmt(v, spec: str, default: str = "-") -> str:
  return default if v is None else format(v, spec)


def _source_medians(entry: Mapping) -> str:
  """'G / R': the median SQNR of the entry's Gaussian and reservoir draws (the pessimistic
  column combines them; where they part, the reservoir's real pairs usually tell why)."""
  def median(source):
    sq = ((entry.get("sources") or {}).get(source) or {}).get("sqnr_db")
    return _fmt(sq and sq[1], ".1f")
  return f"{median('gaussian')} / {median('reservoir')}"


def markdown(report: Mapping) -> str:
  """A readable summary: setup, overhead, best kernel per site and pass, then details."""
  ov = report.get("overhead", {})
  ts = report.get("timing_source", {})
  lines = [f"# Probe report: {report['model']} `{report['preset']}`", "",
           f"- device: {report['device']} ({report.get('platform')}), jax {report['jax']}, "
           f"created {report.get('created')}",
           "- timing: "
           f"{'valid for dispatch' if report['timing_valid'] else 'NOT valid for dispatch'}"
           f" (source: {ts.get('kind')}"
           f"{', ' + ts['device_kind'] if ts.get('device_kind') else ''})",
           f"- run: {report['run'].get('steps')} steps, batch {report['run'].get('batch_size')}, "
           f"data {report['run'].get('data')}, precision {report['run'].get('precision')}",
           f"- statistics: {ov.get('observations')} observations every "
           f"{ov.get('gap') or ov.get('cadence')} steps; "
           f"probe pass {_fmt(ov.get('probe_ms'), '.1f')} ms vs step "
           f"{_fmt(ov.get('step_ms'), '.1f')} ms -> overhead "
           f"{_fmt(None if ov.get('fraction') is None else 100 * ov['fraction'], '.2f')}% "
           f"(compile {_fmt(ov.get('compile_s'), '.1f')} s, once)",
           f"- evaluation: {report['evaluation'].get('samples')} Gaussian + "
           f"{report['evaluation'].get('reservoir_samples')} reservoir samples per site; "
           f"criteria {report.get('criteria')}",
           ""]
  if not report.get("complete", True):
    lines += [f"**Incomplete**: pending {', '.join(report.get('pending', []))}; rerun the same "
              "command to finish.", ""]
  lines += ["## Best kernel per site and pass", "",
            "(the fastest eligible kernel; where speed is unknown, the most accurate safe one; "
            "xla_bf16 when none qualifies. Pessimistic SQNR, median speedup vs xla_bf16)", "",
            "| site | kind | shape | fwd | dgrad | wgrad |", "|---|---|---|---|---|---|"]
  for name, site in report["sites"].items():
    lines.append(f"| `{name}` | {site['kind']} | {_shape(site)} | "
                 + " | ".join(_best_cell(site, p) for p in PASSES) + " |")
  lines += ["", "## Flush hazards (underflow > 1% of an operand under a kernel)", ""]
  hazards = []
  for name, site in report["sites"].items():
    for p, kernels in site["passes"].items():
      for k, e in kernels.items():
        for op, o in (e.get("operands") or {}).items():
          u = o.get("underflow")
          if u is not None and u[-1] > 0.01:
            hazards.append(f"- `{name}` {PASS_LABELS[p]} {k}: {op} underflow "
                           f"{100 * u[1]:.1f}% (CI up to {100 * u[-1]:.1f}%)")
  lines += hazards[:200] or ["none"]
  lines += ["", "## Details", ""]
  for name, site in report["sites"].items():
    ev = site.get("evaluation", {})
    lines += [f"### `{name}` ({site['kind']}, `{site['spec']}`, {_shape(site)})", "",
              f"evaluated on {ev.get('slices')} of {ev.get('of')} entries along "
              f"`{ev.get('slice_index')}`; reservoir: {ev.get('reservoir', {})}", "",
              "| kernel | pass | SQNR dB [lo, hi] | SQNR dB Gaussian / reservoir (median) | MERE "
              "| underflow (max) | time us (median) | speedup [lo, hi] | backend |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p, kernels in site["passes"].items():
      for k, e in kernels.items():
        sq, me, uf, sp, t = (e.get(f) for f in ("sqnr_db", "mere", "underflow", "speedup",
                                                "time_us"))
        lines.append(
            f"| {k} | {PASS_LABELS[p]} | "
            + (f"{sq[1]:.1f} [{sq[0]:.1f}, {sq[2]:.1f}]" if sq else (e.get("error") or "-"))
            + f" | {_source_medians(e)} | {_fmt(me and me[1], '.3g')} | "
            + f"{_fmt(uf and uf[-1], '.3f')} | {_fmt(t and t[1], '.1f')} | "
            + (f"{sp[1]:.2f} [{sp[0]:.2f}, {sp[2]:.2f}]{_scope_note(e)}" if sp else "-")
            + f" | {e.get('backend') or '-'} |")
    lines.append("")
  if report.get("errors"):
    lines += ["## Errors", ""] + [f"- {e}" for e in report["errors"]]
  return "\n".join(lines) + "\n"
