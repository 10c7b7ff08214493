"""Any Flax model's plain `nn.Dense` / `nn.DenseGeneral` / `nn.Einsum` layers run as GEMM
sites: an interceptor that calls a site on the layer's own scope, so the site's name is the
layer's path and its parameters are the layer's (the same tree and initial values).

The probe routes through it to observe a user's model, and `dispatch.wrap` to run one under a
plan.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from loka_jax.kernels import EinsumSpec, KernelPlan
from loka_jax.models.site import DenseSite, EinsumSite, SiteConfig, _SiteBase, site_name
from loka_jax.precision import DtypePolicy


def _layer_policy(policy: Optional[DtypePolicy], module, inputs) -> DtypePolicy:
  """The explicit policy, else the layer's own Flax dtypes (compute and output in `dtype`,
  or in the promoted dtype of inputs and parameters when `dtype` is None, as Flax does)."""
  if policy is not None:
    return policy
  dtype = module.dtype or jnp.result_type(inputs.dtype, module.param_dtype)
  return DtypePolicy(module.param_dtype, dtype, dtype)


def _plain_dot(module) -> bool:
  """Whether the layer multiplies with lax.dot_general (not a dot_general the user injected,
  such as Flax's own FP8 op: that layer is the user's choice and stays as it is)."""
  return (getattr(module, "dot_general", None) is None
          and getattr(module, "dot_general_cls", None) is None)


def _flat_init(init, flat_shape):
  """`init` drawn at the 2-D shape Flax's DenseGeneral draws at, reshaped: the routed layer
  initializes to the same values as the plain one."""
  return lambda key, shape, dtype=jnp.float32: jnp.reshape(init(key, flat_shape, dtype), shape)


def dense_general_spec(module: nn.DenseGeneral, ndim: int
                       ) -> Optional[Tuple[str, str, Tuple[int, ...]]]:
  """(einsum spec, bias axes, features) of a DenseGeneral layer on an `ndim`-d input, or None
  for a layer with batch_dims (a batched weight: not an act x weight product of one weight)."""
  features = (module.features,) if isinstance(module.features, int) else tuple(module.features)
  axis = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
  if module.batch_dims:
    return None
  axis = tuple(sorted(a % ndim for a in axis))
  letters = "abcdefghijklmnopqrstuvwxyz"
  lhs = letters[:ndim]
  feats = letters[ndim:ndim + len(features)]
  rhs = "".join(lhs[a] for a in axis) + feats
  out = "".join(c for i, c in enumerate(lhs) if i not in axis) + feats
  return f"{lhs},{rhs}->{out}", feats, features


@dataclasses.dataclass(frozen=True)
class _Router:
  """Interceptor: plain nn.Dense / nn.DenseGeneral / nn.Einsum calls run as GEMM sites on
  the layer's own scope, so the site's name is the layer's path and its parameters are the
  layer's. `seen`, when given, collects the names of the sites routed."""
  plan: KernelPlan
  policy: Optional[DtypePolicy]
  seen: Optional[set] = dataclasses.field(default=None, compare=False, hash=False)

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not _plain_dot(module):
      return next_fun(*args, **kwargs)
    # Exact types only: a subclass may change what __call__ computes.
    if isinstance(module, _SiteBase):
      if self.seen is not None:
        self.seen.add(site_name(module))
      return next_fun(*args, **kwargs)
    if type(module) is nn.Dense:  # pylint: disable=unidiomatic-typecheck
      out = self._dense(module, *args, **kwargs)
    elif type(module) is nn.Einsum:  # pylint: disable=unidiomatic-typecheck
      out = self._einsum(module, *args, **kwargs)
    elif type(module) is nn.DenseGeneral:  # pylint: disable=unidiomatic-typecheck
      out = self._dense_general(module, next_fun, *args, **kwargs)
    else:
      return next_fun(*args, **kwargs)
    if self.seen is not None:
      self.seen.add("/".join(module.path))
    return out

  def _dense(self, module: nn.Dense, inputs):
    config = SiteConfig(_layer_policy(self.policy, module, inputs), self.plan)
    site = DenseSite(features=module.features, use_bias=module.use_bias, config=config,
                     kernel_init=module.kernel_init, bias_init=module.bias_init,
                     parent=module.scope)
    return site(inputs)

  def _dense_general(self, module: nn.DenseGeneral, next_fun, inputs):
    found = dense_general_spec(module, inputs.ndim)
    if found is None:
      return next_fun(inputs)
    spec, bias_axes, features = found
    parsed = EinsumSpec.parse(spec)
    contracted = tuple(inputs.shape[parsed.lhs.index(c)] for c in parsed.rhs
                       if c in parsed.lhs)
    flat = (math.prod(contracted), math.prod(features))
    config = SiteConfig(_layer_policy(self.policy, module, inputs), self.plan)
    site = EinsumSite(spec=spec, weight_shape=contracted + features,
                      bias_axes=bias_axes if module.use_bias else "", config=config,
                      kernel_init=_flat_init(module.kernel_init, flat),
                      bias_init=_flat_init(module.bias_init, (flat[1],)),
                      parent=module.scope)
    return site(inputs)

  def _einsum(self, module: nn.Einsum, inputs, einsum_str: Optional[str] = None):
    text = nn.merge_param("einsum_str", module.einsum_str, einsum_str)
    try:
      spec = EinsumSpec.parse(text)
    except ValueError as e:
      raise ValueError(f"nn.Einsum at {'/'.join(module.path)}: {e}; such a layer cannot run as "
                       "a GEMM site") from None
    bias_axes = "".join(i for i in spec.out if i in spec.rhs) if module.use_bias else ""
    config = SiteConfig(_layer_policy(self.policy, module, inputs), self.plan)
    site = EinsumSite(spec=str(spec), weight_shape=tuple(module.shape), bias_axes=bias_axes,
                      config=config, kernel_init=module.kernel_init,
                      bias_init=module.bias_init, parent=module.scope)
    return site(inputs)


@contextlib.contextmanager
def routing(plan: KernelPlan, policy: Optional[DtypePolicy] = None,
            seen: Optional[set] = None):
  """Within this context, plain nn.Dense / nn.DenseGeneral / nn.Einsum calls run as GEMM
  sites under `plan`; `seen` (a set), when given, collects every site name called."""
  with nn.intercept_methods(_Router(plan, policy, seen)):
    yield
