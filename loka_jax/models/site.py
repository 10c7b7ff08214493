"""GEMM sites: the one Flax layer every matrix product of every model goes through.

A site owns a stable name (its Linen module path, e.g. `layer_1/fmb/mlp_0`), a kind
(`act_weight` or `act_act`), an einsum spec, an explicit DtypePolicy and the kernel of each
pass, looked up at trace time from the static KernelPlan in its SiteConfig.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from loka_jax import kernels
from loka_jax.kernels import ACT_ACT, ACT_WEIGHT, EinsumSpec, KernelChoice, KernelPlan
from loka_jax.precision import BF16, DtypePolicy
from loka_jax.models import tap as probe_hooks

default_kernel_init = nn.initializers.lecun_normal()
# The variable collection of a switched site's flag (`KernelPlan.switched`): a scalar bool
# per site, `<site path>/on`, given at apply time.
SITE_SWITCH = "site_switch"


@dataclasses.dataclass(frozen=True)
class SiteConfig:
  """What every site of a model needs: the dtype policy and the kernel plan (both static)."""
  policy: DtypePolicy = BF16
  plan: KernelPlan = KernelPlan()

  @classmethod
  def for_precision(cls, precision: str, kernel: str = "xla_fp8_tensorwise",
                    plan: Optional[KernelPlan] = None) -> "SiteConfig":
    """The precision arms: fp32, bf16, fp8_all (`kernel` at every site), loka (needs a plan)."""
    if precision == "fp32":
      return cls(DtypePolicy.named("fp32"), KernelPlan.uniform("xla_fp32"))
    if precision == "bf16":
      return cls(BF16, KernelPlan.uniform("xla_bf16"))
    if precision == "fp8_all":
      kernels.get(kernel)  # unknown names fail here, before any model is built
      return cls(BF16, KernelPlan.uniform(kernel))
    if precision == "loka":
      if plan is None:
        raise ValueError("precision 'loka' needs a plan (a loka.plan/1 file)")
      return cls(BF16, plan)
    raise ValueError(f"unknown precision {precision!r}; use fp32, bf16, fp8_all or loka")


def site_name(module: nn.Module) -> str:
  return "/".join(module.path) or module.name or "<root>"


class _SiteBase(nn.Module):
  """Shared product logic; subclasses decide where the operands come from."""

  def _product(self, spec: EinsumSpec, kind: str, lhs, rhs):
    config: SiteConfig = self.config
    name = site_name(self)
    kernels.check_operands(f"site {name}", spec, lhs, rhs)
    choice = config.plan.choice_for(name)
    kernels.validate_choice(choice, spec, kind, lhs.shape, rhs.shape, site_name=name)
    probe_hooks.observe_operands(self, spec, kind, lhs, rhs)
    fwd_kernel = kernels.get(choice.fwd)
    if fwd_kernel.sort == kernels.FUSED_OP:
      out = self._switched(name, fwd_kernel.make_module(name="fp8_op")(str(spec), lhs, rhs),
                           spec, lhs, rhs)
      out = out.astype(config.policy.output_dtype)
    else:
      out = self._switched(
          name, kernels.per_pass_product(spec, choice, config.policy.output_dtype, lhs, rhs),
          spec, lhs, rhs)
    return probe_hooks.observe_output_grad(self, out)

  def _switched(self, name: str, out, spec: EinsumSpec, lhs, rhs):
    """`out`, or at a switched site (`KernelPlan.switched`) the bf16 product where the site's
    flag is off. Both products run and the flag picks one, so the flag is data, not program:
    one compilation serves every subset of switched sites. Around the pick XLA fuses the
    program differently, so values may move by a bf16 ulp: a per-pass kernel's held-out
    scores matched its own program's bit for bit on XLA:CPU, a delayed-scaling op's did not
    (its calibrated scale follows such an ulp)."""
    if name not in self.config.plan.switched:
      return out
    on = self.variable(SITE_SWITCH, "on", lambda: jnp.zeros((), jnp.bool_)).value
    base = kernels.per_pass_product(spec, KernelChoice(), self.config.policy.output_dtype,
                                    lhs, rhs)
    return jnp.where(on, out, base.astype(out.dtype))


class ActSite(_SiteBase):
  """act x act product of two activations (DLRM's X X^T, Wukong's X P, attention)."""
  spec: str
  config: SiteConfig = SiteConfig()

  @nn.compact
  def __call__(self, lhs, rhs):
    dt = self.config.policy.compute_dtype
    return self._product(EinsumSpec.parse(self.spec), ACT_ACT, lhs.astype(dt), rhs.astype(dt))


class EinsumSite(_SiteBase):
  """act x weight product `einsum(spec, x, kernel)`; the weight is always the right operand.

  `bias_axes` are output indices a learnable bias spans ('' for none).
  """
  spec: str
  weight_shape: Sequence[int]
  bias_axes: str = ""
  config: SiteConfig = SiteConfig()
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x):
    spec = EinsumSpec.parse(self.spec)
    policy = self.config.policy
    kernel = self.param("kernel", self.kernel_init, tuple(self.weight_shape), policy.param_dtype)
    out = self._product(spec, ACT_WEIGHT, x.astype(policy.compute_dtype),
                        kernel.astype(policy.compute_dtype))
    if self.bias_axes:
      out_shape = spec.shapes(x.shape, kernel.shape)
      bias_shape = tuple(out_shape[spec.out.index(i)] for i in self.bias_axes)
      bias = self.param("bias", self.bias_init, bias_shape, policy.param_dtype)
      positions = [spec.out.index(i) for i in self.bias_axes]
      if positions != sorted(positions):
        raise ValueError(f"bias_axes {self.bias_axes!r} must follow the order of {spec.out!r}")
      shape = [1] * len(out_shape)
      for p, i in zip(positions, self.bias_axes):
        shape[p] = out_shape[p]
      out = out + bias.astype(out.dtype).reshape(shape)
    return out


class DenseSite(_SiteBase):
  """Dense form: x[..., K] @ kernel[K, N] (+ bias), named like nn.Dense's parameters."""
  features: int
  use_bias: bool = True
  config: SiteConfig = SiteConfig()
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x):
    policy = self.config.policy
    in_features = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, (in_features, self.features),
                        policy.param_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape((math.prod(lead), in_features)).astype(policy.compute_dtype)
    out = self._product(EinsumSpec.parse("mk,kn->mn"), ACT_WEIGHT, x2,
                        kernel.astype(policy.compute_dtype))
    out = out.reshape(lead + (self.features,))
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.features,), policy.param_dtype)
      out = out + bias.astype(out.dtype)
    return out


