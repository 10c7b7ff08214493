"""Static kernel choices: per pass for one site, and per site for a model (hashable, so a
choice is part of the module config and jit specializes on it)."""
from __future__ import annotations

import dataclasses
import re
from typing import Tuple

from loka_jax.kernels.spec import PASSES


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """The kernel name of each pass of one site."""
  fwd: str = "xla_bf16"
  grad_lhs: str = "xla_bf16"
  grad_rhs: str = "xla_bf16"

  @classmethod
  def uniform(cls, name: str) -> "KernelChoice":
    return cls(name, name, name)

  @classmethod
  def from_dict(cls, d) -> "KernelChoice":
    unknown = set(d) - set(PASSES)
    if unknown:
      raise ValueError(f"unknown pass name(s) {sorted(unknown)}; passes are {PASSES}")
    return cls(**{p: d[p] for p in PASSES if p in d})

  def for_pass(self, pass_name: str) -> str:
    return getattr(self, pass_name)

  def items(self):
    return tuple((p, self.for_pass(p)) for p in PASSES)

  def to_dict(self):
    return dict(self.items())


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """Site name -> KernelChoice: exact entries, then regex rules (re.fullmatch on the site
  name, first match wins), then the default. The JSON Plan of loka_jax.dispatch compiles to it."""
  sites: Tuple[Tuple[str, KernelChoice], ...] = ()
  rules: Tuple[Tuple[str, KernelChoice], ...] = ()
  default: KernelChoice = KernelChoice()
  # Sites whose choice runs only where the run's `site_switch` variables turn it on, xla_bf16
  # elsewhere (`models.site.SITE_SWITCH`): one compiled program then evaluates any subset of
  # them (validation's held-out measurements). Runtime only; no plan file holds it.
  switched: Tuple[str, ...] = ()

  @classmethod
  def uniform(cls, name: str) -> "KernelPlan":
    return cls(default=KernelChoice.uniform(name))

  def choice_for(self, site_name: str) -> KernelChoice:
    for name, choice in self.sites:
      if name == site_name:
        return choice
    for pattern, choice in self.rules:
      if re.fullmatch(pattern, site_name):
        return choice
    return self.default

  def kernel_names(self):
    names = set(self.default.to_dict().values())
    for _, choice in self.sites + self.rules:
      names.update(choice.to_dict().values())
    return sorted(names)
