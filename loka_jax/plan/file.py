"""The Plan (`loka.plan/1`, docs/FORMATS.md): which kernel runs each pass of each site, and why.

A plan is JSON: per-site choices (each pass with its `kernel` and the `reason` it was chosen),
regex `rules` and a `default` for hand overrides, the `provenance` of the selection and the
`validation` steps that later changed it. `Plan` is a read-only view of that JSON; functions
that change a plan (`back_off`, `promote`, `add_validation`) return a new one.
`to_kernel_plan` compiles it to the static `KernelPlan` that sites read at trace time.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from loka_jax import jsonio
from loka_jax.kernels import FUSED_OP, registry
from loka_jax.kernels.choice import KernelChoice, KernelPlan
from loka_jax.kernels.spec import PASSES

SCHEMA = "loka.plan/1"
FALLBACK = "xla_bf16"  # the high-precision kernel a pass falls back to
PASS_LABELS = {"fwd": "fwd", "grad_lhs": "dgrad", "grad_rhs": "wgrad"}


class PlanFileError(ValueError):
  """A plan that cannot be read or is malformed; the message names the file and the problem."""


# ----------------------------------------------------------------------------- validation


class PlanMismatchError(ValueError):
  """A plan that does not fit a model; `problems` lists every one."""

  def __init__(self, where: str, problems: List[str]):
    self.problems = list(problems)
    if len(problems) == 1:  # one problem, one line
      super().__init__(f"plan {where} does not fit the model: {problems[0]}")
    else:
      super().__init__(f"plan {where} does not fit the model ({len(problems)} problems):\n  - "
                       + "\n  - ".join(problems))


def check_called(plan: KernelPlan, called: Sequence[str], model_name: str) -> None:
  """Raises PlanMismatchError when `plan` names sites a forward pass did not call (`called`:
  the site names it did): a plan selected for another model."""
  unknown = [name for name, _ in plan.sites if name not in set(called)]
  if unknown:
    shown = lambda names: ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    raise PlanMismatchError(
        f"for another model than this {model_name}",
        [f"it names {len(unknown)} site(s) the model does not call: {shown(unknown)}; the "
         f"model's sites are {shown(sorted(called)) or 'none'}; select a plan from this "
         "model's own probe report"])


def _choice_entry(value, where: str) -> Dict[str, Any]:
  """One pass of a site: {"kernel": name, "reason": ...}; a bare kernel name is accepted."""
  if isinstance(value, str):
    return {"kernel": value, "reason": "set by hand"}
  if not isinstance(value, dict) or not isinstance(value.get("kernel"), str) or not value["kernel"]:
    raise PlanFileError(f"{where}: expected a kernel name or {{\"kernel\": name, \"reason\": "
                        f"...}}, got {value!r}")
  out = dict(value)
  out.setdefault("reason", "set by hand")
  return out


def _passes(value, where: str, entries: bool) -> Dict[str, Any]:
  """All three passes of a site, a rule or the default (a missing pass is an error, never a
  silent fallback)."""
  if not isinstance(value, dict):
    raise PlanFileError(f"{where}: expected an object with the passes {list(PASSES)}, got "
                        f"{type(value).__name__}")
  unknown = sorted(set(value) - set(PASSES))
  missing = [p for p in PASSES if p not in value]
  if unknown or missing:
    problems = ([f"unknown pass(es) {unknown}"] if unknown else []) + (
        [f"missing pass(es) {missing}"] if missing else [])
    raise PlanFileError(f"{where}: {'; '.join(problems)}; give all of {list(PASSES)}")
  if entries:
    return {p: _choice_entry(value[p], f"{where}.{p}") for p in PASSES}
  for p in PASSES:
    if not isinstance(value[p], str) or not value[p]:
      raise PlanFileError(f"{where}.{p}: expected a kernel name, got {value[p]!r}")
  return {p: value[p] for p in PASSES}


def validate_plan(data, where: str = "<plan>") -> Dict[str, Any]:
  """The plan in normal form (optional fields filled in); raises PlanFileError naming `where`
  and the first problem."""
  if not isinstance(data, dict):
    raise PlanFileError(f"{where}: a plan is a JSON object, got {type(data).__name__}")
  schema = data.get("schema")
  if schema != SCHEMA:
    raise PlanFileError(
        f"{where}: schema {schema!r} is not {SCHEMA!r}"
        + ("; this file is not a plan (make one with `python -m experiments.dispatch`)"
           if schema is None else "; it was written by another version: select it again"))
  sites = data.get("sites")
  if not isinstance(sites, dict):
    raise PlanFileError(f"{where}: 'sites' must be an object {{site name: {{pass: choice}}}}")
  out = dict(data)
  out["sites"] = {}
  for name, value in sites.items():
    if not name:
      raise PlanFileError(f"{where}: empty site name")
    out["sites"][name] = _passes(value, f"{where}: sites[{name!r}]", entries=True)
  rules = data.get("rules", [])
  if not isinstance(rules, list):
    raise PlanFileError(f"{where}: 'rules' must be a list of {{\"pattern\", \"passes\"}}")
  out["rules"] = []
  for i, rule in enumerate(rules):
    here = f"{where}: rules[{i}]"
    if not isinstance(rule, dict) or not isinstance(rule.get("pattern"), str):
      raise PlanFileError(f"{here}: expected {{\"pattern\": regex, \"passes\": {{...}}}}")
    try:
      re.compile(rule["pattern"])
    except re.error as e:
      raise PlanFileError(f"{here}: pattern {rule['pattern']!r} is not a regex ({e})") from None
    out["rules"].append({**rule, "passes": _passes(rule.get("passes"), f"{here}.passes",
                                                   entries=False)})
  default = data.get("default")
  out["default"] = None if default is None else _passes(default, f"{where}: default",
                                                        entries=False)
  validation = data.get("validation", [])
  if not isinstance(validation, list):
    raise PlanFileError(f"{where}: 'validation' must be a list of steps")
  out["validation"] = list(validation)
  if "provenance" in out and not isinstance(out["provenance"], dict):
    raise PlanFileError(f"{where}: 'provenance' must be an object")
  out.setdefault("model", None)
  out.setdefault("provenance", {})
  return out


# ----------------------------------------------------------------------------- the Plan


class Plan(Mapping):
  """A validated `loka.plan/1` plan: a read-only mapping over its JSON data."""

  def __init__(self, data: Mapping, where: str = "<plan>"):
    if isinstance(data, Plan):
      data = data.to_dict()
    self._data = validate_plan(copy.deepcopy(data), where)

  def __getitem__(self, key):
    return self._data[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._data)

  def __len__(self) -> int:
    return len(self._data)

  def __repr__(self):
    return (f"Plan(model={self._data.get('model')!r}, sites={len(self._data['sites'])}, "
            f"rules={len(self._data['rules'])}, default={self.default_choice()})")

  def to_dict(self) -> Dict[str, Any]:
    """A deep copy of the JSON data."""
    return copy.deepcopy(self._data)

  def default_choice(self) -> Optional[KernelChoice]:
    d = self._data["default"]
    return None if d is None else KernelChoice.from_dict(d)

  def site_choice(self, site: str) -> Optional[KernelChoice]:
    """The exact entry of `site`, or None."""
    entry = self._data["sites"].get(site)
    return None if entry is None else KernelChoice(**{p: entry[p]["kernel"] for p in PASSES})

  def choice_for(self, site: str) -> Optional[KernelChoice]:
    """Exact entry, then the first rule that fullmatches, then the default (None: uncovered)."""
    choice = self.site_choice(site)
    if choice is not None:
      return choice
    for rule in self._data["rules"]:
      if re.fullmatch(rule["pattern"], site):
        return KernelChoice.from_dict(rule["passes"])
    return self.default_choice()

  def kernel_plan(self) -> KernelPlan:
    return to_kernel_plan(self)

  def kernel_names(self) -> List[str]:
    return self.kernel_plan().kernel_names()

  def kernel_digest(self) -> str:
    """sha256 of what the plan runs (each site's kernel per pass, the rules, the default),
    not of its reasons or provenance: two files that run the same kernels share it."""
    sites = {name: {p: entry[p]["kernel"] for p in PASSES}
             for name, entry in self._data["sites"].items()}
    what = {"sites": sites, "rules": self._data["rules"], "default": self._data["default"]}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


PlanLike = Union[Plan, Mapping, str, os.PathLike, KernelPlan]


def as_plan(plan, where: str = "<plan>") -> Plan:
  """A Plan from a Plan, its JSON dict or a file path."""
  if isinstance(plan, Plan):
    return plan
  if isinstance(plan, (str, os.PathLike)):
    return read_plan(os.fspath(plan))
  if isinstance(plan, Mapping):
    return Plan(plan, where)
  raise TypeError(f"expected a Plan, its JSON dict or a path, got {type(plan).__name__}")


def to_kernel_plan(plan: PlanLike) -> KernelPlan:
  """The static KernelPlan sites read. A plan without a default compiles with xla_bf16 as the
  default (KernelPlan always has one): `check_plan` is what reports uncovered sites."""
  if isinstance(plan, KernelPlan):
    return plan
  plan = as_plan(plan)
  sites = tuple(sorted((name, KernelChoice(**{p: e[p]["kernel"] for p in PASSES}))
                       for name, e in plan["sites"].items()))
  rules = tuple((r["pattern"], KernelChoice.from_dict(r["passes"])) for r in plan["rules"])
  default = plan.default_choice() or KernelChoice.uniform(FALLBACK)
  return KernelPlan(sites=sites, rules=rules, default=default)


# ----------------------------------------------------------------------------- files


def save_plan(plan: Union[Plan, Mapping], path: str) -> Dict[str, Any]:
  """Validates and writes the plan atomically; returns what was written."""
  data = as_plan(plan, path).to_dict()
  data.pop(jsonio.DIGEST_FIELD, None)
  jsonio.write_json_atomic(path, jsonio.with_digest(data))
  return data


def read_plan(path: str) -> Plan:
  """The Plan in `path`; an unreadable, empty, truncated, corrupt or wrong-schema file raises
  PlanFileError naming the file."""
  data = jsonio.read_json(path, "plan", "write it again with `python -m experiments.dispatch`",
                          PlanFileError)
  jsonio.check_digest(data, path, "plan", "select it again with `python -m experiments."
                      "dispatch`; after editing it by hand on purpose, delete its \"sha256\" "
                      "field", PlanFileError)
  if isinstance(data, dict):
    data.pop(jsonio.DIGEST_FIELD, None)   # the plan is its content; the digest is the file's
  return Plan(data, path)


def load_plan(path: str) -> KernelPlan:
  """The KernelPlan of the plan file `path` (what precision 'loka' runs with that plan)."""
  return to_kernel_plan(read_plan(path))


# ----------------------------------------------------------------------------- changes


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


def add_validation(plan: PlanLike, record: Mapping) -> Plan:
  """A new plan with `record` (one validation step, JSON data) appended to `validation`."""
  data = as_plan(plan).to_dict()
  data["validation"].append({"time": _now(), **dict(record)})
  return Plan(data)


def back_off(plan: PlanLike, site: str, pass_name: Optional[str], reason: str, *,
             to: str = FALLBACK, step: str = "back_off") -> Plan:
  """A new plan where `site` runs `pass_name` (None: every pass) with the more precise kernel
  `to`, recorded in `validation`. A site covered by a rule or the default gets an exact entry;
  a fused-op kernel runs all passes or none, so backing off one of its passes backs off all."""
  data = as_plan(plan).to_dict()
  current = Plan(data).choice_for(site)
  if current is None:
    raise ValueError(f"back_off: site {site!r} is not covered by the plan (no entry, rule or "
                     "default)")
  if pass_name is not None and pass_name not in PASSES:
    raise ValueError(f"back_off: unknown pass {pass_name!r}; passes are {PASSES}")
  registry.get(to)  # an unknown target fails here
  entry = data["sites"].get(site) or {
      p: {"kernel": current.for_pass(p), "reason": "from a rule or the default"} for p in PASSES}
  passes = list(PASSES) if pass_name is None else [pass_name]
  fused = [p for p in PASSES if _is_fused(entry[p]["kernel"])]
  if fused and any(p in fused for p in passes):
    passes = list(PASSES)
  changed = {p: entry[p]["kernel"] for p in passes if entry[p]["kernel"] != to}
  for p in changed:
    entry[p] = {"kernel": to, "reason": f"backed off from {changed[p]} ({step}): {reason}",
                "backed_off_from": changed[p]}
  data["sites"][site] = entry
  data["validation"].append({"time": _now(), "step": step, "site": site,
                             "passes": list(changed), "from": changed, "to": to,
                             "reason": reason})
  return Plan(data)


def promote(plan: PlanLike, sites: Sequence[str], kernel: str, reason: str, *,
            step: str = "promotion") -> Plan:
  """A new plan where each of `sites` runs `kernel` in every pass, recorded in `validation`
  as one entry: the opposite of `back_off`, for sites the plan runs in xla_bf16 that the
  whole step, not the site timed alone, shows to be faster on FP8 (validate.check_promotion)."""
  original = as_plan(plan)
  data = original.to_dict()
  registry.get(kernel)  # an unknown kernel fails here
  for site in sites:
    current = original.choice_for(site)
    if current is None or any(current.for_pass(p) != FALLBACK for p in PASSES):
      raise ValueError(f"promote: site {site!r} does not run {FALLBACK} in every pass")
    data["sites"][site] = {p: {"kernel": kernel, "reason": f"promoted from {FALLBACK} "
                                                           f"({step}): {reason}",
                               "promoted_from": FALLBACK} for p in PASSES}
  data["validation"].append({"time": _now(), "step": step, "sites": sorted(sites),
                             "to": kernel, "reason": reason})
  return Plan(data)


def _is_fused(name: str) -> bool:
  try:
    return registry.get(name).sort == FUSED_OP
  except KeyError:
    return False


# ----------------------------------------------------------------------------- text


def choice_rows(plan: PlanLike) -> List[List[str]]:
  """[site, pass, kernel, reason] rows: exact entries, then rules, then the default."""
  plan = as_plan(plan)
  rows = []
  for name, entry in plan["sites"].items():
    for p in PASSES:
      rows.append([name, PASS_LABELS[p], entry[p]["kernel"], entry[p].get("reason", "")])
  for rule in plan["rules"]:
    for p in PASSES:
      rows.append([f"rule {rule['pattern']}", PASS_LABELS[p], rule["passes"][p], "hand rule"])
  if plan["default"] is not None:
    for p in PASSES:
      rows.append(["(default)", PASS_LABELS[p], plan["default"][p], "sites not named above"])
  return rows


def choice_table(plan: PlanLike, max_site_width: int = 48) -> str:
  """The per-site choice table: site, pass, kernel, reason."""
  rows = choice_rows(plan)
  shown = [[r[0] if len(r[0]) <= max_site_width else "..." + r[0][-(max_site_width - 3):]]
           + r[1:] for r in rows]
  header = ["site", "pass", "kernel", "reason"]
  widths = [max(len(r[i]) for r in shown + [header]) for i in range(3)]
  line = lambda r: "  ".join([c.ljust(w) for c, w in zip(r[:3], widths)] + [r[3]]).rstrip()
  return "\n".join([line(header), "-" * (sum(widths) + 6 + len("reason"))]
                   + [line(r) for r in shown])


def kernel_counts(plan: PlanLike) -> Dict[str, Dict[str, int]]:
  """{pass: {kernel: number of exact site entries}} (how many sites run each kernel)."""
  plan = as_plan(plan)
  out: Dict[str, Dict[str, int]] = {p: {} for p in PASSES}
  for entry in plan["sites"].values():
    for p in PASSES:
      out[p][entry[p]["kernel"]] = out[p].get(entry[p]["kernel"], 0) + 1
  return out


def site_names(plan: PlanLike) -> Sequence[str]:
  return list(as_plan(plan)["sites"])
