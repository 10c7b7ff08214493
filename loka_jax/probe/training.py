"""The probe inside loka_jax's training loop: a `streaming.Probe` of the tower's training loss,
observing every `cadence` steps from the loop's step_callback, with its statistics saved in
every checkpoint (`extras`) so that a resumed run continues from them.

The Probe is the same one a user runs on their own model (`loka_jax.Probe`): this module adds
the cadence, the checkpointed state and its metadata, compiling the statistics pass ahead of
its first use, and the probe's overhead against the training step.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.probe import executables
from loka_jax.probe.collector import ProbeConfig, ProbeStateError, SiteProbe, budgeted_gap
from loka_jax.probe.streaming import Probe
from loka_jax.train.metrics import bce_with_logits

STATS_KEY = "probe_stats"   # checkpoint extras: the arrays
META_KEY = "probe_meta"     # checkpoint extras: JSON (config, observed steps, timings)
META_SCHEMA = "loka.probe_state/1"
# The towers' forward in training mode; they hold no dropout, so it takes no rng.
TOWER_APPLY_KWARGS = {"train": True}


def tower_bce(logits, batch):
  """A loka_jax tower's training loss: binary cross-entropy on `batch["label"]`."""
  return jnp.mean(bce_with_logits(logits, batch["label"]))


def tower_probe(model, config: ProbeConfig) -> Probe:
  """The Probe of a loka_jax tower's training loss (its sites keep their own policies)."""
  return Probe(model, tower_bce, apply_kwargs=TOWER_APPLY_KWARGS, policy=None, config=config,
               seed=config.seed)


def abstract_variables(model, batch):
  """The shapes of a fresh initialization's variables (nothing computed)."""
  return jax.eval_shape(lambda b: model.init({"params": jax.random.PRNGKey(0),
                                              "dropout": jax.random.PRNGKey(1)}, b,
                                             train=False), batch)


def probe_sites(model, variables, batch, config: ProbeConfig) -> Dict[str, SiteProbe]:
  """{site name: SiteProbe} of every GEMM site of a loka_jax tower's training loss on
  `batch`, in call order; `variables=None` traces with a fresh initialization's shapes."""
  if variables is None:
    variables = abstract_variables(model, batch)
  return tower_probe(model, config).find_sites(variables, batch)


def _median(values):
  return float(np.median(values)) if len(values) else None


