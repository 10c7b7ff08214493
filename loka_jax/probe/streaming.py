"""The probe on any Flax model: `Probe` observes the user's own batches with the user's own
loss (every N steps of their training loop, or over a fixed set of batches: `probe`), then
evaluates every candidate kernel on every site and pass and writes a ProbeReport.

  probe = Probe(model, loss_fn)                  # loss_fn(model_output, batch) -> scalar
  for step, batch in enumerate(batches):
    ...                                          # the user's training step
    if step % 25 == 0:
      probe.observe(variables, batch)            # jitted statistics pass, no training
  report = probe.report()                        # loka.probe/2

Sites are the model's plain `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` layers (routed
through GEMM sites for the probe, named by their Linen paths) and its loka_jax sites. Matrix
products anywhere else (a `jnp.dot` in a module, `nn.Conv`, a Dense subclass) are listed in
the report under `unrouted_products`: they stay in the model's own precision.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.kernels import KernelPlan
from loka_jax.precision import BF16, DtypePolicy
from loka_jax.probe import assemble
from loka_jax.probe import candidates as candidates_lib
from loka_jax.probe import collector as collector_lib
from loka_jax.probe import stats_report
from loka_jax.models import fused as fused_lib
from loka_jax.models import routing as routing_lib
from loka_jax.models import tap as probe_hooks
from loka_jax.probe.collector import ProbeConfig
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.options import ProbeOptions

BASELINE_PLAN = KernelPlan.uniform(candidates_lib.BASELINE)
# On a CPU the fast-accumulation twins compute what these compute, and the delayed-scaling ops
# take minutes per site in evaluation; on a GPU every registered candidate is evaluated.
CPU_KERNELS = ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise")
# Primitives that multiply matrices: any of them outside a site is a product the plan cannot
# reach.
PRODUCT_PRIMITIVES = ("dot_general", "conv_general_dilated")


class ProbeInputError(ValueError):
  """A model, loss or batch the probe cannot work with; the message says what to change."""


def default_timing_cache() -> str:
  """Where measured kernel timings are kept between runs (per device kind inside)."""
  root = os.environ.get("LOKA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "loka_jax")
  return os.path.join(root, "timing_cache")


# ----------------------------------------------------------------------------- the model


def model_forward(model, apply_fn: Optional[Callable], apply_kwargs: Optional[Mapping]
                  ) -> Callable:
  """`forward(variables, batch) -> model output`: `apply_fn` itself, else
  `model.apply(variables, batch, **apply_kwargs)`."""
  if apply_fn is not None:
    if hasattr(apply_fn, "lower") and hasattr(apply_fn, "trace"):
      # A jitted function keeps its first trace, made without the plan's routing: loka_jax
      # would then probe or check a model none of whose layers run as sites.
      raise ProbeInputError("apply_fn is jitted (jax.jit); pass the plain function: loka_jax "
                            "jits it itself, with its layers routed through GEMM sites")
    if apply_kwargs:
      raise ProbeInputError("give apply_fn or apply_kwargs, not both: apply_fn calls the model "
                            "itself")
    return apply_fn
  kwargs = dict(apply_kwargs or {})
  return lambda variables, batch: model.apply(variables, batch, **kwargs)


def routed_loss(forward: Callable, loss_fn: Callable, policy: Optional[DtypePolicy],
                plan: KernelPlan = BASELINE_PLAN) -> Callable:
  """`loss_of(variables, batch, rng) -> scalar`: the model's plain layers routed through GEMM
  sites under `plan`, then the user's loss; a loss that is not a scalar is refused."""

  def loss_of(variables, batch, rng):
    del rng
    with routing_lib.routing(plan, policy):
      out = forward(variables, batch)
    loss = loss_fn(out, batch)
    if jnp.shape(loss) != ():
      raise ProbeInputError(
          f"loss_fn returned an array of shape {jnp.shape(loss)}; it must return one scalar "
          "(for example the mean over the batch)")
    if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise ProbeInputError(f"loss_fn returned {jnp.result_type(loss)}; it must return a "
                            "floating-point scalar to be differentiated")
    return loss
  return loss_of


