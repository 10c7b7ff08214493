"""The statistics pass: one jitted function that runs the model's loss, reads every site's
operands and output gradients through a probe tap (`models.tap.tapping`), and folds them into
per-site streaming statistics.

Per site (state = nested dicts of arrays, stored in checkpoint extras as `probe_stats`):
  lhs       Gaussian over the contracted features (gaussian.py)
  rhs       act x weight: matrix normal of the weight (matrix_normal.py) + `weight`, the
            latest snapshot; act x act: Gaussian like lhs
  grad      Gaussian of the output gradient over its dgrad-contracted features
  flush     per operand and use (the two passes it feeds): underflow fractions
            [use, format, granularity] (mean via `sum`, worst via `max`, latest via `last`)
  amax      per operand: latest, max, and the delayed-scaling saturation fraction (values
            above the previous observation's amax) and amax growth between observations
  reservoir paired slices (reservoir.py) along the site's slice index

`streaming.Probe` runs it on any model's batches; `training.ProbeCollector` drives that Probe
from loka_jax's training loop every `cadence` steps and keeps the statistics in checkpoints.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Dict, List, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.kernels import ACT_WEIGHT
from loka_jax.probe import executables
from loka_jax.probe import flush as flush_lib
from loka_jax.probe import gaussian, matrix_normal, reservoir
from loka_jax.models import tap as probe_hooks
from loka_jax.probe.layout import OPERANDS, PASS_AXES, SiteLayout, site_layout



# XLA options of the statistics pass's compiles, by `ProbeConfig.pass_compile`: autotuned (every
# cuBLAS algorithm and Triton tiling timed on the device), cublas (cuBLAS algorithms only, no
# Triton GEMMs), untuned (no autotuning at all). They change which GEMM algorithm runs, not
# what the statistics compute.
PASS_COMPILES = {"autotuned": {}, "cublas": {"xla_gpu_enable_triton_gemm": False},
                 "untuned": {"xla_gpu_autotune_level": 0}}


class ProbeStateError(ValueError):
  """Saved probe statistics that do not fit this model or these settings."""


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
  """How statistics are collected (static: it shapes the state and the compiled pass)."""
  cadence: int = 25                    # observe every `cadence` training steps
  # The most training time the statistics pass may take (a fraction); past it, observations
  # wait longer than `cadence` (`budgeted_gap`, from the measured pass and step times).
  # 0: every `cadence` steps, whatever they cost (the probe run, whose product they are).
  max_overhead: float = 0.0
  max_full_width: int = 2048           # full covariance up to this many features
  rank: int = 32                       # eigenpairs of the low-rank part above that width
  oversample: int = 32                 # extra Nystrom sketch columns beyond `rank`
  weight_ema: float = 0.1              # EMA rate of the matrix-normal fit; 0: running average
  # Refit the weight's matrix normal on every this many observations (the first always): a
  # weight moves slowly between observations, and each refit takes two Cholesky solves.
  weight_every: int = 1
  # The whole pass (extract stage and every site's update) as one compiled program: no
  # dispatch per site, and XLA schedules all sites' updates together; longer to compile,
  # since equal sites no longer share one compiled update.
  one_program: bool = False
  # Sites equal up to their name (same layout, modes and reservoir) updated together: their
  # states and operands stacked and one update vmapped over them, so a tower's repeated
  # layers launch one set of update kernels, not one each.
  group_sites: bool = False
  # How XLA compiles the pass on a GPU (`PASS_COMPILES`): its products are small statistics
  # GEMMs, for which autotuning Triton tilings costs seconds of compile per function.
  pass_compile: str = "autotuned"
  jitter: float = 1e-6                 # relative diagonal jitter before Cholesky
  reservoir_elements: int = 1 << 20    # elements per operand buffer of a site's reservoir
  reservoir_min: int = 8               # slices kept at least ...
  reservoir_max: int = 4096            # ... and at most
  min_observations: int = 2            # observations made after training when fewer exist
  seed: int = 0

  def __post_init__(self):
    if self.cadence < 1:
      raise ValueError(f"cadence must be >= 1 step, got {self.cadence}")
    if self.max_full_width < 1 or self.rank < 1:
      raise ValueError(f"probe options: max_full_width={self.max_full_width} and "
                       f"rank={self.rank} must both be >= 1")
    if self.weight_every < 1:
      raise ValueError(f"weight_every must be >= 1 observation, got {self.weight_every}")
    if not 0.0 <= self.max_overhead < 1.0:
      raise ValueError(f"max_overhead must be in [0, 1), got {self.max_overhead}")
    if self.pass_compile not in PASS_COMPILES:
      raise ValueError(f"pass_compile={self.pass_compile!r}: use one of "
                       f"{', '.join(PASS_COMPILES)}")
    if not 0.0 <= self.weight_ema < 1.0:
      raise ValueError(f"weight_ema must be in [0, 1), got {self.weight_ema}")
    if self.reservoir_min < 1 or self.reservoir_max < self.reservoir_min:
      raise ValueError(f"probe options: need 1 <= reservoir_min <= reservoir_max, got "
                       f"reservoir_min={self.reservoir_min}, reservoir_max={self.reservoir_max}")

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)

  def statistics_settings(self) -> Dict[str, Any]:
    """`to_dict` without the fields that only change how the pass is compiled: what the
    statistics of a training run depend on."""
    return {k: v for k, v in self.to_dict().items() if k not in RUN_ONLY_FIELDS}


# ProbeConfig fields that leave a run's statistics as they are: how the pass compiles (the
# same statistics up to float accumulation order).
RUN_ONLY_FIELDS = ("one_program", "group_sites", "pass_compile")


def budgeted_gap(cadence: int, cost_s: Optional[float], step_s: Optional[float],
                 max_overhead: float) -> int:
  """Training steps until the next observation: `cadence`, or more when one observation
  (`cost_s` seconds) would take more than `max_overhead` of the training time it is spread
  over (gap x `step_s`). Unknown costs or no budget: `cadence`."""
  if not max_overhead or not cost_s or not step_s:
    return cadence
  return max(cadence, math.ceil(cost_s / (max_overhead * step_s)))


@dataclasses.dataclass(frozen=True)
class SiteProbe:
  """Static description of one probed site: layout and the form of each statistic."""
  name: str
  layout: SiteLayout
  modes: Mapping[str, Any]            # operand -> GaussianMode | MatrixNormalMode
  reservoir_capacity: int             # 0: no reservoir (no slice index)
  chain: Optional[Any] = None         # models.fused.Chain: the epilogue a fused Mods layer
                                      # applies after this product (None: a plain product)

  @property
  def kind(self) -> str:
    return self.layout.kind

  @property
  def spec(self) -> str:
    return str(self.layout.spec)

  def describe(self) -> Dict[str, Any]:
    return {op: self.modes[op].describe() for op in OPERANDS}


def _reservoir_capacity(layout: SiteLayout, config: ProbeConfig) -> int:
  if layout.slice_label is None:
    return 0
  largest = max(math.prod(layout.slice_shape(op)) for op in layout.sliced_operands())
  cap = config.reservoir_elements // max(largest, 1)
  return int(min(max(cap, config.reservoir_min), config.reservoir_max, layout.num_slices))


def make_site_probe(name: str, spec: str, kind: str, lhs_shape, rhs_shape,
                    config: ProbeConfig) -> SiteProbe:
  layout = site_layout(spec, kind, lhs_shape, rhs_shape)
  choose = lambda k: gaussian.GaussianMode.choose(k, config.max_full_width, config.rank,
                                                  config.oversample)
  modes = {"lhs": choose(layout.lhs.num_features), "grad": choose(layout.grad.num_features)}
  if kind == ACT_WEIGHT:
    _, rows, cols = layout.rhs.canonical_shape
    modes["rhs"] = matrix_normal.MatrixNormalMode.choose(rows, cols, config.max_full_width)
  else:
    modes["rhs"] = choose(layout.rhs.num_features)
  return SiteProbe(name, layout, modes, _reservoir_capacity(layout, config))


# ----------------------------------------------------------------------------- state


def _init_flush(site: SiteProbe):
  out = {}
  shape = (2, len(flush_lib.FORMATS), len(flush_lib.GRANULARITIES))
  for op in OPERANDS:
    out[op] = {"sum": jnp.zeros(shape, jnp.float32), "max": jnp.zeros(shape, jnp.float32),
               "last": jnp.zeros(shape, jnp.float32)}
  return out


def _init_amax():
  z = jnp.zeros((), jnp.float32)
  return {op: {"last": z, "max": z, "saturation_sum": z, "saturation_max": z,
               "growth_max": z} for op in OPERANDS}


def init_site_state(site: SiteProbe, config: ProbeConfig, seed: int = 0, dtype=jnp.bfloat16):
  state = {"lhs": gaussian.init(site.modes["lhs"], seed),
           "grad": gaussian.init(site.modes["grad"], seed + 1),
           "flush": _init_flush(site), "amax": _init_amax()}
  if site.kind == ACT_WEIGHT:
    state["rhs"] = matrix_normal.init(site.modes["rhs"])
    # The weight as the kernels see it (the sown operand, in the compute dtype): a float32
    # copy would double it for nothing (Wukong large: 6 GB more probe state per checkpoint).
    state["weight"] = jnp.zeros(site.layout.rhs.shape, dtype)
  else:
    state["rhs"] = gaussian.init(site.modes["rhs"], seed + 2)
  if site.reservoir_capacity:
    shapes = {op: site.layout.slice_shape(op) for op in site.layout.sliced_operands()}
    state["reservoir"] = reservoir.init(site.reservoir_capacity, shapes, dtype)
  return state


def state_keys(sites: Mapping[str, SiteProbe]) -> Dict[str, str]:
  """{site name: key of its statistics}: checkpoints store arrays under path components, so
  keys are plain indices in call order and the names travel in the JSON meta."""
  return {name: f"s{i:03d}" for i, name in enumerate(sites)}


def site_state(state, sites: Mapping[str, SiteProbe], name: str):
  """The statistics of site `name` within the whole state."""
  return state["sites"][state_keys(sites)[name]]


def init_state(sites: Mapping[str, SiteProbe], config: ProbeConfig, dtype=jnp.bfloat16):
  """The empty statistics of every site (reservoirs keep values in `dtype`, the compute
  dtype of the sown operands, so they store exactly what the kernels see)."""
  keys = state_keys(sites)
  return {"observations": jnp.zeros((), jnp.int32),
          "sites": {keys[name]: init_site_state(site, config, seed=config.seed + 7 * i,
                                                dtype=dtype)
                    for i, (name, site) in enumerate(sites.items())}}


def check_state(state, sites: Mapping[str, SiteProbe], config: ProbeConfig, where: str):
  """Raises if `state` (e.g. restored from a checkpoint) does not fit these sites/config."""
  expected = jax.eval_shape(lambda: init_state(sites, config, jnp.float32))
  want = {k: (tuple(v.shape), str(v.dtype)) for k, v in
          flax.traverse_util.flatten_dict(expected, sep="/").items()}
  try:
    have = {k: (tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in
            flax.traverse_util.flatten_dict(dict(state), sep="/").items()}
  except Exception as e:  # not a nested dict of arrays
    raise ProbeStateError(f"{where}: probe statistics are not a nested dict of arrays ({e})"
                          ) from e
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  wrong = sorted(k for k in set(want) & set(have) if want[k][0] != have[k][0])
  if missing or extra or wrong:
    parts = []
    for label, keys in (("missing", missing), ("unexpected", extra), ("other shape", wrong)):
      if keys:
        parts.append(f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}")
    raise ProbeStateError(f"{where}: the saved probe statistics were made for other sites or "
                     f"probe settings ({'; '.join(parts)}); use the same settings or a new "
                     "run directory")


# ----------------------------------------------------------------------------- update


def _update_flush(acc, x_canonical, uses):
  tables = jnp.stack([flush_lib.table(x_canonical, axis) for axis in uses])
  return {"sum": acc["sum"] + tables, "max": jnp.maximum(acc["max"], tables), "last": tables}


def _update_amax(acc, x):
  now = flush_lib.amax(x)
  sat = flush_lib.delayed_saturation(x, acc["last"])
  growth = jnp.where(acc["last"] > 0, now / jnp.maximum(acc["last"], 1e-30), 0.0)
  return {"last": now, "max": jnp.maximum(acc["max"], now),
          "saturation_sum": acc["saturation_sum"] + sat,
          "saturation_max": jnp.maximum(acc["saturation_max"], sat),
          "growth_max": jnp.maximum(acc["growth_max"], growth)}


# The parts of a site's update, each writing its own fields of the state.
UPDATE_PARTS = ("gaussian", "matrix_normal", "flush", "amax", "reservoir")


def update_part(part: str, state, site: SiteProbe, lhs, rhs, grad, key, config: ProbeConfig,
                observation=0) -> Dict[str, Any]:
  """The fields of a site's state that one part of `update_site_state` writes (a part with
  nothing to update at this site gives {})."""
  layout = site.layout
  values = {"lhs": lhs, "rhs": rhs, "grad": grad}
  if part == "gaussian":
    out = {"lhs": gaussian.update(state["lhs"], layout.lhs.to_rows(lhs)),
           "grad": gaussian.update(state["grad"], layout.grad.to_rows(grad))}
    if site.kind != ACT_WEIGHT:
      out["rhs"] = gaussian.update(state["rhs"], layout.rhs.to_rows(rhs))
    return out
  if part == "matrix_normal":
    if site.kind != ACT_WEIGHT:
      return {}
    refit = lambda st: matrix_normal.update(st, layout.rhs.to_rows(rhs), ema=config.weight_ema,
                                            jitter=config.jitter)
    if config.weight_every == 1:
      fitted = refit(state["rhs"])
    else:  # a real branch: the skipped refit costs nothing
      fitted = jax.lax.cond(observation % config.weight_every == 0, refit, lambda st: st,
                            state["rhs"])
    return {"rhs": fitted, "weight": rhs.astype(state["weight"].dtype)}
  if part == "flush":
    return {"flush": {op: _update_flush(state["flush"][op],
                                        layout.operand(op).to_canonical(values[op]),
                                        tuple(PASS_AXES[op].values())) for op in OPERANDS}}
  if part == "amax":
    return {"amax": {op: _update_amax(state["amax"][op], values[op]) for op in OPERANDS}}
  if part == "reservoir":
    if "reservoir" not in state:
      return {}
    items = {op: jnp.moveaxis(values[op], layout.slice_axis(op), 0)
             for op in layout.sliced_operands()}
    return {"reservoir": reservoir.update(state["reservoir"], items, key)}
  raise ValueError(f"unknown update part {part!r}; known: {UPDATE_PARTS}")


def update_site_state(state, site: SiteProbe, lhs, rhs, grad, key, config: ProbeConfig,
                      observation=0):
  """Folds observation number `observation` (from 0) of a site's operands and output
  gradient into its state: every part of `UPDATE_PARTS`."""
  out = {}
  for part in UPDATE_PARTS:
    out.update(update_part(part, state, site, lhs, rhs, grad, key, config, observation))
  return out


def _update_key(site: SiteProbe, config: ProbeConfig):
  """Sites equal up to their name share one compiled update."""
  return (site.layout, tuple(sorted(site.modes.items())), site.reservoir_capacity, config)


def site_groups(sites: Mapping[str, SiteProbe], config: ProbeConfig) -> List[List[str]]:
  """The sites' names in groups of sites equal up to their name (one compiled update each),
  in order of first appearance."""
  groups: Dict[Any, List[str]] = {}
  for name, site in sites.items():
    groups.setdefault(_update_key(site, config), []).append(name)
  return list(groups.values())


def _grouped(update):
  """`update(state, lhs, rhs, grad, key, observation)` of one site as one update of a group
  of equal sites: lists of each in, the list of new states out, vmapped over the group."""
  def run(states, lhs, rhs, grads, keys, observation):
    stack = lambda trees: jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)
    out = jax.vmap(update, in_axes=(0, 0, 0, 0, 0, None))(
        stack(states), jnp.stack(lhs), jnp.stack(rhs), jnp.stack(grads), jnp.stack(keys),
        observation)
    return [jax.tree.map(lambda x, i=i: x[i], out) for i in range(len(states))]
  return run


def _alone(update):
  """`update(state, lhs, rhs, grad, key, observation)` of one site in the form `_grouped`
  gives: lists of one in, the list of its new state out."""
  def run(states, lhs, rhs, grads, keys, observation):
    (state,), (x,), (w,), (grad,), (key,) = states, lhs, rhs, grads, keys
    return [update(state, x, w, grad, key, observation)]
  return run


def statistics_functions(sites: Mapping[str, SiteProbe], config: ProbeConfig) -> int:
  """The functions the statistics pass compiles: its extract stage and one update per
  distinct site (per group of equal sites with `ProbeConfig.group_sites`), or one program
  (`ProbeConfig.one_program`)."""
  if config.one_program:
    return 1
  return 1 + len({_update_key(site, config) for site in sites.values()})


class StatisticsPass:
  """The statistics pass: `pass_(state, variables, batch, rng, key) -> state`.

  Two jitted stages: one runs the training loss and returns every site's operands and
  output gradient (compiled once per batch shape); then one update per site folds them
  into its statistics, compiled once per distinct site shape and shared by equal sites.
  Both go through `executables.call`, so functions compiled ahead (`compile_jobs`) are
  taken from there: on first call they compile one after another, which took 58 s of
  InterFormer `large`'s first observation, 33 functions (H200). With
  `ProbeConfig.one_program` both stages and every site are one jitted program.
  """

  def __init__(self, loss_of: Callable, sites: Mapping[str, SiteProbe], config: ProbeConfig,
               perturbations: Mapping[str, Any], *,
               on_trace: Optional[Callable[[str], None]] = None, donate: bool = False):
    self.sites = dict(sites)
    self.config = config
    self.names = state_keys(sites)
    names = self.names
    # Which sites one update call takes (groups of equal sites, or each alone), and each
    # site's index into the observation's keys: fixed for the pass.
    self._groups = site_groups(self.sites, config)
    self._updated_together = (self._groups if config.group_sites
                              else [[name] for name in self.sites])
    # One update call takes lists (of a group's sites, or of one site).
    as_call = _grouped if config.group_sites else _alone
    self._key_index = {name: i for i, name in enumerate(self.sites)}

    def extract(variables, batch, rng):
      if on_trace is not None:
        on_trace("extract")
      zeros = {name: jnp.zeros(perturbations[name].shape, perturbations[name].dtype)
               for name in sites}

      def loss(perturb):
        with probe_hooks.tapping(perturb) as tap:
          value = loss_of(variables, batch, rng)
        return value, tap.operands()

      grads, operands = jax.grad(loss, has_aux=True)(zeros)
      out = {}
      for name in sites:
        if name not in operands:
          raise ProbeStateError(f"site {name}: not called by this forward pass; the probe's "
                                "sites were found on another call of the model")
        out[names[name]] = (*operands[name], grads[name])
      return out

    def update_of(site):
      def update(state, lhs, rhs, grad, rng_key, observation):
        if on_trace is not None:
          on_trace(f"update {site.spec} {site.layout.lhs.shape} {site.layout.rhs.shape}")
        return update_site_state(state, site, lhs, rhs, grad, rng_key, config, observation)
      return update

    def whole(state, variables, batch, rng, key):
      operands = extract(variables, batch, rng)
      keys = jax.random.split(key, len(self.sites))
      return {"observations": state["observations"] + 1,
              "sites": self._update_all(lambda site: as_call(update_of(site)), state,
                                        operands, keys)}

    donated = (0,) if donate else ()
    jit = functools.partial(jax.jit, compiler_options=PASS_COMPILES[config.pass_compile] or None)
    self.whole = (executables.autotuned(jit(whole, donate_argnums=donated))
                  if config.one_program else None)
    self.extract = executables.autotuned(jit(extract))
    self.updates: Dict[Any, Callable] = {}
    for site in self.sites.values():
      key = _update_key(site, config)
      if key not in self.updates and not config.one_program:
        self.updates[key] = executables.autotuned(
            jit(as_call(update_of(site)), donate_argnums=donated))

  def _call_args(self, members, state, operands, keys):
    """One update call's list arguments for the sites `members` (their states, operands,
    output gradients and `keys`) and the observation count."""
    ks = [self.names[name] for name in members]
    return ([state["sites"][k] for k in ks], *map(list, zip(*(operands[k] for k in ks))),
            list(keys), state["observations"])

  def _update_all(self, update_for, state, operands, keys):
    """Every site's new state: `update_for(site)` run per site, or per group of equal sites
    (`ProbeConfig.group_sites`), on lists; site i draws from keys[i] either way."""
    new_sites = {}
    for members in self._updated_together:
      update = update_for(self.sites[members[0]])
      new = update(*self._call_args(members, state, operands,
                                    [keys[self._key_index[name]] for name in members]))
      new_sites.update(zip((self.names[name] for name in members), new))
    return new_sites

  def __call__(self, state, variables, batch, rng, key):
    if self.whole is not None:
      return executables.call(self.whole, state, variables, batch, rng, key)
    operands = executables.call(self.extract, variables, batch, rng)
    keys = jax.random.split(key, len(self.sites))
    staged = lambda site: functools.partial(
        executables.call, self.updates[_update_key(site, self.config)])
    return {"observations": state["observations"] + 1,
            "sites": self._update_all(staged, state, operands, keys)}

  def compile_jobs(self, state, variables, batch, rng, key) -> List[executables.Job]:
    """What the first observation compiles, as `executables.Precompiler` jobs: the extract
    stage and each distinct update, or the one program, for arguments like these (arrays or
    their shapes)."""
    if self.whole is not None:
      return [(self.whole, (state, variables, batch, rng, key))]
    operands = jax.eval_shape(self.extract, variables, batch, rng)
    site_key = jax.eval_shape(lambda k: jax.random.split(k, len(self.sites))[0], key)
    jobs = [(self.extract, (variables, batch, rng))]
    for members in self._groups:   # one job per distinct update
      members = members if self.config.group_sites else members[:1]
      jobs.append((self.updates[_update_key(self.sites[members[0]], self.config)],
                   self._call_args(members, state, operands, [site_key] * len(members))))
    return jobs


def make_observe(loss_of: Callable, sites: Mapping[str, SiteProbe], config: ProbeConfig,
                 perturbations, *, on_trace: Optional[Callable[[str], None]] = None,
                 donate: bool = False) -> StatisticsPass:
  """The statistics pass (`StatisticsPass`) over `loss_of(variables, batch, rng)`.
  `perturbations`: each site's output shape (`output_shapes`). `on_trace(what)` is called
  whenever a stage is traced ('extract' or 'update <spec> <shapes>'), so tests can count
  compilations."""
  return StatisticsPass(loss_of, sites, config, perturbations, on_trace=on_trace,
                        donate=donate)


# ----------------------------------------------------------------------------- the loop hook
