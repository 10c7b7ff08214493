"""Timing by the benchmark protocol (DESIGN.md): warm up, interleave variants, repeat, report
medians and bootstrap 95% confidence intervals of speedups against a baseline of the same run.

Work shorter than about a millisecond is timed as N iterations inside one jitted fori_loop, so
launch and dispatch overhead do not swamp it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass
class Timing:
  """Per-call seconds of one variant (one entry per repeat)."""
  name: str
  seconds: np.ndarray
  inner: int = 1

  @property
  def median_us(self) -> float:
    return float(np.median(self.seconds) * 1e6)

  def ci_us(self, rng: np.random.Generator, n_boot: int = 2000) -> Tuple[float, float]:
    boot = rng.choice(self.seconds, size=(n_boot, self.seconds.size), replace=True)
    med = np.median(boot, axis=1) * 1e6
    return float(np.percentile(med, 2.5)), float(np.percentile(med, 97.5))


def speedup_ci(baseline: Timing, variant: Timing, *, seed: int = 0,
               n_boot: int = 2000) -> Tuple[float, float, float]:
  """(median ratio, 2.5%, 97.5%) of baseline time / variant time, bootstrapped."""
  rng = np.random.default_rng(seed)
  b = rng.choice(baseline.seconds, size=(n_boot, baseline.seconds.size), replace=True)
  v = rng.choice(variant.seconds, size=(n_boot, variant.seconds.size), replace=True)
  ratios = np.median(b, axis=1) / np.median(v, axis=1)
  point = float(np.median(baseline.seconds) / np.median(variant.seconds))
  return point, float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


# Calls per device-loop iteration of short timed work. Each iteration of a device loop has a
# fixed cost (its launches and its condition): on the H200 every GEMM at DCNv2 `small`'s
# shapes timed >= 29 us one call an iteration, [4096,256]x[256,1] included, whose data take
# ~1 us to move. Sharing an iteration among 16 calls cuts that floor 16-fold. A CPU loop
# has no such cost, and its compile time would only grow: there one call an iteration.
UNROLL = 16


def loop_unroll() -> int:
  """Calls per loop iteration of short timed work on this platform."""
  return UNROLL if jax.default_backend() == "gpu" else 1


def chained_calls(fn: Callable, args, carry, calls: int):
  """`calls` calls of fn(*args) in sequence, each one's operands passed through an
  optimization barrier with the previous result, so XLA can neither hoist nor merge them;
  returns the last result."""
  for _ in range(calls):
    args_i, _ = lax.optimization_barrier((args, carry))
    carry = fn(*args_i)
  return carry


def repeat_in_loop(fn: Callable, iterations: int, unroll: Optional[int] = None) -> Callable:
  """A jitted function running `fn(*args)` `iterations` times, `unroll` calls per iteration
  of one fori_loop (the rest after it; None: `loop_unroll()`); the last output is returned.
  The loop body holds `unroll` copies of fn: pass 1 for large functions (whole model steps),
  whose compile time would grow with it and whose time dwarfs the iteration's cost."""
  unroll = max(1, min(loop_unroll() if unroll is None else unroll, iterations - 1))
  loops, rest = divmod(iterations - 1, unroll)

  def looped(*args):
    first = fn(*args)
    out = lax.fori_loop(0, loops, lambda _, c: chained_calls(fn, args, c, unroll), first)
    return chained_calls(fn, args, out, rest)

  return jax.jit(looped)


def time_variants(variants: Mapping[str, Tuple[Callable, Sequence]], *, repeats: int = 20,
                  warmup: int = 3, min_call_seconds: float = 1e-3,
                  max_inner: int = 1000) -> Dict[str, Timing]:
  """Times jittable `fn(*args)` variants, interleaved, `repeats` times each.

  Each variant is compiled and warmed first; variants faster than `min_call_seconds` are
  wrapped in `repeat_in_loop` with an iteration count that brings a call near that length.
  """
  prepared = {}
  for name, (fn, args) in variants.items():
    jitted = jax.jit(fn)
    for _ in range(warmup):
      jax.block_until_ready(jitted(*args))
    inner = calls_for(lambda: jitted(*args), min_call_seconds, max_inner)
    if inner > 1:
      jitted = repeat_in_loop(fn, inner)
      for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    prepared[name] = (jitted, args, inner)
  samples = {name: [] for name in prepared}
  for _ in range(repeats):
    for name, (jitted, args, inner) in prepared.items():
      samples[name].append(call_seconds(lambda: jitted(*args)) / inner)
  return {name: Timing(name, np.asarray(s), prepared[name][2]) for name, s in samples.items()}


def summarize(timings: Mapping[str, Timing], baseline: str, *, seed: int = 0) -> Dict[str, dict]:
  """Median, CI and speedup vs `baseline` for every variant, JSON-ready."""
  rng = np.random.default_rng(seed)
  base = timings[baseline]
  out = {}
  for name, t in timings.items():
    lo, hi = t.ci_us(rng)
    s, slo, shi = speedup_ci(base, t, seed=seed)
    out[name] = {"median_us": t.median_us, "ci_us": [lo, hi], "speedup": s,
                 "speedup_ci": [slo, shi], "repeats": int(t.seconds.size), "inner": t.inner}
  return out


def random_normal(key, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
  """Timing inputs: never zeros (zeros hide wrong indexing and can run faster)."""
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def time_calls(calls: Mapping[str, Callable[[], object]], *, repeats: int = 20,
               warmup: int = 3, calls_per_sample: int = 1) -> Dict[str, Timing]:
  """Interleaved timing of argument-less calls (e.g. a train step that threads and donates
  its own state). A sample runs a call `calls_per_sample` times back to back and blocks on
  the last result only, so the device runs them without host gaps between, and is divided by
  that count (`Timing.inner`). For work of a millisecond or more a call."""
  if calls_per_sample < 1:
    raise ValueError(f"calls_per_sample must be >= 1, got {calls_per_sample}")
  for call in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(call())
  samples = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      for _ in range(calls_per_sample - 1):
        call()
      jax.block_until_ready(call())
      samples[name].append((time.perf_counter() - start) / calls_per_sample)
  return {name: Timing(name, np.asarray(s), calls_per_sample) for name, s in samples.items()}


def calls_for(call: Callable[[], object], min_sample_s: float, max_calls: int = 64) -> int:
  """How many back-to-back calls make a sample of at least `min_sample_s` (from the best of
  three single calls, after one warm-up call)."""
  jax.block_until_ready(call())
  one = min(call_seconds(call) for _ in range(3))
  return int(min(max_calls, max(1, math.ceil(min_sample_s / max(one, 1e-7)))))


def call_seconds(call: Callable[[], object]) -> float:
  """Wall seconds of one argument-less call, blocked on its result."""
  start = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - start
