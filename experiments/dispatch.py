"""Dispatch: turn a ProbeReport into a Plan (per site and pass, the fastest eligible kernel).

  python -m experiments.dispatch --report=/tmp/wk_probe/probe_report.json --out=plan.json \
      [--metric=sqnr|mere --max_error=... --min_speedup=1.05 --target_device=...]
      [--objective=serve: forwards only, for the exported inference model
       [--serving_proposal=PATH: also the plan with every accurate-enough forward in FP8]]

Prints the per-site choice table (site, pass, kernel, reason) and writes the plan
(`loka.plan/1`, docs/FORMATS.md); train with it: `python -m experiments.train
--config.run.precision=loka --config.run.plan=plan.json ...`. By default the plan is checked
against the probed model (rebuilt from the report's run: --model, --preset, --mods, --data
override it), so a plan that does not fit fails here, listing every offending name.
"""
import json
import math
import os
import sys

from absl import app, flags

from experiments import common_flags as common
from loka_jax.plan import check as check_lib
from loka_jax.plan import file as plan_lib
from loka_jax.dispatch import selection
from loka_jax.probe.timing_table import TimingTableError
from loka_jax.probe import eligibility
from loka_jax.probe.report import ProbeReportError, load_report
from loka_jax.train import experiment

REPORT = flags.DEFINE_string("report", None, "ProbeReport (loka.probe/1) to select from.")
OUT = flags.DEFINE_string("out", None, "Where to write the plan (loka.plan/1).")
METRIC = flags.DEFINE_enum("metric", "sqnr", eligibility.METRICS,
                           "Accuracy by pessimistic SQNR (default) or MERE (paper parity).")
MAX_ERROR = flags.DEFINE_float(
    "max_error", None, "Largest acceptable error: with --metric=mere the MERE bound "
    "(default 0.2); with --metric=sqnr the relative RMS error, i.e. every pass needs SQNR >= "
    "-20 log10(max_error) dB (default: 25 dB fwd, 20 dB gradients).")
MIN_SQNR_FWD = flags.DEFINE_float("min_sqnr_fwd_db", None, "Forward SQNR bar (default 25 dB).")
MIN_SQNR_GRAD = flags.DEFINE_float("min_sqnr_grad_db", None,
                                   "Gradient SQNR bar (default 20 dB).")
MIN_SQNR_WGRAD = flags.DEFINE_float(
    "min_sqnr_wgrad_db", None, "Weight-gradient (grad_rhs) SQNR bar where it should differ "
    "from --min_sqnr_grad_db's, which then holds for the input gradient only (default: the "
    "same bar).")
MAX_UNDERFLOW = flags.DEFINE_float("max_underflow", None,
                                   "Largest underflow fraction of any operand (default 0.01).")
MIN_SPEEDUP = flags.DEFINE_float("min_speedup", 1.05,
                                 "Pessimistic speedup vs xla_bf16 a kernel needs; 0: accuracy "
                                 "only.")
SITE_BUDGETS = flags.DEFINE_string(
    "site_budgets", None, "Per-site budgets: JSON (text or file) {regex: {criteria field: "
    "value}}, e.g. '{\"top_mlp/.*\": {\"min_sqnr_fwd_db\": 30}}'; first fullmatch wins.")
TARGET_DEVICE = flags.DEFINE_string(
    "target_device", None, "Device kind the plan is for (default: the report's). Where the "
    "report's timings are not valid for it, its committed timing table is used.")
TIMING_TABLE = flags.DEFINE_string("timing_table", None,
                                   "Timing table (path or device kind) to use instead of the "
                                   "target device's committed one.")
OBJECTIVE = flags.DEFINE_enum(
    "objective", selection.TRAIN, selection.OBJECTIVES,
    "train: every pass (for --precision=loka); serve: forwards only, judged on the forward "
    "alone, for the exported inference model (`dispatch.export`); training refuses it.")
SERVING_PROPOSAL = flags.DEFINE_string(
    "serving_proposal", None, "With --objective=serve: also write the serving proposal here "
    "(`dispatch.serving_proposal`: every bf16 forward that is safe on accuracy alone and that "
    "the export serves as a static-scale e4m3 dot, in FP8). Untimed: time its export against "
    "the plan's before serving it (`experiments.bench --serve_plan` does, on a GPU).")
CHECK = flags.DEFINE_bool("check", True, "Check the plan against the probed model.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Batch of the check; 0: the report's run's.")


