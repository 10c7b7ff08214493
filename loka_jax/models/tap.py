"""Where sites hand their operands to the probe. Off unless the probe asks, so training and
inference pay nothing for it.

Two ways to ask:
- a *tap* (`tapping`): while one is active, every site records its forward operands and adds
  the tap's zero perturbation to its output, whose gradient is d loss / d out. A tap needs no
  variable collection, so it works through any `apply_fn` a user writes around
  `model.apply`; the statistics pass uses it.
- Flax collections: sites `sow` their operands into `probe` when it is mutable, and add
  Flax's zero `perturb` variable (collection `probe_grads`) to their output.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import jax

PROBE_COLLECTION = "probe"             # sown forward operands, per site
PROBE_GRAD_COLLECTION = "probe_grads"  # zero perturbations whose gradient is d loss / d out


@dataclasses.dataclass(frozen=True)
class TappedSite:
  """What a tap saw of one site: its product and the shape of its output."""
  spec: str
  kind: str
  lhs: Any            # the forward operands (arrays, tracers or ShapeDtypeStructs)
  rhs: Any
  out: Optional[jax.ShapeDtypeStruct] = None


class Tap:
  """Records each site's first call in one forward pass (a site called twice per step keeps
  its first call's operands, as the Flax collections do) and perturbs that call's output."""

  def __init__(self, perturbations: Optional[Mapping[str, Any]] = None):
    self.perturbations = perturbations
    self.sites: Dict[str, TappedSite] = {}

  def record(self, name: str, spec, kind: str, lhs, rhs) -> None:
    if name not in self.sites:
      self.sites[name] = TappedSite(str(spec), kind, lhs, rhs)

  def perturb(self, name: str, out):
    site = self.sites.get(name)
    if site is None or site.out is not None:
      return out
    self.sites[name] = dataclasses.replace(site, out=jax.ShapeDtypeStruct(out.shape, out.dtype))
    if self.perturbations is None or name not in self.perturbations:
      return out   # a site the probe does not observe
    return out + self.perturbations[name].astype(out.dtype)

  def operands(self) -> Dict[str, Tuple[Any, Any]]:
    return {name: (s.lhs, s.rhs) for name, s in self.sites.items()}


_ACTIVE: contextvars.ContextVar[Optional[Tap]] = contextvars.ContextVar("loka_probe_tap",
                                                                         default=None)


@contextlib.contextmanager
def tapping(perturbations: Optional[Mapping[str, Any]] = None) -> Iterator[Tap]:
  """Within this context, sites report to a new Tap (returned)."""
  tap = Tap(perturbations)
  token = _ACTIVE.set(tap)
  try:
    yield tap
  finally:
    _ACTIVE.reset(token)


def active_tap() -> Optional[Tap]:
  return _ACTIVE.get()


def discover_sites(loss_of: Callable, variables, batch) -> Dict[str, TappedSite]:
  """{site name: what the tap saw} of one forward pass, in call order (abstract trace)."""
  found: Dict[str, TappedSite] = {}

  def run(v, b):
    with tapping() as tap:
      loss = loss_of(v, b, None)
    for name, site in tap.sites.items():
      found[name] = dataclasses.replace(
          site, lhs=jax.ShapeDtypeStruct(site.lhs.shape, site.lhs.dtype),
          rhs=jax.ShapeDtypeStruct(site.rhs.shape, site.rhs.dtype))
    return loss
  jax.eval_shape(run, variables, batch)
  return found


def _name(module) -> str:
  return "/".join(module.path) or module.name or "<root>"


def observe_operands(module, spec, kind, lhs, rhs) -> None:
  """Hands a site's forward operands to the active tap, else sows them when the probe
  collection is mutable."""
  if module.is_initializing():
    return
  tap = active_tap()
  if tap is not None:
    tap.record(_name(module), spec, kind, lhs, rhs)
    return
  if not module.is_mutable_collection(PROBE_COLLECTION):
    return
  module.sow(PROBE_COLLECTION, "lhs", lhs)
  module.sow(PROBE_COLLECTION, "rhs", rhs)


def wants_output_grad(module) -> bool:
  """Whether the probe asks this site for its output gradient."""
  if module.is_initializing():
    return False
  return (active_tap() is not None or module.is_mutable_collection(PROBE_GRAD_COLLECTION)
          or module.has_variable(PROBE_GRAD_COLLECTION, "out"))


def observe_output_grad(module, out):
  """Adds the probe's zero perturbation to the site output (the tap's, else Flax's `perturb`
  variable when its collection is mutable or passed in); its gradient is the output gradient
  of the site."""
  if module.is_initializing():
    return out
  tap = active_tap()
  if tap is not None:
    return tap.perturb(_name(module), out)
  return module.perturb("out", out, collection=PROBE_GRAD_COLLECTION)
