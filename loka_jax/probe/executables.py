"""The probe's evaluation functions, compiled ahead of use and several at once.

Evaluating one site runs a handful of jitted functions (two samplers, the references, one
evaluator per candidate kernel), each compiled once per site shape. On the GPU those
compiles are nearly all of a site's evaluation time (about 12 s a site for InterFormer
`small` on an H200, 2026-11-27, with five candidates) and jit runs them one after another,
on first call. XLA compiles with the GIL released, so `Precompiler` lowers and compiles the
functions of the next sites on a thread pool while the current site runs; `call` then takes
the finished executable instead of compiling again. A function nobody compiled ahead (or
whose ahead-of-time compile failed) goes through plain jit, which reports its error where
the caller handles it.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import jax
import numpy as np

Job = Tuple[Callable, Tuple[Any, ...]]   # (a jitted function, its arguments or their shapes)

_EXECUTABLES: Dict[Tuple, Any] = {}
_PENDING: Dict[Tuple, concurrent.futures.Future] = {}
_LOCK = threading.Lock()
_COUNTS = {"ahead": 0, "inline": 0}


def _leaf_signature(x) -> Tuple:
  return (tuple(np.shape(x)), np.dtype(x.dtype).name, bool(getattr(x, "weak_type", False)))


def signature(args) -> Tuple:
  """What an executable is specialized to: the argument tree and every leaf's shape, dtype
  and weak type (concrete arrays and ShapeDtypeStructs of them give the same signature)."""
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(_leaf_signature(x) for x in leaves)


def call(fn: Callable, *args):
  """fn(*args): with the executable compiled ahead when one is ready or being compiled,
  else through jit."""
  key = (fn, signature(args))
  with _LOCK:
    executable = _EXECUTABLES.get(key)
    pending = _PENDING.get(key)
  if executable is None and pending is not None:
    try:
      executable = pending.result()
    except Exception:  # noqa: BLE001 - jit below compiles again and raises it to the caller
      executable = None
  with _LOCK:
    _COUNTS["inline" if executable is None else "ahead"] += 1
  return fn(*args) if executable is None else executable(*args)


def counts() -> Dict[str, int]:
  """Calls served by an executable compiled ahead ("ahead"), calls that went through jit
  ("inline"), and the executables held ("compiled")."""
  with _LOCK:
    return {**_COUNTS, "compiled": len(_EXECUTABLES)}


def clear() -> None:
  """Drops every executable compiled ahead (their memory, in a long-lived process)."""
  with _LOCK:
    _EXECUTABLES.clear()
    _COUNTS.update(ahead=0, inline=0)


def default_workers() -> int:
  return max(1, min(16, os.cpu_count() or 1))


_AUTOTUNED: "weakref.WeakSet" = weakref.WeakSet()


def autotuned(fn: Callable) -> Callable:
  """Marks `fn` as a function compiled with its own jit options (`compiler_options` adds
  none): the statistics pass, whose options `ProbeConfig.pass_compile` sets."""
  _AUTOTUNED.add(fn)
  return fn


def compiler_options(fn: Optional[Callable] = None) -> Dict[str, Any]:
  """XLA options of a probe function compiled ahead. On a GPU, no autotuning for the
  samplers and error evaluators: XLA would time every GEMM algorithm of each on the device,
  yet each runs a few times per site and what it computes depends on the algorithm only
  through accumulation order, far below the errors it measures. The statistics pass runs
  all through training and chooses its own (`autotuned`); kernel timing and training do not
  come through here."""
  if jax.default_backend() != "gpu" or (fn is not None and fn in _AUTOTUNED):
    return {}
  return {"xla_gpu_autotune_level": 0}


def _compile(key: Tuple, fn: Callable, args: Tuple):
  try:
    executable = fn.lower(*args).compile(compiler_options=compiler_options(fn) or None)
  except BaseException:
    with _LOCK:
      _PENDING.pop(key, None)
    raise
  with _LOCK:
    _EXECUTABLES[key] = executable
    _PENDING.pop(key, None)
  return executable


class Precompiler:
  """A pool of compile threads; use as a context manager so that, on leaving it, queued
  compiles are cancelled and running ones finished."""

  def __init__(self, workers: Optional[int] = None):
    self.workers = default_workers() if workers is None else int(workers)
    if self.workers < 1:
      raise ValueError(f"Precompiler needs at least one worker, got {workers}")
    self._pool = concurrent.futures.ThreadPoolExecutor(self.workers,
                                                       thread_name_prefix="loka-compile")
    self._futures = []

  def submit(self, jobs: Iterable[Job]) -> int:
    """Queues the compile of every job not compiled or queued yet; returns how many."""
    queued = 0
    for fn, args in jobs:
      key = (fn, signature(args))
      with _LOCK:  # held across submit: the job's own bookkeeping waits for this entry
        if key in _EXECUTABLES or key in _PENDING:
          continue
        _PENDING[key] = self._pool.submit(_compile, key, fn, args)
        self._futures.append(_PENDING[key])
      queued += 1
    return queued

  def submit_from_thread(self, makers: Iterable[Callable[[], Iterable[Job]]]
                         ) -> threading.Thread:
    """Queues the jobs each of `makers` returns, calling the makers in turn on a thread of
    its own: working jobs out traces their functions (seconds for a model's sites), which the
    caller need not wait for. A maker that raises, or this pool closing meanwhile, ends the
    thread quietly: compiling ahead only saves time, and a function it did not queue compiles
    through jit on its first call."""
    def run():
      for make in makers:
        try:
          self.submit(make())
        except Exception:  # noqa: BLE001 - see the docstring; RuntimeError once closed
          return
    thread = threading.Thread(target=run, name="loka-compile-jobs", daemon=True)
    thread.start()
    return thread

  @property
  def queued(self) -> int:
    """How many compiles this pool was given so far (`done(first=...)` counts from here)."""
    return len(self._futures)

  def done(self, first: Optional[int] = None) -> bool:
    """Whether every compile this pool was given (or its `first` ones: the pool runs them in
    the order given) has finished, or failed: its function then compiles through jit on
    first call and raises there."""
    return all(f.done() for f in self._futures[:first])

  def finish_in_background(self) -> None:
    """Takes no more jobs and lets the queued and running ones finish on their threads,
    without waiting for them."""
    self._pool.shutdown(wait=False)

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
    with _LOCK:
      for key in [k for k, f in _PENDING.items() if f.cancelled()]:
        del _PENDING[key]

  def __enter__(self) -> "Precompiler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
