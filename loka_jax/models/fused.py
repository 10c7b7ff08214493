"""The fused Mods layer: one GEMM site followed by bias, BlockNorm and activation.

`FusedDenseNormAct` computes `act(BlockNorm(x @ kernel + bias))` (optionally emitting a
rowwise e4m3 QTensor for the next layer). It *is* a DenseSite: same parameters (`kernel`,
`bias`), same name (its Linen path), same probe hooks, so plans, probe reports and checkpoints
do not change when a model switches to it. Two forms, chosen by the site's plan entry:

- fused: the plan's forward kernel is a registered fused-epilogue Pallas kernel
  (`pallas_fp8_rowwise_fused_[blocknorm<B>_]<act>[_quant]`) whose epilogue equals the layer's
  (block size, activation, output quantization). The whole layer is then ONE kernel,
  `kernels_pallas.fused.fused_dense`; its backward runs dgrad and wgrad with one per-pass
  kernel, the plan's `grad_lhs`/`grad_rhs` (which must agree), or `pallas_fp8_rowwise` when
  the plan names the fused kernel for every pass. An epilogue that differs is an error naming
  the site: a fused kernel never silently computes another function.
- unfused: any other plan. The site's product with the plan's per-pass kernels, then bias,
  `functional.block_norm` and the activation: exactly what DenseSite -> Norm -> activation
  computed before, so bf16 and fp8_all arms are unchanged.

The probe asks for output gradients by perturbing the product; a fused kernel never exposes
its product, so while the probe's gradient collection is in play a fused site runs the
unfused form with the kernels that fused one is made of (`pallas_fp8_rowwise` forward, its
backward kernel for the gradients): the same numbers, with the product visible.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, Iterator, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from loka_jax import kernels
from loka_jax.kernels import ACT_WEIGHT, EinsumSpec, KernelChoice, KernelPlan
from loka_jax.models.site import DenseSite, site_name
from loka_jax.mods import functional
from loka_jax.precision import E4M3, ROWWISE, QTensor, scaling
from loka_jax.models import tap as probe_hooks

DENSE_SPEC = EinsumSpec.parse("mk,kn->mn")
# The per-pass kernel that matches a fused kernel's own forward quantization (e4m3 rowwise
# operands): its default backward, and its stand-in while the probe watches gradients.
FUSED_EQUIVALENT = "pallas_fp8_rowwise"


def epilogue_of(block_size: Optional[int], activation: str, quantize_output: bool) -> str:
  """A readable epilogue, e.g. 'BlockNorm(256) -> hard_swish -> e4m3 rowwise output'."""
  parts = ["no norm" if block_size is None else f"BlockNorm({block_size})", activation]
  if quantize_output:
    parts.append("e4m3 rowwise output")
  return " -> ".join(parts)


@dataclasses.dataclass(frozen=True)
class Chain:
  """What a FusedDenseNormAct computes after its product: the probe judges the fused-epilogue
  kernels whose (block_size, activation, quantize_output) equal `epilogue` on this chain."""
  block_size: Optional[int]
  activation: str
  quantize_output: bool = False
  epsilon: float = functional.DEFAULT_EPS
  use_bias: bool = True

  @property
  def epilogue(self) -> Tuple[Optional[int], str, bool]:
    return (self.block_size, self.activation, self.quantize_output)

  def describe(self) -> str:
    return epilogue_of(*self.epilogue)

  def apply(self, z):
    """BlockNorm and the activation on a product `z` (bias included), in z's dtype: the
    chain's epilogue without output quantization (the references the probe judges by)."""
    y = z if self.block_size is None else functional.block_norm(z, self.block_size,
                                                                 self.epsilon)
    return functional.activation(self.activation)(y)


@contextlib.contextmanager
def recording_chains() -> Iterator[Dict[str, Chain]]:
  """Within this context, every FusedDenseNormAct called (also inside a user's apply_fn, and
  under jax tracing) records its Chain under its site name, first call first."""
  found: Dict[str, Chain] = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(module, FusedDenseNormAct):
      found.setdefault(site_name(module), Chain(module.block_size, module.activation,
                                                module.quantize_output, module.epsilon,
                                                module.use_bias))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    yield found


def fused_epilogue_kernel(name: str):
  """The registered kernel `name` if it is a fused-epilogue kernel, else None."""
  kernel = kernels.get(name)
  if kernel.sort != kernels.FUSED_OP:
    return None
  try:
    from kernels_pallas.registration import PallasFusedEpilogue
  except ImportError:  # no Pallas plugin: no fused-epilogue kernel can be registered either
    return None
  return kernel if isinstance(kernel, PallasFusedEpilogue) else None


