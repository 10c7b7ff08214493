"""Timing by the benchmark protocol: warm up, interleave variants, repeat, report
medians and bootstrap 95% confidence intervals of speedups against a baseline of the same run.

Work shorter than about a millisecond is timed as N iterations inside one jitted fori_loop, so
launch and dispatch overhead do not swamp it.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

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


# Calls of short timed work chained in one straight-line program (`chain`) on a GPU. A device
# loop of one call an iteration floored every GEMM at DCNv2 `small`'s shapes at >= 29 us on
# the H200, [4096,256]x[256,1] included, whose data take ~1 us to move; 16 chained calls
# share one dispatch. A CPU has no such cost, and compile time would only grow: one call.
UNROLL = 16
LONG_DISPATCHES = 4  # back-to-back dispatches of work too long to chain, at least, a sample


def loop_unroll() -> int:
  """Calls chained per dispatch of short timed work on this platform."""
  return UNROLL if jax.default_backend() == "gpu" else 1


def _touchable(x) -> bool:
  return hasattr(x, "dtype") and hasattr(x, "ndim") and x.size > 0


def corners_of(args):
  """The first element of every array in `args` ([1,...,1]-shaped), read once before a timed
  loop: `depend_on` writes them back, so no call in the loop reads its operand to touch it."""
  return jax.tree.map(
      lambda x: lax.slice(x, (0,) * x.ndim, (1,) * x.ndim) if _touchable(x) else x, args)


def depend_on(args, carry, corners):
  """`args` with the same values, made to depend on `carry`: each array's first element is
  written back in place (from `corners`, `corners_of(args)`) plus 0 x an element of carry.

  A timed loop that calls fn(*args) again and again must stop XLA from hoisting the calls out
  of the loop (the operands never change) and from merging the calls of one iteration into one
  (they are the same computation). An optimization barrier does neither reliably: the CPU
  compiler removes barriers before loop-invariant code motion, and on the H200 16 unrolled
  calls of a [16384,4096]x[4096,4096] bf16 product ran as one (timed 63 us a call against
  799 us called directly, 2026-11-27). A real data dependency survives every pass: XLA folds
  neither x * 0.0 nor the select (both would be wrong for NaN and Inf). Every array is
  touched, so nothing fn computes from any of them (a weight's quantization, say) can leave
  the loop. Writing the saved corner back, not reading the operand's own, lets the update run
  in place: reading it made XLA copy each operand twice an iteration. What remains, one
  one-element kernel per array and call, is the loop's floor (`floor_fn`)."""
  first = next((x for x in jax.tree.leaves(carry) if x.size), None)
  if first is None:
    raise ValueError("depend_on: the timed function returned no array element to chain on")
  v = jnp.ravel(first)[0].astype(jnp.float32)
  zero = jnp.where(jnp.isfinite(v), v, 0.0) * 0.0  # a NaN result must not poison operands

  def touch(x, corner):
    if not _touchable(x):
      return x
    if x.dtype == jnp.bool_:
      corner = corner | (zero != 0)
    else:
      corner = corner + zero.astype(x.dtype)
    return corner if x.ndim == 0 else lax.dynamic_update_slice(x, corner, (0,) * x.ndim)

  return jax.tree.map(touch, args, corners)


def chained_calls(fn: Callable, args, carry, calls: int, corners,
                  touch: Optional[Sequence[int]] = None):
  """`calls` calls of fn(*args) in sequence, each one's operands made to depend on the
  previous result (`depend_on`), so XLA can neither hoist nor merge them; returns
  (the operands as last called, the last result), to carry into the next loop iteration.
  `touch`: only these positional arguments are touched; the others pass through an
  optimization barrier with the previous result (for whole model steps, whose state has
  hundreds of arrays: the batch is touched, the state kept in the loop by the barrier, which
  held on the GPU one call an iteration)."""
  for _ in range(calls):
    if touch is None:
      args = depend_on(args, carry, corners)
    else:
      kept, _ = lax.optimization_barrier((args, carry))
      args = tuple(depend_on(a, carry, c) if i in touch else k
                   for i, (a, k, c) in enumerate(zip(args, kept, corners)))
    carry = fn(*args)
  return args, carry


def floor_fn(*args):
  """The floor's call: one element of the operands, so a chain of it times what a timed chain
  adds to each call (`depend_on`'s one-element updates) and each sample's dispatch and
  synchronization."""
  first = next(x for x in jax.tree.leaves(args) if _touchable(x))
  return jnp.ravel(first)[0].astype(jnp.float32)


def chain(fn: Callable, calls: int) -> Callable:
  """jit(*args): `calls` calls of fn in one straight-line program, each one's operands made to
  depend on the previous result (`depend_on`); returns the last result.

  Straight-line, not a device loop: a GPU loop pays 30-50 us an iteration for its condition
  on the H200, and its body's kernels are launched from the host each iteration, so a floor
  timed in a loop was bound by the host's launches. The chain's kernels still leave gaps
  between them (the profiler: 19-48 us of span a call around 3-13 us GEMMs): `ChainSampler`
  subtracts the same chain of `floor_fn`, which takes most of them out."""
  def run(*args):
    corners = corners_of(args)
    state = (args, fn(*args))
    return chained_calls(fn, *state, calls - 1, corners)[1]
  return jax.jit(run)


def dynamic_loop(fn: Callable) -> Callable:
  """jit(run(n, *args)): fn called n times (n >= 1, a runtime argument, so one compile serves
  any n) in one device loop, each call's operands depending on the previous result."""
  def run(n, *args):
    corners = corners_of(args)
    state = (args, fn(*args))
    return lax.fori_loop(1, n, lambda _, s: chained_calls(fn, *s, 1, corners), state)[1]
  return jax.jit(run)


@dataclasses.dataclass(frozen=True)
class ChainExecutables:
  """What a `ChainSampler` runs, compiled: the timed program, its floor (None: one call, no
  chain) and whether the timed program is `dynamic_loop`'s (a trip count first)."""
  compiled: object
  floor: Optional[object]
  looped: bool
  calls: int


def compile_chain(fn: Callable, args: Sequence, calls: int) -> ChainExecutables:
  """Compiles what `ChainSampler(fn, args, calls)` times. Runs nothing, so several may
  compile at once on threads (XLA compiles with the GIL released) before any is timed."""
  args, calls = tuple(args), max(1, int(calls))
  if loop_unroll() == 1 and calls == 1:
    return ChainExecutables(dynamic_loop(fn).lower(jnp.int32(1), *args).compile(), None,
                            True, calls)
  floor = chain(floor_fn, calls).lower(*args).compile() if calls > 1 else None
  return ChainExecutables(chain(fn, calls).lower(*args).compile(), floor, False, calls)


class ChainSampler:
  """Per-call seconds of fn(*args) from `chain(fn, calls)`, dispatched `dispatches` times back
  to back per sample, less the same chain of `floor_fn` timed beside it (one call: no chain,
  no floor). `inner` = calls x dispatches is the calls a sample divides by.

  Where nothing is chained (`loop_unroll()` is 1: a CPU) the calls of a sample run in one
  device loop instead (`dynamic_loop`, compiled once for any count): a CPU loop costs
  nothing an iteration, and a host dispatch per call would be most of a short sample.
  `executables`: `compile_chain(fn, args, calls)`'s result, compiled ahead (else here)."""

  def __init__(self, fn: Callable, args: Sequence, calls: int, warmup: int = 3,
               executables: Optional[ChainExecutables] = None):
    self.args = tuple(args)
    built = executables or compile_chain(fn, self.args, calls)
    if built.calls != max(1, int(calls)):
      raise ValueError(f"ChainSampler: executables compiled for {built.calls} chained calls, "
                       f"asked for {calls}")
    self.calls, self.dispatches = built.calls, 1
    self.unroll = self.calls  # calls in one straight-line program
    self.looped = built.looped
    self.trips = jnp.int32(1)
    self.compiled, self.floor = built.compiled, built.floor
    self.floor_seconds: list = []
    for _ in range(warmup):
      self._run(self.compiled, 1)
      if self.floor is not None:
        self._run(self.floor, 1)

  @property
  def inner(self) -> int:
    return self.calls * self.dispatches

  def set_calls(self, wanted: int) -> None:
    """About `wanted` calls a sample: whole dispatches of the chain, or one loop of them."""
    if self.looped:
      self.calls, self.trips = max(1, int(wanted)), jnp.int32(max(1, int(wanted)))
    else:
      self.dispatches = max(1, math.ceil(wanted / self.calls))

  def _call(self, compiled):
    # Only the timed call is ever looped (a looped sampler has no floor).
    return compiled(self.trips, *self.args) if self.looped else compiled(*self.args)

  def _run(self, compiled, dispatches: int) -> float:
    start = time.perf_counter()
    for _ in range(dispatches - 1):
      self._call(compiled)
    jax.block_until_ready(self._call(compiled))
    return time.perf_counter() - start

  def one_dispatch(self):
    """One dispatch, blocked (for `calls_for`)."""
    return jax.block_until_ready(self._call(self.compiled))

  def sample(self) -> float:
    t = self._run(self.compiled, self.dispatches)
    if self.floor is not None:
      f = self._run(self.floor, self.dispatches)
      self.floor_seconds.append(f / self.inner)
      t = above_floor(t, f)
    return t / self.inner

  @property
  def floor_us(self) -> Optional[float]:
    return float(np.median(self.floor_seconds) * 1e6) if self.floor_seconds else None


def repeat_in_loop(fn: Callable, iterations: int, unroll: Optional[int] = None,
                   touch: Optional[Sequence[int]] = None) -> Callable:
  """A jitted function running `fn(*args)` `iterations` times, `unroll` calls per iteration
  of one fori_loop (the rest after it; None: `loop_unroll()`); the last output is returned.
  The loop body holds `unroll` copies of fn: pass 1 for large functions (whole model steps),
  whose compile time would grow with it and whose time dwarfs the iteration's cost.
  `touch`: as in `chained_calls`."""
  unroll = max(1, min(loop_unroll() if unroll is None else unroll, iterations - 1))
  loops, rest = divmod(iterations - 1, unroll)

  def looped(*args):
    corners = tuple(corners_of(a) if touch is None or i in touch else None
                    for i, a in enumerate(args))
    state = (args, fn(*args))
    state = lax.fori_loop(0, loops,
                          lambda _, s: chained_calls(fn, *s, unroll, corners, touch), state)
    return chained_calls(fn, *state, rest, corners, touch)[1]

  return jax.jit(looped)


def above_floor(seconds: float, floor_seconds: float) -> float:
  """A looped sample less its loop floor, kept at >= 1% of the sample (a floor timed longer
  than the work is noise, not a negative time)."""
  return max(seconds - floor_seconds, 0.01 * seconds)


def loop_body_lines(hlo: str, follow_calls: bool = True) -> list:
  """The instruction lines of every while loop's body in an HLO module's text, with (when
  `follow_calls`) the lines of every computation they call (fusions, reductions): what each
  iteration of a timed loop runs. For checking that XLA kept the timed calls in the loop."""
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name = head.group(1)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  out, seen = [], set()

  def walk(comp):
    if comp in seen or comp not in comps:
      return
    seen.add(comp)
    for line in comps[comp]:
      out.append(line)
      if follow_calls:
        for called in re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", line):
          walk(called)

  for lines in list(comps.values()):
    for line in lines:
      if " while(" in line:
        for body in re.findall(r"body=%?([\w.\-]+)", line):
          walk(body)
  return out


def interleaved(names: Sequence[str], repeats: int) -> Iterator[str]:
  """`names` `repeats` times over, the order turned around every repeat (a b, b a, a b, ...).
  In a fixed order a call always follows the same other call, and whatever that one leaves
  behind (freed memory to reuse, clocks) lands in every one of its samples: two arms of one
  program read 1.5% apart on a GPU that way (Wukong `small`, H200)."""
  names = list(names)
  for repeat in range(repeats):
    yield from names if repeat % 2 == 0 else names[::-1]


def time_variants(variants: Mapping[str, Tuple[Callable, Sequence]], *, repeats: int = 20,
                  warmup: int = 3, min_call_seconds: float = 1e-3,
                  max_inner: int = 1000) -> Dict[str, Timing]:
  """Times jittable `fn(*args)` variants, interleaved, `repeats` times each.

  Each variant is compiled and warmed first; variants shorter than a quarter of
  `min_call_seconds` are timed as a `ChainSampler` of up to `loop_unroll()` chained calls,
  dispatched as often as brings a sample near that length, its floor subtracted; longer ones
  as single calls dispatched back to back (at least LONG_DISPATCHES).
  """
  prepared = {}
  for name, (fn, args) in variants.items():
    jitted = jax.jit(fn)
    for _ in range(warmup):
      jax.block_until_ready(jitted(*args))
    inner = calls_for(lambda: jitted(*args), min_call_seconds, max_inner)
    # A call of a quarter of min_call_seconds or more (from call to result) keeps the device
    # busy dispatched back to back; shorter ones are chained.
    chained = loop_unroll() if inner > LONG_DISPATCHES else 1
    sampler = ChainSampler(fn, args, min(inner, chained), warmup)
    long_on_gpu = chained == 1 and loop_unroll() > 1
    sampler.set_calls(max(inner, LONG_DISPATCHES) if long_on_gpu else inner)
    prepared[name] = sampler
  samples = {name: [] for name in prepared}
  for name in interleaved(prepared, repeats):
    samples[name].append(prepared[name].sample())
  return {name: Timing(name, np.asarray(s), prepared[name].inner)
          for name, s in samples.items()}


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
  that count (`Timing.inner`). Repeats alternate the calls' order (`interleaved`). For work
  of a millisecond or more a call."""
  if calls_per_sample < 1:
    raise ValueError(f"calls_per_sample must be >= 1, got {calls_per_sample}")
  for call in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(call())
  samples = {name: [] for name in calls}
  for name in interleaved(calls, repeats):
    start = time.perf_counter()
    for _ in range(calls_per_sample - 1):
      calls[name]()
    jax.block_until_ready(calls[name]())
    samples[name].append((time.perf_counter() - start) / calls_per_sample)
  return {name: Timing(name, np.asarray(s), calls_per_sample) for name, s in samples.items()}


# A whole step shorter than this runs several times a timed sample (`calls_for`). 5 ms, not the
# protocol's 1 ms floor: timed one a call, DCNv2 `small`'s 1 ms inference step read 0.6-1.3 ms
# on an H200, and its speedup CIs were 1.5-8x wider than at 5 ms.
MIN_CALL_S = 5e-3


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


def memory_bytes(compiled) -> Optional[int]:
  """Arguments + outputs + temporaries - aliased of one compiled step (None if unknown)."""
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
  except Exception:  # not implemented on every backend
    return None
