"""LoKA Dispatch: per site and pass, the fastest kernel whose probed error meets the budget.

  from loka_jax import dispatch
  plan = dispatch.select("probe_report.json", Criteria())  # ProbeReport -> Plan
  dispatch.save_plan(plan, "plan.json")
  model = dispatch.apply(get_config("wukong", "small"), plan)  # baked in statically
  wrapped = dispatch.wrap(any_flax_module, plan)              # plain nn.Dense / nn.Einsum

Selection (`selection`), end-to-end validation (`validate/`), the probe-select-validate
pipeline (`pipeline`), re-selection of drifted sites (`drift`, `valve`) and the serving export
(`export`) live here; the plan format and its use in a model (`loka_jax.plan`) are re-exported.
"""
from loka_jax.plan.file import (Plan, PlanFileError, PlanMismatchError, SCHEMA, add_validation,
                                as_plan, back_off, choice_table, kernel_counts, load_plan,
                                read_plan, save_plan, to_kernel_plan, validate_plan)
from loka_jax.plan.binding import Wrapped, routing, wrap
from loka_jax.plan.check import apply, check_plan, model_sites, plan_problems
from loka_jax.dispatch.selection import (Budget, TimingSource, make_budget, report_hash,
                                         resolve_timing, select, serving_proposal)
from loka_jax.dispatch.drift import (DriftBound, SiteDrift, drifted_sites, reselect_drifted,
                                     site_drift)
from loka_jax.dispatch.valve import DriftValve, ValveConfig, checkpoint_plan
from loka_jax.dispatch.export import ExportError, ExportedModel, export_model, load_export
from loka_jax.dispatch.validate import (ValidationConfig, ValidationContext, check_from_init,
                                        check_held_out, check_shadow, check_speed,
                                        more_precise_kernel, validate_end_to_end,
                                        validation_records)
from loka_jax.dispatch.pipeline import (PipelineResult, context_for_run, default_criteria,
                                        plan_speedup_estimate, probe_and_plan)

__all__ = [
    "Budget", "DriftBound", "DriftValve", "ExportError", "ExportedModel", "PipelineResult",
    "Plan", "PlanFileError", "PlanMismatchError", "SCHEMA", "SiteDrift", "TimingSource",
    "ValidationConfig", "ValidationContext", "ValveConfig", "Wrapped", "add_validation",
    "apply", "as_plan", "back_off", "check_from_init", "check_held_out", "check_plan",
    "check_shadow", "check_speed", "checkpoint_plan", "choice_table", "context_for_run",
    "default_criteria", "drifted_sites", "export_model", "kernel_counts", "load_export",
    "load_plan", "make_budget", "model_sites", "more_precise_kernel", "plan_problems",
    "plan_speedup_estimate", "probe_and_plan", "read_plan", "report_hash", "reselect_drifted",
    "resolve_timing", "routing", "save_plan", "select", "serving_proposal", "site_drift",
    "to_kernel_plan", "validate_end_to_end", "validate_plan", "validation_records", "wrap"]
