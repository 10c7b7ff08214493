"""Does a plan fit a model? Every problem at once, in one error that names each offender.

Checked against the model's sites (found by tracing one forward pass abstractly): plan entries
that name no site, rules that match no site or decide none (every match taken by an exact
entry or an earlier rule), sites no entry, rule or default covers, kernels that are not
registered, kernels that cannot run a site's kind, shape or pass, fused-op kernels mixed with
others, and fused-epilogue kernels on layers whose epilogue they do not compute.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import flax.linen as nn

from loka_jax.plan import binding
from loka_jax.plan.file import FALLBACK, Plan, PlanMismatchError, as_plan
from loka_jax.kernels import FUSED_OP, EinsumSpec, KernelChoice, KernelPlan, PASSES, registry
from loka_jax.models.presets import site_products
from loka_jax.models.site import site_name
from loka_jax.models import fused as fused_lib
from loka_jax.models.fused import FusedDenseNormAct


def _neutral(model):
  """The model with every site on xla_bf16, so that tracing never trips over the plan that
  is being checked (a model already built with it)."""
  try:
    return binding.apply(model, KernelPlan.uniform(FALLBACK))
  except TypeError:
    return model  # no SiteConfig to replace: traced as it is


def model_sites(model, variables, batch) -> Tuple[Dict, Dict[str, Tuple]]:
  """({site: SiteProduct} in call order, {site: (block_size, activation, quantize_output)} of
  the fused Mods layers) of one abstract forward pass."""
  epilogues: Dict[str, Tuple] = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(module, FusedDenseNormAct):
      epilogues[site_name(module)] = (module.block_size, module.activation,
                                      module.quantize_output)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    products = site_products(_neutral(model), variables, batch)
  return products, epilogues


def _fused_epilogue(kernel) -> bool:
  """Fused-epilogue kernels (Pallas GEMM + BlockNorm/activation) have no plain passes."""
  return kernel.sort == FUSED_OP and not kernel.passes


def _check_fused_epilogue(name: str, choice: KernelChoice, product, epilogue: Optional[Tuple],
                          kernels) -> List[str]:
  """A fused-epilogue forward: only on a fused Mods layer with the same epilogue, and a
  backward of one per-pass kernel that supports the site."""
  fwd = kernels["fwd"]
  if epilogue is None:
    return [f"site {name}: {fwd.name} fuses an epilogue into the GEMM and fits only a fused "
            "Mods layer (FusedDenseNormAct); this site is a plain product: give it a per-pass "
            "kernel"]
  problems = []
  own = (getattr(fwd, "block_size", None), getattr(fwd, "activation", None),
         getattr(fwd, "quantize_output", None))
  if own != epilogue:
    match = fused_lib.fused_kernel_name(*epilogue)
    problems.append(f"site {name}: {fwd.name} computes {fused_lib.epilogue_of(*own)}, the "
                    f"layer computes {fused_lib.epilogue_of(*epilogue)}"
                    + (f"; use {match}" if match else ""))
  try:
    backward = fused_lib.backward_kernel(choice, name)
  except ValueError as e:
    return problems + [str(e)]
  spec = EinsumSpec.parse(product.spec)
  kernel = registry.get(backward)
  for p in ("grad_lhs", "grad_rhs"):
    reason = kernel.unsupported_reason(spec.for_pass(p), p, product.kind, product.lhs_shape,
                                       product.rhs_shape)
    if reason:
      problems.append(f"site {name}: backward of {fwd.name}: {p}: {reason}")
  return problems


def _site_problems(name: str, choice: KernelChoice, product, epilogue: Optional[Tuple],
                   registered) -> List[str]:
  """What keeps `choice` from running site `name` (unregistered kernels are reported apart;
  the passes with registered kernels are still checked)."""
  known = {p: registry.get(choice.for_pass(p)) for p in PASSES
           if choice.for_pass(p) in registered}
  if "fwd" in known and _fused_epilogue(known["fwd"]):
    if len(known) < len(PASSES) and epilogue is not None:
      return []  # its backward names an unregistered kernel (reported apart)
    return _check_fused_epilogue(name, choice, product, epilogue, known)
  here = (f"site {name} ({product.kind}, {product.spec}, lhs {tuple(product.lhs_shape)}, "
          f"rhs {tuple(product.rhs_shape)})")
  problems = []
  late = [p for p, k in known.items() if _fused_epilogue(k)]
  if late:
    problems.append(f"{here}: fused-epilogue kernel in {late} but not in fwd; name such a "
                    "kernel for the forward pass (its backward runs per-pass kernels)")
  fused = sorted({k.name for k in known.values() if k.sort == FUSED_OP and k.passes})
  if fused and len(set(choice.to_dict().values())) != 1:
    problems.append(f"{here}: fused-op kernel {fused} must be chosen for all three passes or "
                    f"none, got {choice.to_dict()}")
  spec = EinsumSpec.parse(product.spec)
  for p, kernel in known.items():
    if p in late:
      continue
    reason = kernel.unsupported_reason(spec.for_pass(p), p, product.kind, product.lhs_shape,
                                       product.rhs_shape)
    if reason:
      problems.append(f"{here}: {p}: {reason}")
  return problems


def plan_problems(plan, products: Dict, epilogues: Dict[str, Tuple]) -> List[str]:
  """Every way `plan` does not fit the sites `products` (empty: it fits)."""
  if isinstance(plan, KernelPlan):
    entries = {n: c for n, c in plan.sites}
    rules = [(p, c) for p, c in plan.rules]
    default: Optional[KernelChoice] = plan.default
  else:
    plan = as_plan(plan)
    entries = {n: plan.site_choice(n) for n in plan["sites"]}
    rules = [(r["pattern"], KernelChoice.from_dict(r["passes"])) for r in plan["rules"]]
    default = plan.default_choice()
  names = list(products)
  problems: List[str] = []
  unknown = [n for n in entries if n not in products]
  if unknown:
    problems.append(f"unknown site(s) {unknown}: the model has no such site (its sites: "
                    f"{names[:12]}{' ...' if len(names) > 12 else ''})")
  claimed = {n for n in entries if n in products}
  decided: Dict[str, KernelChoice] = {n: entries[n] for n in claimed}
  for i, (pattern, choice) in enumerate(rules):
    matches = [n for n in names if re.fullmatch(pattern, n)]
    if not matches:
      problems.append(f"rule {i} {pattern!r} matches no site")
      continue
    fresh = [n for n in matches if n not in claimed]
    if not fresh:
      problems.append(f"rule {i} {pattern!r} decides no site: each of its matches {matches[:6]}"
                      " has an exact entry or an earlier rule")
    for n in fresh:
      decided[n] = choice
    claimed.update(matches)
  uncovered = [n for n in names if n not in claimed]
  if uncovered and default is None:
    problems.append(f"uncovered site(s) {uncovered}: no entry, rule or default covers them "
                    "(add entries, a rule or a default)")
  for n in uncovered:
    if default is not None:
      decided[n] = default
  used: Dict[str, List[str]] = {}
  for label, choice in ([(f"site {n}", c) for n, c in entries.items()]
                        + [(f"rule {p!r}", c) for p, c in rules]
                        + ([("default", default)] if default is not None else [])):
    for p in PASSES:
      used.setdefault(choice.for_pass(p), []).append(f"{label} {p}")
  registered = set(registry.names())
  for kernel, where in sorted(used.items()):
    if kernel not in registered:
      problems.append(f"kernel {kernel!r} is not registered (used by {', '.join(where[:6])}"
                      f"{' ...' if len(where) > 6 else ''}); registered: "
                      f"{', '.join(sorted(registered))}")
  for n in names:
    if n in decided:
      problems += _site_problems(n, decided[n], products[n], epilogues.get(n), registered)
  return problems


def check_plan(plan, model, variables=None, batch=None, *, where: Optional[str] = None
               ) -> Dict:
  """{site: SiteProduct} of `model` when `plan` fits it; else PlanMismatchError listing every
  problem. `variables=None` traces the model's init instead of its apply."""
  if batch is None:
    raise ValueError("check_plan needs an example batch to find the model's sites")
  if where is None:
    where = (plan if isinstance(plan, str) else
             f"for {plan.get('model')}" if isinstance(plan, (Plan, dict)) and plan.get("model")
             else "")
  products, epilogues = model_sites(model, variables, batch)
  problems = plan_problems(plan, products, epilogues)
  if problems:
    raise PlanMismatchError(where or "<plan>", problems)
  return products


def apply(target, plan, *, policy=None, features=None, variables=None, batch=None):
  """`binding.apply(target, plan, policy=, features=)`: `target` with `plan` baked in
  statically; given a batch, the plan is first checked against the built model
  (`check_plan`: every unknown, uncovered or unsupported name in one error)."""
  out = binding.apply(target, plan, policy=policy, features=features)
  if batch is not None:
    check_plan(plan, out, variables, batch)
  return out
