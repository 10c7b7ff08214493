"""The benchmark's arms: a precision with its kernel (or plan) and the Mods on or off."""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Sequence, Tuple

from loka_jax import kernels as kernels_lib
from loka_jax.kernels import EinsumSpec, KernelChoice, KernelPlan
from loka_jax.kernels.spec import PASSES

# How a variant picks its kernels: one kernel everywhere, the best Pallas kernel per site, or
# the LoKA plan of the target (probe -> select).
UNIFORM, PALLAS, PLAN = "uniform", "pallas", "plan"


@dataclasses.dataclass(frozen=True)
class Variant:
  """One arm: a precision (fp32, bf16, fp8_all, loka) with its kernel, and the Mods on."""
  name: str
  precision: str
  kernel: str = "xla_fp8_tensorwise"
  mods: Sequence[str] = ()
  kernels_from: str = UNIFORM
  # Inference served by the exported model (weights stored once in their serving dtype),
  # as the LoKA arm's is; the others infer from the training state's float32 parameters.
  served: bool = False
  # kernels_from=PALLAS: the kernels tried per site, first supported wins, and the kernel of
  # the sites none of them supports.
  preference: Sequence[str] = ()
  fallback: str = ""

  @property
  def label(self) -> str:
    return LABELS.get(self.name, self.name)


VARIANTS: Dict[str, Variant] = {
    "fp32": Variant("fp32", "fp32"),
    "bf16": Variant("bf16", "bf16"),
    "bf16_mods": Variant("bf16_mods", "bf16", mods=("all",)),
    # bf16+Mods served like LoKA: the export of an all-bf16 plan, every weight stored in bf16
    # once, so its inference compares with LoKA's exported one on the same footing.
    "bf16_mods_served": Variant("bf16_mods_served", "bf16", mods=("all",), served=True),
    "flax_fp8_delayed": Variant("flax_fp8_delayed", "fp8_all", "flax_fp8_delayed"),
    "flax_fp8_delayed_fwd": Variant("flax_fp8_delayed_fwd", "fp8_all", "flax_fp8_delayed_fwd"),
    "flax_fp8_delayed_grad_lhs": Variant("flax_fp8_delayed_grad_lhs", "fp8_all",
                                         "flax_fp8_delayed_grad_lhs"),
    "fp8_tensorwise": Variant("fp8_tensorwise", "fp8_all", "xla_fp8_tensorwise"),
    "fp8_rowwise": Variant("fp8_rowwise", "fp8_all", "xla_fp8_rowwise"),
    "pallas": Variant("pallas", "fp8_all", "pallas_fp8_rowwise", kernels_from=PALLAS,
                      preference=("pallas_fp8_rowwise", "pallas_fp8_batched"),
                      fallback="xla_fp8_rowwise"),
    # Delayed scaling with the Pallas one-pass quantize where a site's product is an
    # activation times a 2-D weight, Flax's op at the others (act x act products).
    "pallas_delayed": Variant("pallas_delayed", "fp8_all", "pallas_fp8_delayed",
                              kernels_from=PALLAS, preference=("pallas_fp8_delayed",),
                              fallback="flax_fp8_delayed"),
    "loka": Variant("loka", "loka", mods=("all",), kernels_from=PLAN),
}
LABELS = {"fp32": "fp32", "bf16": "bf16", "bf16_mods": "bf16+Mods",
          "bf16_mods_served": "bf16+Mods (served)", "flax_fp8_delayed": "Flax FP8 (delayed)",
          "flax_fp8_delayed_fwd": "FP8 fwd (delayed), bf16 grads",
          "flax_fp8_delayed_grad_lhs": "FP8 fwd + grad_lhs (delayed), bf16 grad_rhs",
          "fp8_tensorwise": "XLA FP8 tensorwise", "fp8_rowwise": "XLA FP8 rowwise",
          "pallas": "Pallas FP8", "pallas_delayed": "Pallas FP8 (delayed)", "loka": "LoKA"}
# The one-kernel-everywhere peers LoKA must match or beat (`targets`).
PEERS = ("flax_fp8_delayed", "flax_fp8_delayed_fwd", "flax_fp8_delayed_grad_lhs",
         "fp8_tensorwise", "fp8_rowwise", "pallas", "pallas_delayed")
BASELINE = "bf16"
# The `pallas` variant's kernels per site, first supported wins (rowwise led the GEMM bench;
# the batched kernel covers the act x act batched products the 2-D kernels cannot).
PALLAS_PREFERENCE = VARIANTS["pallas"].preference
PALLAS_FALLBACK = VARIANTS["pallas"].fallback


def parse_variants(names: Sequence[str]) -> Tuple[Variant, ...]:
  """The variants named, bf16 first (every row's baseline); unknown names are an error."""
  names = [n.strip() for n in names if n and n.strip()]
  if not names or names == ["all"]:
    names = list(VARIANTS)
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    raise ValueError(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
  ordered = [BASELINE] + [n for n in names if n != BASELINE]
  return tuple(VARIANTS[n] for n in dict.fromkeys(ordered))


def _supported(kernel_name: str, product) -> bool:
  kernel = kernels_lib.get(kernel_name)
  spec = EinsumSpec.parse(product.spec)
  for p in PASSES:
    if p not in kernel.passes and kernel.passes:
      return False
    if kernel.unsupported_reason(spec.for_pass(p), p, product.kind, product.lhs_shape,
                                 product.rhs_shape):
      return False
  return True


def pallas_plan(products: Mapping[str, object],
                preference: Sequence[str] = PALLAS_PREFERENCE,
                fallback: str = PALLAS_FALLBACK) -> Tuple[KernelPlan, Dict[str, str]]:
  """(plan, {site: kernel}) giving every site the first Pallas kernel that supports it, else
  `fallback` (said in the second value, so the row records how much Pallas really ran)."""
  sites, chosen = [], {}
  for name, product in products.items():
    kernel = next((k for k in preference if _supported(k, product)), fallback)
    chosen[name] = kernel
    sites.append((name, KernelChoice.uniform(kernel)))
  return KernelPlan(sites=tuple(sites), default=KernelChoice.uniform(fallback)), chosen


def pallas_coverage(chosen: Mapping[str, str],
                    preference: Sequence[str] = PALLAS_PREFERENCE) -> Optional[float]:
  """Fraction of sites that got one of the `preference` kernels (None without sites)."""
  if not chosen:
    return None
  return sum(k in preference for k in chosen.values()) / len(chosen)


__all__ = ["Variant", "VARIANTS", "LABELS", "PEERS", "BASELINE", "parse_variants",
           "pallas_plan", "pallas_coverage"]