@dataclasses.dataclass(frozen=True)
class UnroutedProduct:
  """A matrix product outside every GEMM site: the plan cannot reach it."""
  where: str          # the Linen path of the module that computes it ('' at the top)
  primitive: str
  shapes: Tuple[Tuple[int, ...], ...]

  def describe(self) -> str:
    shapes = " x ".join(str(list(s)) for s in self.shapes)
    return f"{self.primitive} {shapes} in {self.where or 'the top-level module'}"


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(item, "eqns"):
        yield item
      elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
        yield item.jaxpr


def _products(jaxpr) -> List[Tuple[str, str, Tuple]]:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in PRODUCT_PRIMITIVES:
      shapes = tuple(tuple(int(d) for d in v.aval.shape) for v in eqn.invars)
      found.append((str(eqn.source_info.name_stack), eqn.primitive.name, shapes))
    for sub in _sub_jaxprs(eqn):
      found.extend(_products(sub))
  return found


def _module_path(name_stack: str, root: str) -> str:
  """The Linen path within a jaxpr name stack ('Model/tower/dense_0' -> 'tower/dense_0').
  Scopes that name no module go: `jnp.einsum` names its call by its spec ('ud,id->ui') and a
  jitted function by 'jit(f)'."""
  parts = name_stack.split("/")
  if root in parts:
    parts = parts[parts.index(root) + 1:]
  return "/".join(p for p in parts if p and not any(c in p for c in ",->()[] "))


def unrouted_products(loss_of: Callable, variables, batch, site_names: Sequence[str],
                      root: str) -> List[UnroutedProduct]:
  """The matrix products of one forward pass and loss that no site computes."""
  jaxpr = jax.make_jaxpr(lambda v, b: loss_of(v, b, None))(variables, batch)
  out = []
  for stack, primitive, shapes in _products(jaxpr.jaxpr):
    path = _module_path(stack, root)
    inside = any(path == s or path.startswith(s + "/") for s in site_names)
    if not inside:
      out.append(UnroutedProduct(path, primitive, shapes))
  return out


def _signature(tree) -> Tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def _signature_change(first: Tuple, now: Tuple) -> Optional[str]:
  if first[0] != now[0]:
    return f"its tree structure is {now[0]}, the first batch's {first[0]}"
  for i, (a, b) in enumerate(zip(first[1], now[1])):
    if a != b:
      return f"leaf {i} is {b[1]}{list(b[0])}, the first batch's {a[1]}{list(a[0])}"
  return None


# ----------------------------------------------------------------------------- the probe


