"""LoKA Dispatch: per site and pass, the fastest kernel whose probed error meets the budget.

  from loka_jax import dispatch
  plan = dispatch.select("probe_report.json", Criteria())  # ProbeReport -> Plan
  dispatch.save_plan(plan, "plan.json")
  model = dispatch.apply(get_config("wukong", "small"), plan)  # baked in statically
  wrapped = dispatch.wrap(any_flax_module, plan)              # plain nn.Dense / nn.Einsum

Names are imported lazily: the probe imports `loka_jax.probe.timing_table` while it loads,
so this package must not import the probe or the models at import time.
"""
import importlib

_EXPORTS = {
    "SCHEMA": "plan", "Plan": "plan", "PlanFileError": "plan", "add_validation": "plan",
    "as_plan": "plan", "back_off": "plan", "choice_table": "plan", "kernel_counts": "plan",
    "load_plan": "plan", "read_plan": "plan", "save_plan": "plan", "to_kernel_plan": "plan",
    "validate_plan": "plan",
    "Budget": "selection", "TimingSource": "selection", "make_budget": "selection",
    "report_hash": "selection", "resolve_timing": "selection", "select": "selection",
    "serving_proposal": "selection",
    "PlanMismatchError": "plan", "check_plan": "check", "model_sites": "check",
    "plan_problems": "check",
    "Wrapped": "binding", "apply": "check", "routing": "binding", "wrap": "binding",
    "DriftBound": "drift", "SiteDrift": "drift", "drifted_sites": "drift",
    "reselect_drifted": "drift", "site_drift": "drift",
    "ValidationConfig": "validate", "ValidationContext": "validate",
    "check_from_init": "validate", "check_held_out": "validate", "check_shadow": "validate",
    "check_speed": "validate",
    "more_precise_kernel": "validate", "validate_end_to_end": "validate",
    "validation_records": "validate",
    "PipelineResult": "pipeline", "context_for_run": "pipeline",
    "default_criteria": "pipeline", "plan_speedup_estimate": "pipeline",
    "probe_and_plan": "pipeline",
    "DriftValve": "valve", "ValveConfig": "valve", "checkpoint_plan": "valve",
    "ExportedModel": "export", "ExportError": "export", "export_model": "export",
    "load_export": "export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'loka_jax.dispatch' has no attribute {name!r}")
  return getattr(importlib.import_module(f"loka_jax.dispatch.{module}"), name)
