"""The plan: which kernel runs each GEMM site's passes (`loka.plan/1`), and its use.

  plan = read_plan("plan.json")                  # file.py: the format, read and written
  model = apply(get_config("wukong", "small"), plan)   # binding.py: baked into a tower
  fp8_model = wrap(any_flax_module, plan)        # binding.py: plain nn.Dense / nn.Einsum
  check_plan(plan, model, variables, batch)      # check.py: every mismatch in one error

Dispatch writes plans; training, the probe's routing and validation read them. The plan
therefore sits below all of them, so that none of them imports Dispatch to run one.
"""
from loka_jax.plan.file import (FALLBACK, SCHEMA, Plan, PlanFileError, PlanMismatchError,
                                add_validation, as_plan, back_off, check_called, choice_table,
                                kernel_counts, load_plan, read_plan, save_plan, to_kernel_plan,
                                validate_plan)
from loka_jax.plan.binding import Wrapped, routing, wrap
from loka_jax.plan.check import apply, check_plan, model_sites, plan_problems

__all__ = ["FALLBACK", "SCHEMA", "Plan", "PlanFileError", "PlanMismatchError", "Wrapped",
           "add_validation", "apply", "as_plan", "back_off", "check_called", "check_plan",
           "choice_table", "kernel_counts", "load_plan", "model_sites", "plan_problems",
           "read_plan", "routing", "save_plan", "to_kernel_plan", "validate_plan", "wrap"]
