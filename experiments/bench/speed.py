"""Train-step and inference timing of benchmark variants against bf16 in the same process.

One target (a tower shape, or a model preset) at a time. Every variant of a target threads
ONE training state: the bf16 model's parameters and Adam state, which hold every other
variant's parameters (the Mods only drop biases and norm scales; FP8 kernels add no
parameters), so the biggest presets fit one GPU however many variants run, and every variant
updates the same tensors. Delayed-scaling state (fp8_meta) stays per variant. A variant whose
parameters do not fit inside bf16's gets its own state (`shared_state: false` in its row), and
with `own_states` every variant does: its step then takes its own model's parameters, as the
training loop's does, not also the biases its Mods drop (one more state on the device each).

Timing follows the benchmark protocol (`loka_jax.timing`): warm-up, bf16 and the variant
interleaved, >= 20 repeats, median and bootstrap 95% CI of the speedup; steps under `min_call_s`
run N times in one jitted fori_loop (N from the bf16 step, the same for every variant; chosen
per mode, since an inference step can be ten times shorter than a train step). A timed train
sample dispatches `train_calls` such calls back to back and blocks on the last: the host's work
between two steps (flattening and dispatching a state of hundreds of arrays) then overlaps
the device's, as in the training loop, which reads a step's metrics after dispatching the
next (FINDINGS 29: timed one call a sample, DLRM `large`'s step read 7.0 ms on an H200 where
the loop ran 6.0 ms a step). Inference samples stay one call: a request waits for its answer.
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import numpy as np
from jax import lax

from loka_jax import timing
from loka_jax.models.site import SiteConfig
from loka_jax.probe import memory
from loka_jax.train import loop
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import create_train_state, state_bytes

_GEMM_PATTERNS = (
    ("cublaslt_fp8", r"__cublas\$lt\$matmul\$f8"),
    ("cublaslt", r"__cublas\$lt\$matmul(?!\$f8)"),
    ("cublas", r"__cublas\$gemm"),
    # XLA's Triton GEMM fusions: the legacy kind and the nested-fusion kind newer XLA emits.
    ("xla_triton_gemm", r"__triton_gemm|__triton_nested_gemm_fusion"),
    ("pallas_triton", r"__gpu\$xla\.gpu\.triton|triton_kernel_call"),
    ("pallas_mosaic_gpu", r"mosaic_gpu"),
)


def gemm_calls(hlo_text: str) -> Dict[str, int]:
  """How many GEMM calls of each backend a compiled step holds (custom-call targets)."""
  out = {}
  for name, pattern in _GEMM_PATTERNS:
    n = len(re.findall(pattern, hlo_text))
    if n:
      out[name] = n
  return out


def _leaves(tree) -> Dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in flat}


def _fits_inside(params_abstract, union_abstract) -> bool:
  inner, outer = _leaves(params_abstract), _leaves(union_abstract)
  return all(outer.get(k) == v for k, v in inner.items())


def _init_abstract(model, batch):
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
  return jax.eval_shape(lambda b: model.init(rngs, b, train=False), batch)


class StateMemoryError(RuntimeError):
  """A variant's own training state cannot fit beside what the device holds already."""


@dataclasses.dataclass
class Arm:
  """One variant ready to run: calls that advance/return through the shared holder."""
  name: str
  train: Callable[[], Any]
  infer: Callable[[], Any]
  info: Dict[str, Any]
  hlo: Dict[str, str] = dataclasses.field(default_factory=dict)  # compiled text per mode


# Steps shorter than this run several times a timed call (the protocol's 5 ms, which the Mods
# ablation's timing uses too).
MIN_CALL_S = timing.MIN_CALL_S
# Train calls dispatched back to back in one timed sample: the host's time between two calls
# is hidden in all but the first (a quarter of it stays in the step's time).
TRAIN_CALLS = 4