def fused_kernel_name(block_size: Optional[int], activation: str,
                      quantize_output: bool = False) -> Optional[str]:
  """The registered fused kernel computing this epilogue, or None if there is none."""
  for name in kernels.names():
    kernel = fused_epilogue_kernel(name)
    if kernel is not None and (kernel.block_size, kernel.activation, kernel.quantize_output) == (
        block_size, activation, quantize_output):
      return name
  return None


def equivalent_kernel(name: str) -> str:
  """The per-pass kernel quantizing its operands as fused kernel `name`'s forward does (its
  default backward): the kernel's own `equivalent`, else FUSED_EQUIVALENT."""
  kernel = fused_epilogue_kernel(name)
  return getattr(kernel, "equivalent", None) or FUSED_EQUIVALENT


def backward_kernel(choice: KernelChoice, site: str) -> str:
  """The one per-pass kernel a fused site's backward uses for dgrad and wgrad."""
  grads = {choice.grad_lhs, choice.grad_rhs}
  equivalent = equivalent_kernel(choice.fwd)
  if grads == {choice.fwd}:
    return equivalent
  if len(grads) != 1 or choice.fwd in grads:
    raise ValueError(
        f"site {site}: fused kernel {choice.fwd} runs dgrad and wgrad with one per-pass "
        f"kernel, but the plan gives grad_lhs={choice.grad_lhs!r}, "
        f"grad_rhs={choice.grad_rhs!r}; name the same per-pass kernel for both (or the fused "
        f"kernel for all three passes, which means {equivalent})")
  name = grads.pop()
  if kernels.get(name).sort != kernels.PER_PASS:
    raise ValueError(f"site {site}: the backward of fused kernel {choice.fwd} needs a "
                     f"per-pass kernel, got {name!r} ({kernels.get(name).sort})")
  return name


