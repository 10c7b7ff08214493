r"""Dispatch: turn a ProbeReport into a Plan (per site and pass, the fastest eligible kernel).

  python3 -m experiments.dispatch --config.report=/tmp/wk_probe/probe_report.json \
      --config.out=plan.json [--config.select.metric=mere --config.select.max_error=0.1 ...]
  python3 -m experiments.dispatch --config.report=... --config.out=plan_serve.json \
      --config.select.objective=serve [--config.serving_proposal=proposal.json]

Settings come from experiments/configs/dispatch.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). Prints the per-site choice table (site, pass,
kernel, reason) and writes the plan (`loka.plan/1`, docs/FORMATS.md); train with it:
`python3 -m experiments.train --config.run.precision=loka --config.run.plan=plan.json ...`.
By default the plan is checked against the probed model (rebuilt from the report's run; the
config's `run` fields override it), so a plan that does not fit fails here, listing every
offending name; a serving plan (objective serve) keeps every gradient in bf16.
"""
import json
import os
import sys

from absl import app, flags

from experiments import run_config
from loka_jax.dispatch import selection
from loka_jax.plan import check as check_lib
from loka_jax.plan import file as plan_lib
from loka_jax.probe import eligibility
from loka_jax.probe.report import ProbeReportError, load_report
from loka_jax.probe.timing_table import TimingTableError
from loka_jax.train import experiment

CONFIG = run_config.define_config_flag("dispatch")
flags.adopt_module_key_flags(run_config)  # --help lists --config


def criteria(select) -> eligibility.Criteria:
  """The global budget of the config's `select` group (ValueError on bad values)."""
  return eligibility.criteria_for_error(
      select.max_error, select.metric, select.min_speedup or None,
      min_sqnr_fwd_db=select.min_sqnr_fwd_db, min_sqnr_grad_db=select.min_sqnr_grad_db,
      min_sqnr_wgrad_db=select.min_sqnr_wgrad_db, max_underflow=select.max_underflow)


def site_budgets(text):
  """The per-site budgets of `select.site_budgets` (JSON text or a file), or None."""
  if not text:
    return None
  if os.path.exists(text):
    with open(text) as f:
      text = f.read()
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"config.select.site_budgets is not JSON ({e})") from None
  if not isinstance(value, dict):
    raise ValueError("config.select.site_budgets must be a JSON object {regex: {field: value}}")
  return value


def _run_spec(run, report) -> experiment.RunSpec:
  """The probed run (from the report), with the fields the config's `run` group sets."""
  probed = report.get("run") or {}
  pick = lambda key, default: run[key] if run[key] is not None else probed.get(key, default)
  mods = run_config.split(run.mods) if run.mods is not None else probed.get("mods") or ()
  return experiment.RunSpec(
      model=pick("model", report.get("model")), preset=pick("preset", report.get("preset")),
      data=pick("data", "synthetic"), data_spec=pick("data_spec", None),
      data_path=pick("data_path", None), data_cache=run.data_cache, precision="bf16",
      mods=experiment.parse_mods(mods), seed=pick("seed", 0))


def check_against_run(plan, report, run, where) -> str:
  """Checks the plan against the probed model; returns a one-line summary."""
  spec = _run_spec(run, report)
  batch_size = run.batch_size or int((report.get("run") or {}).get("batch_size") or 0) or \
      experiment.preset_batch_size(spec.model, spec.preset)
  model, source, _ = experiment.build_run(spec)
  batch = source.train_batch(0, batch_size)
  products = check_lib.check_plan(plan, model, None, batch, where=where)
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
  config = CONFIG.value
  select, timing, out, proposal_path = (config.select, config.timing, config.out,
                                        config.serving_proposal)
  if not config.report or not out:
    sys.exit("error: --config.report=PROBE_REPORT.json and --config.out=PLAN.json are "
             "required")
  if proposal_path and select.objective != selection.SERVE:
    sys.exit("error: --config.serving_proposal needs --config.select.objective=serve")
  try:
    budget, budgets = criteria(select), site_budgets(select.site_budgets)
    report = load_report(config.report)
    plan = selection.select(report, budget, budget_per_site=budgets, timing_table=timing.table,
                            target_device=timing.target_device, objective=select.objective,
                            fill_from_table=timing.fill_from_table)
    plan = plan_lib.Plan({**plan.to_dict(), "provenance": {
        **plan["provenance"], "report_path": os.path.abspath(config.report)}})
    checked = (check_against_run(plan, report, config.run, out) if config.check
               else "not checked (config.check is off)")
    proposal, proposed = None, []
    if proposal_path:
      proposal, proposed = selection.serving_proposal(
          report, plan, budget, budget_per_site=budgets, timing_table=timing.table,
          target_device=timing.target_device, fill_from_table=timing.fill_from_table)
  except (ProbeReportError, TimingTableError, check_lib.PlanMismatchError,
          plan_lib.PlanFileError, experiment.PlanError, ValueError) as e:
    sys.exit(f"error: {e}")
  plan_lib.save_plan(plan, out)
  if proposal is not None:
    plan_lib.save_plan(proposal, proposal_path)
  print(plan_lib.choice_table(plan))
  print()
  print(_summary(plan))
  print(f"check: {checked}")
  print(f"plan: {out}")
  if proposal is not None:
    print(f"serving proposal: {len(proposed)} more FP8 forward(s)"
          + (f" ({', '.join(proposed)})" if proposed else "")
          + f": {proposal_path} (untimed: time its export against the plan's before serving "
            "it)")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