class TargetBench:
  """The bf16 baseline of one target plus variants added one at a time."""

  def __init__(self, batch, optim: OptimConfig = OptimConfig(), seed: int = 0,
               min_call_s: float = MIN_CALL_S, max_inner: int = 200,
               train_calls: int = TRAIN_CALLS, own_states: bool = False,
               memory_stats: Callable[[], Optional[Dict[str, int]]] = memory.device_memory):
    if train_calls < 1:
      raise ValueError(f"train_calls must be >= 1, got {train_calls}")
    # Every variant on a state of its own model's parameters (as the training loop runs it),
    # not on bf16's shared one: a Mods arm's step then takes only its own model's parameters,
    # without the biases its Mods drop. One more training state on the device per variant.
    self.own_states = own_states
    # Read before a state of a variant's own is made: one that cannot fit is refused at once.
    # Left to the allocator, a GPU then retries each failing allocation for seconds while the
    # step compiles and autotunes, and the bench sits for minutes.
    self.memory_stats = memory_stats
    self.batch = jax.device_put(batch)  # fixed real data (never zeros)
    self.optim, self.seed = optim, seed
    self.min_call_s, self.max_inner = min_call_s, max_inner
    # Calls per timed sample, per mode (dispatched back to back, blocked on the last).
    self.calls_per_sample = {"train": train_calls, "infer": 1}
    self.holder: Dict[str, Any] = {}
    self.inner = {"train": 1, "infer": 1}  # steps per timed call, per mode
    self.baseline: Optional[Arm] = None

  def _compile(self, model, state):
    train_step, eval_step = loop.compiled_steps(model, self.optim, "stop")
    train_fn, eval_fn = train_step, eval_step
    if self.inner["train"] > 1:
      n = self.inner["train"]
      train_fn = jax.jit(lambda s, b: lax.fori_loop(
          0, n, lambda i, c: train_step(c, b)[0], s), donate_argnums=0)
    if self.inner["infer"] > 1:  # whole steps: one a loop body
      eval_fn = timing.repeat_in_loop(eval_step, self.inner["infer"], unroll=1, touch=(1,))
    t0 = time.perf_counter()
    train_c = train_fn.lower(state, self.batch).compile()
    eval_c = eval_fn.lower(state, self.batch).compile()
    return train_c, eval_c, time.perf_counter() - t0

  def _arm(self, name: str, model, key: str, meta) -> Arm:
    """Compiles `model`'s steps on the state in holder[key] (with its own fp8_meta)."""
    def state_in():
      s = self.holder[key]
      return s if meta is None else s.replace(fp8_meta=meta["value"])

    state = state_in()
    train_c, eval_c, seconds = self._compile(model, state)
    hlo = train_c.as_text() or ""

    def train_call():
      out = train_c(state_in(), self.batch)
      new = out[0] if self.inner["train"] == 1 else out  # the looped step returns the state
      if meta is not None:
        meta["value"] = new.fp8_meta
        new = new.replace(fp8_meta=self.holder["empty_meta"])
      self.holder[key] = new
      return new.step

    def infer_call():
      return eval_c(state_in(), self.batch)

    info = {"compile_s": round(seconds, 2), "train_memory_bytes": timing.memory_bytes(train_c),
            "infer_memory_bytes": timing.memory_bytes(eval_c), "gemm_calls": gemm_calls(hlo),
            "shared_state": key == "shared", "inner": dict(self.inner),
            "calls_per_sample": dict(self.calls_per_sample), "min_call_s": self.min_call_s}
    return Arm(name, train_call, infer_call, info,
               {"train": hlo, "infer": eval_c.as_text() or ""})

  def set_baseline(self, model) -> Arm:
    """Builds the shared state from `model` (bf16) and compiles its steps."""
    state = create_train_state(model, make_optimizer(self.optim), self.batch, self.seed)
    self.holder["empty_meta"] = state.fp8_meta
    self.holder["shared"] = state
    self.union_abstract = _init_abstract(model, self.batch)["params"]
    arm = self._arm("bf16", model, "shared", None)
    self.inner = {mode: timing.calls_for(getattr(arm, mode), self.min_call_s, self.max_inner)
                  for mode in ("train", "infer")}
    if max(self.inner.values()) > 1:
      arm = self._arm("bf16", model, "shared", None)
    self.baseline = arm
    return arm

  def state_of(self, name: str):
    """The training state the arm `name` steps on: its own, or the shared one."""
    return self.holder.get(f"own:{name}", self.holder["shared"])

  def add(self, name: str, model) -> Arm:
    """The variant's arm, threading the shared state when its parameters fit inside it
    (always a state of its own with `own_states`)."""
    abstract = _init_abstract(model, self.batch)
    key, meta = "shared", None
    if self.own_states or not _fits_inside(abstract["params"], self.union_abstract):
      key = f"own:{name}"
      self._check_room(name, model)
      self.holder[key] = create_train_state(model, make_optimizer(self.optim), self.batch,
                                            self.seed)
    elif any(k != "params" for k in abstract):
      # Only the fp8 state is new: initialize it alone (jit drops the unused parameters).
      rngs = {"params": jax.random.PRNGKey(self.seed), "dropout": jax.random.PRNGKey(1)}
      fresh = jax.jit(lambda b: {k: v for k, v in model.init(rngs, b, train=False).items()
                                 if k != "params"})(self.batch)
      meta = {"value": jax.tree.map(lambda x: x.astype(np.float32),
                                    next(iter(fresh.values())))}
    return self._arm(name, model, key, meta)

  def with_inference(self, arm: Arm, forward: Callable, variables) -> Arm:
    """`arm` whose inference call runs `forward(variables, batch)` instead of its model's eval
    step (the LoKA arm serves its exported FP8 model), looped like every other call."""
    fn = (timing.repeat_in_loop(forward, self.inner["infer"], unroll=1, touch=(1,))
          if self.inner["infer"] > 1 else jax.jit(forward))
    variables = jax.device_put(variables)
    compiled = fn.lower(variables, self.batch).compile()
    return dataclasses.replace(arm, infer=lambda: compiled(variables, self.batch),
                               info={**arm.info,
                                     "infer_memory_bytes": timing.memory_bytes(compiled)},
                               hlo={**arm.hlo, "infer": compiled.as_text() or ""})

  def _check_room(self, name: str, model) -> None:
    """Raises StateMemoryError when a training state of `model` (parameters, optimizer
    moments, fp8 state; sized from shapes, nothing allocated) exceeds what JAX's allocator
    has left on the device: the state alone cannot fit, before the step's gradients and
    activations come on top."""
    stats = self.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
      return
    need = state_bytes(model, make_optimizer(self.optim), self.batch, self.seed)
    held = int(stats.get("bytes_in_use", 0))
    if held + need <= limit:
      return
    remedy = ("time it on bf16's shared state (speed.own_states=false), " if self.own_states
              else "")
    raise StateMemoryError(
        f"{name}: a training state of its own takes {need / 1e9:.1f} GB, and with the "
        f"{held / 1e9:.1f} GB the device holds already it exceeds the {limit / 1e9:.1f} GB JAX "
        f"may take of the card; {remedy}{memory.MORE_OF_THE_CARD} or use a card with more "
        "memory")

  def drop(self, name: str) -> None:
    self.holder.pop(f"own:{name}", None)

  def time_pair(self, arm: Arm, repeats: int, seed: int = 0) -> Dict[str, Dict[str, Any]]:
    """{'train'|'infer': summary + raw per-example-step samples} of `arm` vs the baseline."""
    out = {}
    for mode in ("train", "infer"):
      calls = {"bf16": getattr(self.baseline, mode), arm.name: getattr(arm, mode)}
      if arm.name == "bf16":
        calls = {"bf16": calls["bf16"]}
      timings = self._time_calls(calls, mode, repeats)
      summary = timing.summarize(timings, "bf16", seed=seed)[arm.name]
      summary["samples_us"] = _us(timings[arm.name])
      summary["baseline_samples_us"] = _us(timings["bf16"])
      out[mode] = summary
    return out

  def head_to_head(self, arm: Arm, others: Dict[str, Arm], repeats: int, seed: int = 0,
                   modes: Sequence[str] = ("train", "infer")
                   ) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """{other: {'train'|'infer': `arm`'s speed over `other`}}, each pair timed in one
    interleaving of the two alone.

    A ratio of two rows divides two speedups, each over the bf16 timed beside its own row,
    so it carries both baselines' drift: on Wukong `small` (H200) bf16's median inference step
    moved from 2,245 to 1,949 us between two rows of one program, which read 0.89x. Timed
    together, the pair needs no baseline."""
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for name, other in others.items():
      out[name] = {}
      for mode in modes:
        timings = self._time_calls({name: getattr(other, mode), arm.name: getattr(arm, mode)},
                                   mode, repeats)
        summary = timing.summarize(timings, name, seed=seed)
        out[name][mode] = {"ratio": summary[arm.name]["speedup"],
                           "ci": summary[arm.name]["speedup_ci"],
                           "median_us": summary[arm.name]["median_us"],
                           "other_median_us": summary[name]["median_us"],
                           "samples_us": _us(timings[arm.name]),
                           "other_samples_us": _us(timings[name])}
    return out

  def _time_calls(self, calls, mode: str, repeats: int) -> Dict[str, timing.Timing]:
    """Interleaved timings of `calls`, per step of `mode` (a call runs inner[mode] steps, a
    sample calls_per_sample[mode] calls)."""
    timings = timing.time_calls(calls, repeats=repeats,
                                calls_per_sample=self.calls_per_sample[mode])
    for t in timings.values():
      t.seconds = t.seconds / self.inner[mode]
      t.inner = self.inner[mode] * self.calls_per_sample[mode]
    return timings


def _us(t: timing.Timing):
  return [round(float(s) * 1e6, 3) for s in t.seconds]


def site_config(variant, plan=None) -> SiteConfig:
  """The variant's sites: its precision and kernel, or `plan` (Pallas per site, LoKA)."""
  if plan is not None:
    return SiteConfig.for_precision("loka", plan=plan)
  return SiteConfig.for_precision(variant.precision, kernel=variant.kernel)