class FusedDenseNormAct(DenseSite):
  """act(BlockNorm(x @ kernel + bias)) as one GEMM site (see the module docstring).

  Attributes (besides DenseSite's `features`, `use_bias`, `config`, initializers):
    block_size: BlockNorm block width, or None for no norm (Dense -> activation).
    activation: any `functional.ACTIVATIONS` name unfused; fused kernels exist for 'relu' and
      'hard_swish'.
    epsilon: BlockNorm epsilon (added to each block's mean square).
    quantize_output: return a rowwise e4m3 QTensor (scales over the last axis) that a next
      FusedDenseNormAct consumes without a quantize pass. Forward-only (inference chains):
      a QTensor carries no float gradient.

  The input may be an array or such a QTensor. Array outputs are in the policy's output dtype.
  """
  block_size: Optional[int] = functional.DEFAULT_BLOCK
  activation: str = "relu"
  epsilon: float = functional.DEFAULT_EPS
  quantize_output: bool = False

  @nn.compact
  def __call__(self, x):
    if self.block_size is not None and self.block_size < 1:
      raise ValueError(f"site {site_name(self)}: block_size must be >= 1 or None, "
                       f"got {self.block_size}")
    functional.activation(self.activation)  # unknown names fail before any product
    policy = self.config.policy
    in_features = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, (in_features, self.features),
                        policy.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), policy.param_dtype)
            if self.use_bias else None)
    name = site_name(self)
    choice = self.config.plan.choice_for(name)
    fused = fused_epilogue_kernel(choice.fwd)
    if fused is None:
      return self._unfused(x, kernel, bias)
    self._check_epilogue(fused, name)
    backward = backward_kernel(choice, name)
    lead = x.shape[:-1]
    self._check_backward(backward, name, (math.prod(lead), in_features))
    if self._probe_wants_gradients():
      return self._unfused(x, kernel, bias, KernelChoice(fused.equivalent, backward, backward))
    return self._fused(x, kernel, bias, backward, fused.core)

  def _fused(self, x, kernel, bias, backward: str, core: str):
    from kernels_pallas import fused as fused_lib  # the Pallas plugin; present when registered
    policy = self.config.policy
    w = kernel.astype(policy.compute_dtype)
    x_in = x if isinstance(x, QTensor) else x.astype(policy.compute_dtype)
    self._observe_operands(x, w)
    return fused_lib.fused_dense(
        x_in, w, bias=bias, block_size=self.block_size, activation=self.activation,
        quantize_output=self.quantize_output, out_dtype=policy.output_dtype,
        backward=backward, eps=self.epsilon, core=core)

  def _unfused(self, x, kernel, bias, choice: Optional[KernelChoice] = None):
    policy = self.config.policy
    if isinstance(x, QTensor):
      x = x.dequantize(policy.compute_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape((math.prod(lead), x.shape[-1])).astype(policy.compute_dtype)
    w = kernel.astype(policy.compute_dtype)
    if choice is None:
      z = self._product(DENSE_SPEC, ACT_WEIGHT, x2, w)
    else:  # the fused kernel's per-pass equivalent (probe gradients)
      kernels.validate_choice(choice, DENSE_SPEC, ACT_WEIGHT, x2.shape, w.shape,
                              site_name=site_name(self))
      probe_hooks.observe_operands(self, DENSE_SPEC, ACT_WEIGHT, x2, w)
      z = kernels.per_pass_product(DENSE_SPEC, choice, policy.output_dtype, x2, w)
      z = probe_hooks.observe_output_grad(self, z)
    z = z.reshape(lead + (self.features,))
    if bias is not None:
      z = z + bias.astype(z.dtype)
    return self.epilogue(z)

  def epilogue(self, z):
    """BlockNorm, activation and the optional next-layer quantization of a product `z`
    (bias included): the unfused form of what a fused kernel computes after its GEMM."""
    policy = self.config.policy
    y = z.astype(policy.compute_dtype)
    if self.block_size is not None:
      y = functional.block_norm(y, self.block_size, self.epsilon)
    y = functional.activation(self.activation)(y)
    if self.quantize_output:
      return scaling.quantize(y.astype(jnp.float32), E4M3, ROWWISE, (y.ndim - 1,))
    return y.astype(policy.output_dtype)

  def _check_epilogue(self, fused, name: str) -> None:
    kernel_epilogue = (fused.block_size, fused.activation, fused.quantize_output)
    layer_epilogue = (self.block_size, self.activation, self.quantize_output)
    if kernel_epilogue == layer_epilogue:
      return
    match = fused_kernel_name(*layer_epilogue)
    hint = (f"use {match} for this site" if match else
            "no registered fused kernel computes it; give this site a per-pass kernel")
    raise ValueError(
        f"site {name}: fused kernel {fused.name} computes {epilogue_of(*kernel_epilogue)}, "
        f"but the layer computes {epilogue_of(*layer_epilogue)}; {hint}")

  def _check_backward(self, backward: str, name: str, x2_shape) -> None:
    w_shape = (x2_shape[1], self.features)
    kernel = kernels.get(backward)
    problems = [r for p in ("grad_lhs", "grad_rhs")
                if (r := kernel.unsupported_reason(DENSE_SPEC.for_pass(p), p, ACT_WEIGHT,
                                                   x2_shape, w_shape))]
    if problems:
      raise ValueError(f"site {name}: backward kernel of the fused form: " + "; ".join(problems))

  def _probe_wants_gradients(self) -> bool:
    return probe_hooks.wants_output_grad(self)

  def _observe_operands(self, x, w) -> None:
    dense = x.dequantize(w.dtype) if isinstance(x, QTensor) else x
    x2 = dense.reshape((-1, dense.shape[-1]))
    probe_hooks.observe_operands(self, DENSE_SPEC, ACT_WEIGHT, x2, w)


def fused_sites(model: nn.Module, batch) -> Dict[str, Tuple[Optional[int], str, bool]]:
  """{site name: (block_size, activation, quantize_output)} of every FusedDenseNormAct the
  model calls on `batch` (abstract trace, nothing compiled)."""
  with recording_chains() as found:
    jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b), batch)
  return {name: chain.epilogue for name, chain in found.items()}


def fused_plan(model: nn.Module, batch, base: KernelPlan,
               backward: str = FUSED_EQUIVALENT) -> Tuple[KernelPlan, Dict[str, str]]:
  """`base` with every fusable site of `model` switched to its matching fused kernel.

  Returns (plan, {site: fused kernel}); sites whose epilogue no registered kernel computes
  keep `base`'s choice. The fused entries go first, so they win over `base`'s own entries.
  """
  chosen = {}
  for name, epilogue in fused_sites(model, batch).items():
    kernel = fused_kernel_name(*epilogue)
    if kernel is not None:
      chosen[name] = kernel
  entries = tuple((name, KernelChoice(kernel, backward, backward))
                  for name, kernel in chosen.items())
  return KernelPlan(sites=entries + base.sites, rules=base.rules, default=base.default), chosen