def criteria_from_flags() -> eligibility.Criteria:
  """The global budget (ValueError on bad values)."""
  fields = {"metric": METRIC.value,
            "min_speedup": MIN_SPEEDUP.value if MIN_SPEEDUP.value else None}
  if MAX_ERROR.value is not None:
    if MAX_ERROR.value <= 0:
      raise ValueError(f"--max_error={MAX_ERROR.value}: must be > 0")
    if METRIC.value == "mere":
      fields["max_mere"] = MAX_ERROR.value
    else:
      bar = -20.0 * math.log10(MAX_ERROR.value)
      fields.update(min_sqnr_fwd_db=bar, min_sqnr_grad_db=bar)
  for flag, name in ((MIN_SQNR_FWD, "min_sqnr_fwd_db"), (MIN_SQNR_GRAD, "min_sqnr_grad_db"),
                     (MIN_SQNR_WGRAD, "min_sqnr_wgrad_db"), (MAX_UNDERFLOW, "max_underflow")):
    if flag.value is not None:
      fields[name] = flag.value
  return eligibility.Criteria(**fields)


def site_budgets():
  """The --site_budgets JSON (text or a file), or None."""
  text = SITE_BUDGETS.value
  if not text:
    return None
  if os.path.exists(text):
    with open(text) as f:
      text = f.read()
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--site_budgets is not JSON ({e})") from None
  if not isinstance(value, dict):
    raise ValueError("--site_budgets must be a JSON object {regex: {field: value}}")
  return value


def _run_spec(report) -> experiment.RunSpec:
  """The probed run (from the report), with the common flags given on the command line."""
  run = report.get("run") or {}
  pick = lambda flag, key, default: flag.value if flag.present else run.get(key, default)
  mods = common.MODS.value if common.MODS.present else run.get("mods") or ()
  return experiment.RunSpec(
      model=pick(common.MODEL, "model", report.get("model")),
      preset=pick(common.PRESET, "preset", report.get("preset")),
      data=pick(common.DATA, "data", "synthetic"),
      data_spec=pick(common.DATA_SPEC, "data_spec", None),
      data_path=pick(common.DATA_PATH, "data_path", None),
      data_cache=common.DATA_CACHE.value, precision="bf16",
      mods=experiment.parse_mods(mods), seed=pick(common.SEED, "seed", 0))


def check_against_run(plan, report) -> str:
  """Checks the plan against the probed model; returns a one-line summary."""
  spec = _run_spec(report)
  batch_size = BATCH_SIZE.value or int((report.get("run") or {}).get("batch_size") or 0) or \
      experiment.preset_batch_size(spec.model, spec.preset)
  model, source, _ = experiment.build_run(spec)
  batch = source.train_batch(0, batch_size)
  products = check_lib.check_plan(plan, model, None, batch, where=OUT.value)
  return f"plan fits {spec.model}/{spec.preset} ({len(products)} sites, batch {batch_size})"


def _summary(plan) -> str:
  counts = plan_lib.kernel_counts(plan)
  lines = []
  for p, kernels in counts.items():
    text = ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items(), key=lambda kv: -kv[1]))
    lines.append(f"  {plan_lib.PASS_LABELS[p]}: {text or '-'}")
  ts = plan["provenance"].get("timing_source", {})
  return "\n".join([f"sites per kernel ({len(plan['sites'])} sites):"] + lines
                   + [f"timing source: {ts.get('kind')} ({ts.get('reason', '')})"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not REPORT.value or not OUT.value:
    raise app.UsageError("--report=PROBE_REPORT.json and --out=PLAN.json are required")
  if SERVING_PROPOSAL.value and OBJECTIVE.value != selection.SERVE:
    raise app.UsageError("--serving_proposal needs --objective=serve")
  try:
    criteria = criteria_from_flags()
    budgets = site_budgets()
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  try:
    report = load_report(REPORT.value)
    plan = selection.select(report, criteria, budget_per_site=budgets,
                            timing_table=TIMING_TABLE.value, target_device=TARGET_DEVICE.value,
                            objective=OBJECTIVE.value)
    plan = plan_lib.Plan({**plan.to_dict(), "provenance": {
        **plan["provenance"], "report_path": os.path.abspath(REPORT.value)}})
    checked = check_against_run(plan, report) if CHECK.value else "not checked (--nocheck)"
    proposal, proposed = (selection.serving_proposal(
        report, plan, criteria, budget_per_site=budgets, timing_table=TIMING_TABLE.value,
        target_device=TARGET_DEVICE.value) if SERVING_PROPOSAL.value else (None, []))
  except (ProbeReportError, TimingTableError, check_lib.PlanMismatchError,
          plan_lib.PlanFileError, experiment.PlanError, ValueError) as e:
    sys.exit(f"error: {e}")
  plan_lib.save_plan(plan, OUT.value)
  if proposal is not None:
    plan_lib.save_plan(proposal, SERVING_PROPOSAL.value)
  print(plan_lib.choice_table(plan))
  print()
  print(_summary(plan))
  print(f"check: {checked}")
  print(f"plan: {OUT.value}")
  if proposal is not None:
    print(f"serving proposal: {len(proposed)} more FP8 forward(s)"
          + (f" ({', '.join(proposed)})" if proposed else "")
          + f": {SERVING_PROPOSAL.value} (untimed: time its export against the plan's "
            "before serving it)")


if __name__ == "__main__":
  app.run(main)
