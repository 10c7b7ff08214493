"""Training batches made and moved to the device ahead of the step that takes them.

The loop dispatches each step as soon as the one before it is dispatched or read (loop.py), so
every gap between two steps is device time lost: a batch made on the host (14-34 ms for a
`large` preset's 4096 synthetic examples on one core) and copied to the device (2-5 MB) after
the previous step ended would be such a gap. A `Prefetcher` makes
the next `depth` batches on a background thread, in step order, and starts their transfer
(`jax.device_put` returns at once), so the step finds its batch on the device.

One thread makes one batch at a time, and making one is mostly numpy indexing that holds the
GIL (15-18 ms for DLRM `large`'s 4096 synthetic examples on one core, where the bench's
step takes 6-7 ms on an H200), so more threads would not help. With `workers` N > 0 the
batches are made in N worker processes (spawned: the parent's JAX backend is never forked),
N + `depth` in flight, and the thread only puts them on the device in order. `make` must then
pickle (`BatchMaker` of a source that pickles); one that does not falls back to the thread,
with a warning, as do the batches after a worker process dies (`BrokenProcessPool`: killed for
memory, or unable to import the source's module).

With `workers` AUTO (-1) the thread makes the first batches and times them against the
loop's time between two `get` calls; once the loop has waited for its batch on most of the
last eight steps and a batch takes longer to make than that time, it starts as many worker
processes as the ratio asks (up to `auto_worker_cap()`: none on a CPU backend, whose step
needs those cores) and they make every batch after that. Their start is a one-time pause of
a few seconds (each imports the source's module); a loop whose batches keep pace never
starts any. AUTO starts none where a spawned process would run the user's script again (a
script started by path rather than with `python -m`) or could not import the source's class
(one defined in a notebook or interactive session): it warns once and stays on the thread.
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
import multiprocessing
import os
import pickle
import queue
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

def to_device(batch: Any) -> Any:
  """`batch` with its host (numpy) arrays put on the default device; arrays already on a
  device (a sharded batch) are left as they are."""
  return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, batch)


class BatchMaker:
  """`source.train_batch(i, batch_size)` as a picklable callable (for worker processes)."""

  def __init__(self, source, batch_size: int):
    self.source, self.batch_size = source, int(batch_size)

  def __call__(self, i: int) -> Any:
    return self.source.train_batch(i, self.batch_size)


_WORKER_MAKE: Optional[Callable[[int], Any]] = None


def _start_worker(make) -> None:
  global _WORKER_MAKE
  _WORKER_MAKE = make


def _make_in_worker(i: int) -> Any:
  return _WORKER_MAKE(i)


def worker_pool(make: Callable[[int], Any], workers: int
                ) -> Optional[concurrent.futures.ProcessPoolExecutor]:
  """`workers` spawned processes that each hold `make`, or None (with a warning) when `make`
  does not pickle."""
  try:
    pickle.dumps(make)
  except Exception as e:  # noqa: BLE001 - any pickling failure means: no worker processes
    warnings.warn(f"batches are made on one thread: the batch maker does not pickle "
                  f"({type(e).__name__}: {str(e)[:200]}), which worker processes need")
    return None
  return concurrent.futures.ProcessPoolExecutor(
      workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
      initargs=(make,))


def spawn_blocker(make: Callable[[int], Any]) -> Optional[str]:
  """Why AUTO must not start worker processes for `make` (None: it may). A spawned process
  imports the parent's main module again: by name when it was started with `python -m`
  (its `if __name__ == "__main__"` part does not run), by path otherwise (all of a script
  runs again, which only a guarded script survives); and a class defined in a notebook or
  interactive session cannot be imported at all."""
  try:
    blob = pickle.dumps(make)
  except Exception as e:  # noqa: BLE001 - any pickling failure means: no worker processes
    return (f"the batch maker does not pickle ({type(e).__name__}: {str(e)[:200]}), which "
            "worker processes need")
  main = sys.modules.get("__main__")
  if getattr(main, "__spec__", None) is not None:
    return None
  if getattr(main, "__file__", None):
    return (f"a worker process would run {main.__file__} again; start it with python -m, "
            "or set batch_workers=N with its entry under `if __name__ == \"__main__\"`")
  if b"__main__" in blob:
    return ("the batch maker's source is defined in this notebook or interactive session, "
            "which worker processes cannot import; define it in a module")
  return None


AUTO = -1
# The batches and steps the automatic choice reads (the latest of each), and the steps it
# leaves out first (compiles, the first puts).
AUTO_WINDOW = 8
AUTO_SKIP = 3


def auto_worker_cap() -> int:
  """The most worker processes AUTO starts: none on a CPU backend (the step runs on those
  cores), else all cores but two (the loop's thread and the prefetch thread), at most 8."""
  if jax.default_backend() == "cpu":
    return 0
  return max(0, min(8, (os.cpu_count() or 1) - 2))


def workers_for(make_s: float, step_s: float, cap: int) -> int:
  """Worker processes that keep a loop of `step_s` seconds a step fed with batches that take
  `make_s` to make (with half again in hand: the step time measured while the loop waits
  for batches is its host side alone), at most `cap`; 0 when one thread keeps pace."""
  if cap < 1 or make_s <= 1.1 * step_s:
    return 0
  return min(cap, math.ceil(1.5 * make_s / max(step_s, 1e-6)))


class Prefetcher:
  """Batches `make(i)` for i in [start, stop), made `depth` ahead on a background thread (or
  in `workers` processes) and put on the device. `get(i)` must be called with start,
  start + 1, ... in turn; an exception `make` raised for batch i (a malformed batch) is raised
  by `get(i)`, where the loop would have met it without prefetching. `close()` (or the
  context manager) stops the thread and the workers."""

  def __init__(self, make: Callable[[int], Any], start: int, stop: int, depth: int = 2,
               put: Callable[[Any], Any] = to_device, workers: int = 0,
               max_workers: Optional[int] = None):
    """`workers`: N >= 1 worker processes, 0 the thread alone, AUTO started when the loop
    waits on the thread (at most `max_workers`, default `auto_worker_cap()`)."""
    if depth < 1:
      raise ValueError(f"Prefetcher depth={depth}: must be >= 1")
    if workers < AUTO:
      raise ValueError(f"Prefetcher workers={workers}: must be >= 0, or {AUTO} (automatic)")
    self._next = start
    self._stop = stop
    self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
    self._closed = threading.Event()
    self._events: "queue.SimpleQueue" = queue.SimpleQueue()
    self._next_offer = start   # the batch index the loop gets next from the queue
    # The loop's seconds between a get's return and the next get, and whether that get
    # found no batch ready (AUTO reads both).
    self._outside: "collections.deque" = collections.deque(maxlen=AUTO_WINDOW)
    self._waited: "collections.deque" = collections.deque(maxlen=AUTO_WINDOW)
    self._returned: Optional[float] = None
    self._gets = 0
    self._cap = 0
    if workers == AUTO:
      self._cap = auto_worker_cap() if max_workers is None else int(max_workers)
    self._pool = worker_pool(make, workers) if workers > 0 else None
    self.workers = workers if self._pool is not None else 0
    fill = (self._fill_from_pool if self._pool is not None else
            self._fill_then_workers if self._cap > 0 else self._fill)
    self._thread = threading.Thread(target=self._guarded,
                                    args=(fill, make, put, start, stop, depth),
                                    name="loka-batch-prefetch", daemon=True)
    self._thread.start()

  def _fill(self, make, put, start: int, stop: int, depth: int) -> None:
    del depth  # the queue's size holds the thread back
    for i in range(start, stop):
      try:
        item = (i, put(make(i)), None)
      except BaseException as e:  # handed to the loop at this step; nothing more is made
        item = (i, None, e)
      if not self._offer(item) or item[2] is not None:
        return

  def _guarded(self, fill, *args) -> None:
    """Runs `fill`; an exception it did not hand to the loop itself reaches the loop at the
    batch it expects next, so `get` never waits on a thread that has died."""
    try:
      fill(*args)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the loop must see it
      self._offer((self._next_offer, None, e))

  def _fill_then_workers(self, make, put, start: int, stop: int, depth: int) -> None:
    """AUTO: the thread makes batches, timing each, until the loop is seen waiting on it;
    then worker processes make the rest."""
    made: "collections.deque" = collections.deque(maxlen=AUTO_WINDOW)
    i = start
    while i < stop:
      began = time.perf_counter()
      try:
        item = (i, put(make(i)), None)
      except BaseException as e:  # handed to the loop at this step; nothing more is made
        item = (i, None, e)
      made.append(time.perf_counter() - began)
      if not self._offer(item) or item[2] is not None:
        return
      i += 1
      wanted = self._workers_wanted(made)
      if wanted and i < stop:
        blocker = spawn_blocker(make)
        if blocker is not None:
          warnings.warn(f"batches are made on one thread, slower than the step: {blocker}")
          self._cap = 0
          continue
        self._pool = worker_pool(make, wanted)
        self.workers = wanted
        self._events.put({"event": "batch_workers", "from_batch": i, "workers": wanted,
                             "make_ms": round(1e3 * statistics.median(made), 3),
                             "loop_ms": round(1e3 * statistics.median(self._outside), 3)})
        self._fill_from_pool(make, put, i, stop, depth)
        return

  def _workers_wanted(self, made) -> int:
    """Worker processes to start now (0: none): once both windows are full, the loop waited
    for its batch on most of its last steps, and making one is slower than its step."""
    if self._cap < 1 or len(made) < AUTO_WINDOW or len(self._outside) < AUTO_WINDOW:
      return 0
    if sum(self._waited) <= AUTO_WINDOW // 2:
      return 0
    return workers_for(statistics.median(made), statistics.median(self._outside), self._cap)

  def take_events(self) -> List[Dict[str, Any]]:
    """What the prefetcher changed since the last call (AUTO's start of worker processes:
    `{"event": "batch_workers", "from_batch", "workers", "make_ms", "loop_ms"}`)."""
    events = []
    while True:
      try:
        events.append(self._events.get_nowait())
      except queue.Empty:
        return events

  def _fill_from_pool(self, make, put, start: int, stop: int, depth: int) -> None:
    """Batches from the worker processes, in order; after a worker died, from the thread."""
    pending: "collections.deque" = collections.deque()
    i = start
    while True:
      try:
        while i < stop and len(pending) < depth + self.workers:
          pending.append((i, self._pool.submit(_make_in_worker, i)))
          i += 1
      except BrokenProcessPool as e:
        self._back_to_thread(e, pending[0][0] if pending else i, pending)
        return self._fill(make, put, pending[0][0] if pending else i, stop, depth)
      if not pending:
        return
      index, future = pending[0]
      try:
        item = (index, put(future.result()), None)
      except BrokenProcessPool as e:
        self._back_to_thread(e, index, pending)
        return self._fill(make, put, index, stop, depth)
      except BaseException as e:  # handed to the loop at this step; nothing more is made
        item = (index, None, e)
      pending.popleft()
      if not self._offer(item) or item[2] is not None:
        for _, f in pending:
          f.cancel()
        return

  def _back_to_thread(self, error, index: int, pending) -> None:
    """After a worker process died: the pool is dropped and the thread makes batch `index`
    on (the batches in flight are lost with the pool)."""
    warnings.warn(f"batches are made on one thread from batch {index} on: a worker process "
                  f"died ({type(error).__name__}: {str(error)[:200]})")
    for _, f in pending:
      f.cancel()
    pending.clear()
    self._pool.shutdown(wait=False, cancel_futures=True)
    self.workers = 0

  def _offer(self, item) -> bool:
    """Puts `item` on the queue unless closed first; False when closed."""
    while not self._closed.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        self._next_offer = item[0] + 1
        return True
      except queue.Full:
        continue
    return False

  def get(self, i: int) -> Any:
    """Batch i (the next one in order)."""
    if i != self._next or i >= self._stop:
      raise ValueError(f"Prefetcher.get({i}): expected batch {self._next} of "
                       f"[{self._next}, {self._stop})")
    called = time.perf_counter()
    if self._returned is not None:
      self._gets += 1
      if self._gets > AUTO_SKIP:
        self._waited.append(self._queue.empty())
        self._outside.append(called - self._returned)
    index, batch, error = self._queue.get()
    self._returned = time.perf_counter()
    assert index == i, (index, i)
    self._next = i + 1
    if error is not None:
      raise error
    return batch

  def close(self) -> None:
    self._closed.set()
    self._thread.join()
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def prefetcher(make: Callable[[int], Any], start: int, stop: int, depth: Optional[int],
               workers: int = AUTO) -> Optional[Prefetcher]:
  """A Prefetcher, or None when `depth` is 0 or None (batches made in the loop, in turn)."""
  if not depth or start >= stop:
    return None
  return Prefetcher(make, start, stop, depth, workers=workers)