# ----------------------------------------------------------------------------- inspection

class SiteProduct(NamedTuple):
  """One GEMM site's product as the model calls it (shapes include the batch axis)."""
  kind: str                  # 'act_weight' or 'act_act'
  spec: str                  # einsum spec of the forward product
  lhs_shape: Tuple[int, ...]
  rhs_shape: Tuple[int, ...]

  @property
  def flops(self) -> int:
    return EinsumSpec.parse(self.spec).flops(self.lhs_shape, self.rhs_shape)


def trace_sites(model: nn.Module, variables, batch,
                visit: Callable[[nn.Module, tuple], None]) -> None:
  """Calls `visit(site module, call args)` at every site call (DenseSite, EinsumSite, ActSite)
  of one forward pass of `model` on `batch`, traced abstractly (no compilation);
  `variables=None` traces `model.init` instead (same forward pass, no variables needed)."""
  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module,
                                                        (DenseSite, EinsumSite, ActSite)):
      visit(context.module, args)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    if variables is None:
      jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b), batch)
    else:
      jax.eval_shape(lambda v, b: model.apply(v, b), variables, batch)


def site_products(model: nn.Module, variables, batch) -> Dict[str, SiteProduct]:
  """{site name: SiteProduct} of one forward pass, in call order, traced abstractly (no
  compilation). Names are the sites' Linen paths, the keys of plans and probe reports.

  `variables=None` traces `model.init` instead (same forward pass, no variables needed).
  """
  found: Dict[str, SiteProduct] = {}

  def visit(module, args):
    if isinstance(module, DenseSite):
      shape = tuple(args[0].shape)
      product = SiteProduct(ACT_WEIGHT, "mk,kn->mn", (math.prod(shape[:-1]), shape[-1]),
                            (shape[-1], int(module.features)))
    elif isinstance(module, EinsumSite):
      product = SiteProduct(ACT_WEIGHT, str(EinsumSpec.parse(module.spec)),
                            tuple(args[0].shape), tuple(module.weight_shape))
    else:
      product = SiteProduct(ACT_ACT, str(EinsumSpec.parse(module.spec)), tuple(args[0].shape),
                            tuple(args[1].shape))
    found[site_name(module)] = product

  trace_sites(model, variables, batch, visit)
  return found