class ProbeCollector:
  """Observes a training run every `config.cadence` steps (the loop's step_callback).

  `extras` is the dict to hand to `train(..., extras=...)`: it always holds the current
  statistics, so every checkpoint saves them and a resumed run continues from them. The loop
  calls `on_step` before it saves the step's checkpoint, so a checkpoint at an observation
  step holds that observation, and a resumed run observes at the steps an uninterrupted one
  does, on the same parameters and batches. An observation due at a step whose checkpoint
  lacks it is made at the next step.
  """

  def __init__(self, model, source, batch_size: int, sites: Mapping[str, SiteProbe],
               config: ProbeConfig, state=None, meta: Optional[Mapping[str, Any]] = None,
               example_variables=None, on_trace: Optional[Callable[[str], None]] = None):
    self.model = model
    self.source = source
    self.batch_size = batch_size
    self.config = config
    batch = source.train_batch(0, batch_size)
    if example_variables is None:
      example_variables = abstract_variables(model, batch)
    meta = dict(meta or {})
    names = meta.get("site_names")
    if state is not None and names is not None and list(names) != list(sites):
      raise ProbeStateError("checkpoint extras: the saved probe statistics belong to sites "
                            f"{list(names)[:4]}..., not this model's {list(sites)[:4]}...; "
                            "use a new run directory")
    self.probe = tower_probe(model, config)
    self.probe.setup(example_variables, batch, sites=sites, state=state, on_trace=on_trace)
    self.sites = self.probe.sites
    self.meta = {"schema": META_SCHEMA, "config": config.to_dict(),
                 "site_names": list(self.sites),
                 "steps": list(meta.get("steps", [])),
                 "probe_s": list(meta.get("probe_s", [])),
                 "step_s": list(meta.get("step_s", [])),
                 "compile_s": meta.get("compile_s"),
                 # The first step an observation is due at under `max_overhead` (None: the
                 # next cadence point); saved, so a resumed run keeps its schedule.
                 "next_step": meta.get("next_step")}
    self.extras = {STATS_KEY: self.probe.state, META_KEY: self.meta}
    self._last_return: Optional[float] = None
    self._compiled = False
    self._precompiler: Optional[executables.Precompiler] = None
    self._ahead_workers: Optional[int] = None
    self._ahead_pending = False

  def compile_ahead(self, example_state, workers: Optional[int] = None) -> int:
    """Starts compiling the statistics pass on `workers` threads (None: CPUs up to 16) for a
    training state like `example_state` (a TrainState, or its shapes: `abstract_train_state`);
    returns how many functions were queued. The first observation takes them and closes the
    threads (`close`, which a run that makes no observation calls itself)."""
    batch = self.source.train_batch(0, self.batch_size)
    step_key = jax.eval_shape(lambda k: jax.random.fold_in(k, 0), example_state.rng)
    jobs = self.probe.statistics_pass.compile_jobs(self.state, example_state.variables(), batch,
                                                   step_key, jax.random.PRNGKey(0))
    self.close()
    self._precompiler = executables.Precompiler(workers)
    return self._precompiler.submit(jobs)

  def try_compile_ahead(self, example_state, workers: Optional[int] = None) -> int:
    """`compile_ahead`, where a failure only warns: the pass then compiles on its first
    call, as without it, and raises there whatever is wrong with it."""
    try:
      return self.compile_ahead(example_state, workers)
    except Exception as e:  # noqa: BLE001 - compiling ahead is an optimization only
      self.close()
      warnings.warn(f"the statistics pass was not compiled ahead ({type(e).__name__}: "
                    f"{str(e)[:200]}); it compiles on its first call")
      return 0

  @property
  def pass_compiled(self) -> bool:
    """Whether this process has run the statistics pass (and so compiled it)."""
    return self._compiled

  def compile_ahead_after_first_step(self, workers: Optional[int] = None) -> None:
    """`compile_ahead` with the training state of the loop's first step, unless an
    observation is due at once. Not before: the training step's own compile then runs
    alone, since on the GPU compiles side by side autotune against each other, and its
    autotuning results may be saved for every later program with the same fusions."""
    self._ahead_workers, self._ahead_pending = workers, True

  @property
  def compiling_ahead(self) -> bool:
    """Whether functions `compile_ahead` queued are still compiling (an observation now
    would wait for them)."""
    return self._precompiler is not None and not self._precompiler.done()

  def close(self) -> None:
    """Ends compiling ahead: queued compiles are dropped, running ones finish."""
    if self._precompiler is not None:
      self._precompiler.close()
      self._precompiler = None

  @property
  def state(self):
    return self.extras[STATS_KEY]

  @property
  def observations(self) -> int:
    return len(self.meta["steps"])

  def last_observed_step(self) -> int:
    return max(self.meta["steps"]) if self.meta["steps"] else 0

  def due(self, step: int) -> bool:
    """A cadence point was passed since the last observation, or, under
    `ProbeConfig.max_overhead`, the step the overhead budget set was reached."""
    if self.config.max_overhead and self.meta.get("next_step") is not None:
      return step >= self.meta["next_step"]
    return (step // self.config.cadence) * self.config.cadence > self.last_observed_step()

  def _schedule_next(self, step: int) -> None:
    """Sets when the next observation is due under the overhead budget, from the median
    observation and training step measured so far (compiling calls left out)."""
    if not self.config.max_overhead or not self.meta["probe_s"]:
      return
    steps = self.meta["step_s"][1:] if len(self.meta["step_s"]) > 1 else self.meta["step_s"]
    gap = budgeted_gap(self.config.cadence, _median(self.meta["probe_s"]), _median(steps),
                       self.config.max_overhead)
    self.meta["next_step"] = int(step) + gap

  def on_step(self, step: int, train_state, step_metrics=None) -> None:
    """The training loop's step_callback."""
    del step_metrics
    now = time.perf_counter()
    if self._last_return is not None:
      self.meta["step_s"].append(now - self._last_return)
    if self._ahead_pending:
      self._ahead_pending = False
      if not self.due(step):
        self.try_compile_ahead(train_state, self._ahead_workers)
    if self.due(step):
      self.observe(train_state.variables(), train_state.rng, step)
    self._last_return = time.perf_counter()

  def observe(self, variables, rng_key, step: int) -> None:
    """Observes the model with `variables` on training batch `step`; the reservoir's draws
    are keyed by the step, so a resumed run draws as an uninterrupted one."""
    del rng_key  # the towers' training forward takes no rng (no dropout)
    batch = self.source.train_batch(step, self.batch_size)
    key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed + 1), step)
    self.probe.state = self.extras[STATS_KEY]   # the extras are the truth (a valve resets them)
    start = time.perf_counter()
    self.probe.observe(variables, batch, key=key)
    seconds = time.perf_counter() - start
    if self._compiled:
      self.meta["probe_s"].append(seconds)
    else:
      self._compiled = True
      self.meta["compile_s"] = seconds  # the first call of this process includes compilation
      self.close()   # every function it compiled ahead has been taken
    self.extras[STATS_KEY] = self.probe.state
    self.meta["steps"].append(int(step))
    self._schedule_next(step)

  def overhead(self) -> Dict[str, Any]:
    """Measured probe cost against the training step time."""
    probe = _median(self.meta["probe_s"])
    # The first gap of a process includes compiling the train step: leave it out.
    steps = self.meta["step_s"][1:] if len(self.meta["step_s"]) > 1 else self.meta["step_s"]
    step = _median(steps)
    gap = budgeted_gap(self.config.cadence, probe, step, self.config.max_overhead)
    out = {"observations": self.observations, "cadence": self.config.cadence,
           "max_overhead": self.config.max_overhead, "gap": gap,
           "probe_ms": None if probe is None else 1e3 * probe,
           "step_ms": None if step is None else 1e3 * step,
           "compile_s": self.meta.get("compile_s"),
           "fraction": None}
    if probe is not None and step:
      # One observation per `gap` steps: `cadence`, or longer under the overhead budget.
      out["fraction"] = probe / (gap * step)
    return out
