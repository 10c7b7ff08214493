"""Two-operand einsum specs: the contract every GEMM site declares, and its three passes.

A site computes `out = einsum("lhs,rhs->out", lhs, rhs)`. Its passes are themselves einsums:
  fwd       lhs, rhs -> out
  grad_lhs  g,   rhs -> lhs   (dgrad)
  grad_rhs  lhs, g   -> rhs   (wgrad; for act x act the second operand's gradient)
This holds when every index of an operand appears in the output or in the other operand (no
one-sided sums) and no index repeats within an operand, which `EinsumSpec` enforces.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

PASSES = ("fwd", "grad_lhs", "grad_rhs")
ACT_WEIGHT = "act_weight"
ACT_ACT = "act_act"
KINDS = (ACT_WEIGHT, ACT_ACT)


def check_pass(pass_name: str) -> str:
  if pass_name not in PASSES:
    raise ValueError(f"unknown pass {pass_name!r}; passes are {PASSES}")
  return pass_name


def check_kind(kind: str) -> str:
  if kind not in KINDS:
    raise ValueError(f"unknown site kind {kind!r}; kinds are {KINDS}")
  return kind


@dataclasses.dataclass(frozen=True)
class EinsumSpec:
  lhs: str
  rhs: str
  out: str

  @classmethod
  @functools.lru_cache(maxsize=None)
  def parse(cls, spec: str) -> "EinsumSpec":
    text = spec.replace(" ", "")
    try:
      inputs, out = text.split("->")
      lhs, rhs = inputs.split(",")
    except ValueError:
      raise ValueError(f"einsum spec {spec!r} must look like 'ab,bc->ac' (two operands)") from None
    for part, name in ((lhs, "lhs"), (rhs, "rhs"), (out, "out")):
      if not part.isalpha() or not part.isascii():
        raise ValueError(f"einsum spec {spec!r}: {name} {part!r} must be ascii letters (no '...')")
      if len(set(part)) != len(part):
        raise ValueError(f"einsum spec {spec!r}: repeated index in {name} {part!r}")
    for idx in out:
      if idx not in lhs and idx not in rhs:
        raise ValueError(f"einsum spec {spec!r}: output index {idx!r} is in no operand")
    for part, other, name in ((lhs, rhs, "lhs"), (rhs, lhs, "rhs")):
      for idx in part:
        if idx not in out and idx not in other:
          raise ValueError(
              f"einsum spec {spec!r}: index {idx!r} of {name} is summed in one operand only; "
              "sum it before the site")
    if not set(lhs) & set(rhs) - set(out) and not set(lhs) & set(rhs):
      raise ValueError(f"einsum spec {spec!r} shares no index between operands: not a product")
    return cls(lhs, rhs, out)

  def __str__(self):
    return f"{self.lhs},{self.rhs}->{self.out}"

  def for_pass(self, pass_name: str) -> "EinsumSpec":
    check_pass(pass_name)
    if pass_name == "fwd":
      return self
    if pass_name == "grad_lhs":
      return EinsumSpec(self.out, self.rhs, self.lhs)
    return EinsumSpec(self.lhs, self.out, self.rhs)

  @property
  def contracting(self) -> str:
    return "".join(i for i in self.lhs if i in self.rhs and i not in self.out)

  @property
  def batch(self) -> str:
    return "".join(i for i in self.lhs if i in self.rhs and i in self.out)

  def contracting_axes(self, operand: str) -> Tuple[int, ...]:
    """Axes of `operand` ('lhs' or 'rhs') that this product sums over."""
    labels = self.lhs if operand == "lhs" else self.rhs
    return tuple(i for i, idx in enumerate(labels) if idx not in self.out)

  def dimension_numbers(self):
    c = self.contracting
    b = self.batch
    return (((tuple(self.lhs.index(i) for i in c), tuple(self.rhs.index(i) for i in c)),
             (tuple(self.lhs.index(i) for i in b), tuple(self.rhs.index(i) for i in b))))

  def dot_general_labels(self) -> str:
    """Labels of lax.dot_general's result: batch, lhs free, rhs free."""
    b = self.batch
    lhs_free = "".join(i for i in self.lhs if i not in self.rhs)
    rhs_free = "".join(i for i in self.rhs if i not in self.lhs)
    return b + lhs_free + rhs_free

  def output_permutation(self) -> Tuple[int, ...]:
    labels = self.dot_general_labels()
    return tuple(labels.index(i) for i in self.out)

  def shapes(self, lhs_shape, rhs_shape):
    """Checks operand shapes against the spec; returns the output shape."""
    if len(lhs_shape) != len(self.lhs) or len(rhs_shape) != len(self.rhs):
      raise ValueError(
          f"einsum {self}: operand ranks {len(lhs_shape)}, {len(rhs_shape)} do not match "
          f"the spec ({len(self.lhs)}, {len(self.rhs)}); shapes {tuple(lhs_shape)}, "
          f"{tuple(rhs_shape)}")
    sizes = {}
    for labels, shape, name in ((self.lhs, lhs_shape, "lhs"), (self.rhs, rhs_shape, "rhs")):
      for idx, size in zip(labels, shape):
        if sizes.setdefault(idx, size) != size:
          raise ValueError(
              f"einsum {self}: index {idx!r} has size {sizes[idx]} in lhs but {size} in {name}; "
              f"shapes {tuple(lhs_shape)}, {tuple(rhs_shape)}")
    return tuple(sizes[i] for i in self.out)

  def flops(self, lhs_shape, rhs_shape) -> int:
    sizes = dict(zip(self.lhs, lhs_shape))
    sizes.update(zip(self.rhs, rhs_shape))
    total = 2
    for size in sizes.values():
      total *= int(size)
    return total


def operand_roles(pass_name: str) -> Tuple[str, str]:
  """Which operands of a pass are activations/weights ('x') and which the output grad ('g')."""
  check_pass(pass_name)
  return {"fwd": ("x", "x"), "grad_lhs": ("g", "x"), "grad_rhs": ("x", "g")}[pass_name]