class Probe:
  """Per-site statistics of a model in the user's own loop, then a ProbeReport.

  Args:
    model: a flax.linen Module whose matrix products are nn.Dense, nn.DenseGeneral,
      nn.Einsum or loka_jax sites.
    loss_fn: `loss_fn(model_output, batch) -> scalar`, any differentiable loss.
    apply_fn: `apply_fn(variables, batch) -> model output` (default:
      `model.apply(variables, batch, **apply_kwargs)`).
    apply_kwargs: keyword arguments of `model.apply` (with the default apply_fn).
    policy: the dtype policy of every site while probing: the bf16 baseline FP8 is
      measured against (parameters float32, products in bfloat16).
    name: the model's name in the report (default: its class name).
    sites: a regex (re.search on site names): probe only these sites.
    kernels: candidate kernels (default: on a GPU every registered kernel that computes a
      plain site product; on a CPU `CPU_KERNELS`).
    samples: draws per site from the learned distributions and from the reservoir.
    criteria: the eligibility criteria the report's `best` column uses (select may use
      others).
    timing_table: where to read timings from when not on a GPU (a path or a device kind;
      default: the committed table of the nearest card, marked estimated).
    timing_cache: where GPU timings are kept between runs (default: ~/.cache/loka_jax).
    config: how statistics are collected (ProbeConfig).
  """

  def __init__(self, model, loss_fn: Callable, *, apply_fn: Optional[Callable] = None,
               apply_kwargs: Optional[Mapping] = None, policy: Optional[DtypePolicy] = BF16,
               name: Optional[str] = None, sites: Optional[str] = None,
               kernels: Sequence[str] = (), samples: int = 100,
               criteria: Criteria = Criteria(), timing_table: Optional[str] = None,
               timing_cache: Optional[str] = None, config: ProbeConfig = ProbeConfig(cadence=1),
               seed: int = 0):
    if not callable(loss_fn):
      raise ProbeInputError(f"loss_fn must be callable as loss_fn(model_output, batch), got "
                            f"{type(loss_fn).__name__}")
    self.model = model
    self.name = name or type(model).__name__
    self.policy = policy
    self.config = config
    self.options = ProbeOptions(
        samples=samples, kernels=tuple(kernels), sites=sites, criteria=criteria,
        timing_table=timing_table, timing_cache=timing_cache or default_timing_cache(),
        write_table=False, plots=True, seed=seed)
    platform = jax.default_backend()
    chosen = self.options.kernels or (CPU_KERNELS if platform == "cpu" else None)
    self.kernels, self.excluded = candidates_lib.candidate_kernels(chosen, platform)
    self._loss_of = routed_loss(model_forward(model, apply_fn, apply_kwargs), loss_fn, policy)
    self.sites: Dict[str, collector_lib.SiteProbe] = {}
    self.unrouted: List[UnroutedProduct] = []
    self.state = None
    self._pass = None
    self._signature = None
    self._dtype: Dict[str, str] = {}
    self._tapped: Dict[str, probe_hooks.TappedSite] = {}
    self._seconds: List[float] = []
    self._compile_s: Optional[float] = None
    self._batches = 0

  # -- set-up on the first batch

  def find_sites(self, variables, batch) -> Dict[str, collector_lib.SiteProbe]:
    """{site name: SiteProbe} of the sites this probe observes (those `sites=` selects) in
    one forward pass on `batch`, in call order; also lists the products outside sites
    (`self.unrouted`). Abstract: `variables` may be shapes."""
    with fused_lib.recording_chains() as chains:  # the fused Mods layers' epilogues
      tapped = probe_hooks.discover_sites(self._loss_of, variables, batch)
    if not tapped:
      raise ProbeInputError(
          f"{self.name} computes no matrix product the probe can reach: route its products "
          "through nn.Dense, nn.DenseGeneral or nn.Einsum layers (or loka_jax sites), or pass "
          "the apply_fn that calls the model")
    # The jaxpr names the top-level module by its Linen name, else its class name.
    root = getattr(self.model, "name", None) or type(self.model).__name__
    self.unrouted = unrouted_products(self._loss_of, variables, batch, list(tapped), root)
    pattern = self.options.sites
    chosen = [n for n in tapped if pattern is None or re.search(pattern, n)]
    if not chosen:
      raise ProbeInputError(f"sites={pattern!r} matches none of the sites: {list(tapped)}")
    self._tapped = {n: tapped[n] for n in chosen}
    return {n: dataclasses.replace(
        collector_lib.make_site_probe(n, tapped[n].spec, tapped[n].kind, tapped[n].lhs.shape,
                                      tapped[n].rhs.shape, self.config), chain=chains.get(n))
            for n in chosen}

  def setup(self, variables, batch, *, sites: Optional[Mapping[str, Any]] = None, state=None,
            on_trace: Optional[Callable[[str], None]] = None) -> None:
    """Prepares observing batches like `batch`: the sites (found here, or the given
    SiteProbes, which must be called with their shapes), the statistics pass and the state
    (empty, or `state` restored). `observe` calls it on its first batch."""
    found = self.find_sites(variables, batch)
    if sites is not None:
      for name, site in sites.items():
        got = self._tapped.get(name)
        got = None if got is None else got.out
        if got is None or tuple(got.shape) != site.layout.grad.shape:
          raise collector_lib.ProbeStateError(
              f"site {name}: the probe was set up for output shape {site.layout.grad.shape}, "
              f"but this batch gives {None if got is None else tuple(got.shape)}; build the "
              "sites from a batch of the training batch size")
      found = dict(sites)
    self.sites = found
    self._dtype = {n: str(np.dtype(self._tapped[n].lhs.dtype)) for n in found}
    outputs = {n: self._tapped[n].out for n in found}
    # No donation: leaves of a fresh state can share one buffer (equal zeros), and the GPU
    # refuses to donate a buffer twice.
    self._pass = collector_lib.make_observe(self._loss_of, self.sites, self.config, outputs,
                                            on_trace=on_trace)
    if state is None:
      state = collector_lib.init_state(self.sites, self.config, outputs[next(iter(found))].dtype)
    else:
      collector_lib.check_state(state, self.sites, self.config, "checkpoint extras")
    # Committed arrays, as every later state is: jit caches on committedness, so a fresh or
    # restored state then shares the compiled pass with the states it produces.
    self.state = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), jax.devices()[0]), state)
    self._signature = _signature(batch)

  @property
  def statistics_pass(self) -> Optional[collector_lib.StatisticsPass]:
    return self._pass

  # -- observing

  def observe(self, variables, batch, *, key: Optional[jax.Array] = None) -> None:
    """Folds one batch, seen by the model with `variables`, into every site's statistics:
    operands, output gradients of `loss_fn`, weight distribution and a paired reservoir of
    real rows. Compiles on the first call; later calls reuse the compiled pass. `key` draws
    the reservoir's rows (default: from the number of batches observed)."""
    if self._pass is None:
      self.setup(variables, batch)
    else:
      change = _signature_change(self._signature, _signature(batch))
      if change is not None:
        raise ProbeInputError(f"batch {self._batches}: its structure differs from the first "
                              f"batch's ({change}); give the probe batches of one shape")
    if key is None:
      key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed + 1), self._batches)
    start = time.perf_counter()
    # The pass hands an rng to the loss, which takes none here: a constant one.
    self.state = self._pass(self.state, variables, batch, jax.random.PRNGKey(0), key)
    jax.block_until_ready(self.state)
    seconds = time.perf_counter() - start
    if self._compile_s is None:
      self._compile_s = seconds
    else:
      self._seconds.append(seconds)
    self._batches += 1

  @property
  def observations(self) -> int:
    return self._batches

  def overhead(self) -> Dict[str, Any]:
    """What one observation costs (the first, which compiles, apart)."""
    return {"observations": self._batches,
            "probe_ms": 1e3 * float(np.median(self._seconds)) if self._seconds else None,
            "compile_s": self._compile_s}

  # -- the report

  def report(self, workdir: Optional[str] = None) -> Dict[str, Any]:
    """Evaluates every candidate kernel on every site and pass against the fp32 product of
    operands drawn from the statistics, times them (on a GPU; else from the committed timing
    table, marked estimated) and returns the `loka.probe/2` report; with `workdir`, also
    writes it there as JSON and markdown with plots."""
    if self._batches == 0:
      raise ProbeInputError("the probe has observed no batch: call observe(variables, batch) "
                            "at least once before report()")
    eval_config = assemble.eval_config(self.options)
    entries: Dict[str, Dict] = {}
    for i, (name, site) in enumerate(self.sites.items()):
      t0 = time.time()
      state = jax.device_get(collector_lib.site_state(self.state, self.sites, name))
      passes, info = assemble.evaluated_passes(site, state, self.kernels, self._dtype[name],
                                               self.options, eval_config)
      entries[name] = assemble.site_entry(
          site, stats_report.site_stats(site, state, self._batches), info, passes)
      print(f"[probe] evaluated {i + 1}/{len(self.sites)} {name} in {time.time() - t0:.1f}s",
            flush=True)
    dtypes = sorted(set(self._dtype.values()))
    timing = assemble.attach_timings(entries, self.sites, self.kernels, dtypes[0], self.options,
                                     workdir)
    unrouted = [p.describe() for p in self.unrouted]
    report = assemble.finish_report(
        entries, self.sites, self.kernels, self.excluded, self.options, eval_config, dtypes[0],
        timing, model=self.name, preset="",
        run={"observed_batches": self._batches,
             "batch": [list(s) + [d] for s, d in self._signature[1]]},
        probe_config=self.config.to_dict(), overhead=self.overhead(), pending=timing.pending,
        extra={"unrouted_products": unrouted})
    if workdir is not None:
      report, _ = assemble.write_report(report, workdir, self.options)
    else:
      from loka_jax.probe import report as report_lib
      report = report_lib.json_ready(report)
    return report


def probe(model, variables, batches, loss_fn: Callable, *, workdir: Optional[str] = None,
          **kwargs) -> Dict[str, Any]:
  """The ProbeReport of `model` with `variables` on `batches` (any iterable of pytrees of
  one shape) under `loss_fn(model_output, batch) -> scalar`: statistics from every batch
  (no training of its own), then each candidate kernel's error per site and pass, and its
  time (on a GPU; else estimated from the committed timing table). Keyword arguments are
  `Probe`'s (apply_fn, apply_kwargs, policy, sites, kernels, samples, criteria, ...)."""
  p = Probe(model, loss_fn, **kwargs)
  for batch in batches:
    p.observe(variables, batch)
  return p.report(workdir)
