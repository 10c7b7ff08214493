"""Where each operand of a site's product keeps its rows and its features.

The probe models every operand as rows drawn from one distribution over its *features*: the
indices it contracts in the forward product (for the output gradient: in dgrad). Each operand
therefore has a canonical 3-D view `(batch, free, features)`:

  lhs   (batch, lhs-free, contracting)   fwd contracts features, wgrad contracts free
  rhs   (batch, rhs-free, contracting)   fwd contracts features, dgrad contracts free
  grad  (batch, lhs-free, rhs-free)      dgrad contracts features, wgrad contracts free

Batch indices (in both operands and the output) are never contracted. Rows are batch x free.
The reservoir keeps whole *slices* along one row index of the lhs that the output (and, for
act x act sites, the rhs) shares, so an input slice and the output-gradient slice of the same
example stay paired.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple

import jax.numpy as jnp

from loka_jax.kernels.spec import ACT_ACT, ACT_WEIGHT, EinsumSpec, check_kind

OPERANDS = ("lhs", "rhs", "grad")
# Which pass contracts which canonical axis of an operand: 2 = features, 1 = free.
PASS_AXES = {"lhs": {"fwd": 2, "grad_rhs": 1}, "rhs": {"fwd": 2, "grad_lhs": 1},
             "grad": {"grad_lhs": 2, "grad_rhs": 1}}


@dataclasses.dataclass(frozen=True)
class OperandLayout:
  """One operand's labels and shape, and its canonical (batch, free, features) view."""
  labels: str
  shape: Tuple[int, ...]
  batch: str
  free: str
  features: str

  def _size(self, group: str) -> int:
    return math.prod(self.shape[self.labels.index(i)] for i in group)

  @property
  def perm(self) -> Tuple[int, ...]:
    return tuple(self.labels.index(i) for i in self.batch + self.free + self.features)

  @property
  def canonical_shape(self) -> Tuple[int, int, int]:
    return (self._size(self.batch), self._size(self.free), self._size(self.features))

  @property
  def num_features(self) -> int:
    return self._size(self.features)

  @property
  def num_rows(self) -> int:
    return self._size(self.batch) * self._size(self.free)

  def to_canonical(self, x):
    """x with this layout's shape -> (batch, free, features)."""
    return jnp.transpose(x, self.perm).reshape(self.canonical_shape)

  def to_rows(self, x):
    """x -> (rows, features)."""
    return self.to_canonical(x).reshape(self.num_rows, self.num_features)

  def from_rows(self, rows):
    """(rows, features) -> an array of this layout's shape (inverse of `to_rows`)."""
    grouped = tuple(self.shape[self.labels.index(i)]
                    for i in self.batch + self.free + self.features)
    x = rows.reshape(grouped)
    inverse = tuple(sorted(range(len(self.perm)), key=lambda i: self.perm[i]))
    return jnp.transpose(x, inverse)

  def with_size(self, label: str, size: int) -> "OperandLayout":
    """The same layout with index `label` resized (row subsampling)."""
    if label not in self.labels:
      return self
    shape = list(self.shape)
    shape[self.labels.index(label)] = size
    return dataclasses.replace(self, shape=tuple(shape))


def _layout(labels: str, shape, batch: str, features: str) -> OperandLayout:
  if len(labels) != len(shape):
    raise ValueError(f"operand labels {labels!r} do not match shape {tuple(shape)}")
  b = "".join(i for i in labels if i in batch)
  f = "".join(i for i in labels if i in features)
  free = "".join(i for i in labels if i not in b and i not in f)
  return OperandLayout(labels, tuple(int(s) for s in shape), b, free, f)


@dataclasses.dataclass(frozen=True)
class SiteLayout:
  """The three operand layouts of one site and the row index the reservoir slices along."""
  spec: EinsumSpec
  kind: str
  lhs: OperandLayout
  rhs: OperandLayout
  grad: OperandLayout
  slice_label: Optional[str]     # None: no index pairs all operands (no reservoir)
  slice_reason: Optional[str]    # why there is no slice index

  def operand(self, name: str) -> OperandLayout:
    return {"lhs": self.lhs, "rhs": self.rhs, "grad": self.grad}[name]

  @property
  def num_slices(self) -> int:
    return self.lhs.shape[self.lhs.labels.index(self.slice_label)] if self.slice_label else 0

  def sliced_operands(self) -> Tuple[str, ...]:
    """Operands the reservoir slices (the weight of an act x weight site is kept whole)."""
    return ("lhs", "rhs", "grad") if self.kind == ACT_ACT else ("lhs", "grad")

  def slice_axis(self, operand: str) -> int:
    return self.operand(operand).labels.index(self.slice_label)

  def slice_shape(self, operand: str) -> Tuple[int, ...]:
    layout = self.operand(operand)
    axis = self.slice_axis(operand)
    return layout.shape[:axis] + layout.shape[axis + 1:]

  def subsampled(self, slices: int) -> "SiteLayout":
    """The layout with `slices` entries along the slice index (row subsampling)."""
    if not self.slice_label or slices == self.num_slices:
      return self
    resize = lambda o: o.with_size(self.slice_label, slices)
    weight = self.rhs if self.kind == ACT_WEIGHT else resize(self.rhs)
    return dataclasses.replace(self, lhs=resize(self.lhs), rhs=weight, grad=resize(self.grad))

  def pass_operands(self, pass_name: str) -> Tuple[str, str]:
    """(a, b) operand names of a pass, in the order the kernel takes them."""
    return {"fwd": ("lhs", "rhs"), "grad_lhs": ("grad", "rhs"),
            "grad_rhs": ("lhs", "grad")}[pass_name]

  def shapes(self) -> Dict[str, Tuple[int, ...]]:
    return {"lhs": self.lhs.shape, "rhs": self.rhs.shape, "out": self.grad.shape}


def site_layout(spec, kind: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]
                ) -> SiteLayout:
  """The canonical views of a site's lhs, rhs and output gradient."""
  spec = spec if isinstance(spec, EinsumSpec) else EinsumSpec.parse(spec)
  check_kind(kind)
  out_shape = spec.shapes(lhs_shape, rhs_shape)
  batch = spec.batch
  rhs_free = "".join(i for i in spec.rhs if i not in spec.lhs)
  lhs = _layout(spec.lhs, lhs_shape, batch, spec.contracting)
  rhs = _layout(spec.rhs, rhs_shape, batch, spec.contracting)
  grad = _layout(spec.out, out_shape, batch, rhs_free)
  candidates = [i for i in spec.lhs if i in spec.out]
  if kind == ACT_ACT:
    candidates = [i for i in candidates if i in spec.rhs]
  label = candidates[0] if candidates else None
  reason = None if label else (
      f"spec {spec}: no lhs row index is shared by the output"
      + (" and the rhs" if kind == ACT_ACT else "") + ", so rows cannot be paired")
  return SiteLayout(spec, kind, lhs, rhs, grad, label, reason)
