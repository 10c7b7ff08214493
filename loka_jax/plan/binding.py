"""One-call use of a plan: bake it into a model (`apply`), or route any Flax model's plain
`nn.Dense` / `nn.DenseGeneral` / `nn.Einsum` layers through GEMM sites (`wrap`).

The plan becomes part of the module definition (a frozen KernelPlan in a SiteConfig), so jit
specializes on it and nothing is looked up per step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax

from loka_jax.plan.file import check_called, to_kernel_plan
from loka_jax.kernels import FP8_META, KernelPlan
from loka_jax.models import routing as routing_lib
from loka_jax.models.site import SiteConfig
from loka_jax.precision import BF16, DtypePolicy


# ----------------------------------------------------------------------------- apply


def _replace_site_configs(value, update: Callable[[SiteConfig], SiteConfig]):
  """(value with every SiteConfig inside its dataclass fields updated, how many)."""
  if isinstance(value, SiteConfig):
    return update(value), 1
  if isinstance(value, nn.Module):
    changes, count = {}, 0
    for field in dataclasses.fields(value):
      if field.name in ("parent", "name") or not field.init:
        continue
      new, n = _replace_site_configs(getattr(value, field.name), update)
      if n:
        changes[field.name], count = new, count + n
    return (value.clone(**changes) if changes else value), count
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    changes, count = {}, 0
    for field in dataclasses.fields(value):
      if not field.init:
        continue
      new, n = _replace_site_configs(getattr(value, field.name), update)
      if n:
        changes[field.name], count = new, count + n
    return (dataclasses.replace(value, **changes) if changes else value), count
  if isinstance(value, (tuple, list)):
    items = [_replace_site_configs(v, update) for v in value]
    count = sum(n for _, n in items)
    return (type(value)(v for v, _ in items) if count else value), count
  return value, 0


def apply(target, plan, *, policy: Optional[DtypePolicy] = None, features=None):
  """`target` with `plan` baked in statically.

  Args:
    target: a preset config (ml_collections, from `models.get_config`), a built loka_jax
      module (every SiteConfig in its fields is replaced: `opts.site`, a site's `config`),
      a `SiteConfig`, or a model returned by `wrap`.
    plan: a Plan, its JSON dict, a plan file path or a KernelPlan.
    policy: the dtype policy (default: the target's own; bf16 for a preset config).
    features: the FeatureSpec of a preset config (default: the config's `features`).
  `check.apply` also checks the plan against an example batch.
  Returns:
    the same sort of thing as `target`.
  """
  kernel_plan = to_kernel_plan(plan)
  with_plan = lambda sc: SiteConfig(policy or sc.policy, kernel_plan)
  if isinstance(target, SiteConfig):
    return with_plan(target)
  if isinstance(target, Wrapped):
    out = target.with_plan(kernel_plan, policy or target.policy)
  elif isinstance(target, nn.Module):
    out, count = _replace_site_configs(target, with_plan)
    if not count:
      raise TypeError(
          f"{type(target).__name__} holds no SiteConfig (loka_jax towers keep it in "
          "`opts.site`, sites in `config`): for a plain Flax model use "
          "loka_jax.dispatch.wrap(module, plan)")
  elif hasattr(target, "model") and hasattr(target, "mods"):  # a preset ConfigDict
    from loka_jax.models import build_model
    out = build_model(target, features if features is not None else target.features,
                      SiteConfig(policy or BF16, kernel_plan))
  else:
    raise TypeError(f"apply: expected a preset config, a module, a SiteConfig or a wrapped "
                    f"model, got {type(target).__name__}")
  return out


# ----------------------------------------------------------------------------- wrap


def routing(plan, policy: Optional[DtypePolicy] = None, seen: Optional[set] = None):
  """`models.routing.routing` under `plan` (any plan form): within the context, plain
  nn.Dense / nn.DenseGeneral / nn.Einsum calls run as GEMM sites."""
  return routing_lib.routing(to_kernel_plan(plan), policy, seen)


@dataclasses.dataclass(frozen=True, eq=False)
class Wrapped:
  """A Flax model whose plain nn.Dense / nn.DenseGeneral / nn.Einsum layers (and its own
  loka_jax sites) run as GEMM sites under `plan`.

  Same variables as the module (init gives the same tree and values); `init` and `apply`
  take the module's own arguments. `policy=None` keeps each layer's Flax dtypes. A plan
  with delayed-scaling kernels also needs their state: `init_state` adds it.
  """
  module: nn.Module
  plan: KernelPlan
  policy: Optional[DtypePolicy] = None

  def routing(self, seen: Optional[set] = None):
    return routing(self.plan, self.policy, seen)

  def init(self, rngs, *args, **kwargs):
    with self.routing():
      return self.module.init(rngs, *args, **kwargs)

  def init_with_output(self, rngs, *args, **kwargs):
    with self.routing():
      return self.module.init_with_output(rngs, *args, **kwargs)

  def apply(self, variables, *args, **kwargs) -> Any:
    """`module.apply` with the plan. A whole forward pass (no `method`) also checks that
    every site the plan names was called: a plan made for another model is an error."""
    seen = set() if kwargs.get("method") is None else None
    with self.routing(seen):
      out = self.module.apply(variables, *args, **kwargs)
    if seen is not None:
      check_called(self.plan, seen, type(self.module).__name__)
    return out

  def init_state(self, variables, *args, rng=None, **kwargs):
    """`variables` plus the state the plan's stateful kernels keep (the `fp8_meta`
    collection of delayed scaling, at its initial values); nothing else is touched."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    fresh = jax.jit(lambda r, a, k: self.init(r, *a, **k))(rng, args, kwargs)
    return {**variables, FP8_META: fresh[FP8_META]} if FP8_META in fresh else dict(variables)

  def with_plan(self, plan, policy: Optional[DtypePolicy] = None) -> "Wrapped":
    return Wrapped(self.module, to_kernel_plan(plan), policy if policy is not None
                   else self.policy)


def wrap(module: nn.Module, plan, *, policy: Optional[DtypePolicy] = BF16) -> Wrapped:
  """`module` with its plain nn.Dense / nn.DenseGeneral / nn.Einsum calls routed through GEMM
  sites named by their Linen paths, reusing the module's own parameters.

  Args:
    module: any flax.linen Module.
    plan: a Plan, its JSON dict, a plan file path or a KernelPlan.
    policy: the dtype policy of every site: bf16 products with float32 parameters by
      default, the baseline the probe measures FP8 against; None keeps each layer's own
      Flax dtypes.
  """
  if isinstance(module, Wrapped):
    module = module.module
  if not isinstance(module, nn.Module):
    raise TypeError(f"wrap: expected a flax.linen Module, got {type(module).__name__}")
  return Wrapped(module, to_kernel_plan(plan), policy)
