"""Training batches made and moved to the device ahead of the step that takes them.

The loop reads each step's metrics before it starts the next one (a non-finite step must stop
with the state before it), so every gap between two steps is device time lost: a batch made on
the host (14-34 ms for a `large` preset's 4096 synthetic examples on one core) and copied to
the device (2-5 MB) after the previous step ended would be such a gap. A `Prefetcher` makes
the next `depth` batches on a background thread, in step order, and starts their transfer
(`jax.device_put` returns at once), so the step finds its batch on the device.

One thread makes one batch at a time, and making one is mostly numpy indexing that holds the
GIL (15-18 ms for DLRM `large`'s 4096 synthetic examples on one core, where the bench's
step takes 6-7 ms on an H200), so more threads would not help. With `workers` N > 0 the
batches are made in N worker processes (spawned: the parent's JAX backend is never forked),
N + `depth` in flight, and the thread only puts them on the device in order. `make` must then
pickle (`BatchMaker` of a source that pickles); one that does not falls back to the thread,
with a warning.
"""
from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import pickle
import queue
import threading
import warnings
from typing import Any, Callable, Optional

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


class Prefetcher:
  """Batches `make(i)` for i in [start, stop), made `depth` ahead on a background thread (or
  in `workers` processes) and put on the device. `get(i)` must be called with start,
  start + 1, ... in turn; an exception `make` raised for batch i (a malformed batch) is raised
  by `get(i)`, where the loop would have met it without prefetching. `close()` (or the
  context manager) stops the thread and the workers."""

  def __init__(self, make: Callable[[int], Any], start: int, stop: int, depth: int = 2,
               put: Callable[[Any], Any] = to_device, workers: int = 0):
    if depth < 1:
      raise ValueError(f"Prefetcher depth={depth}: must be >= 1")
    if workers < 0:
      raise ValueError(f"Prefetcher workers={workers}: must be >= 0")
    self._next = start
    self._stop = stop
    self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
    self._closed = threading.Event()
    self._pool = worker_pool(make, workers) if workers else None
    self.workers = workers if self._pool is not None else 0
    fill = self._fill_from_pool if self._pool is not None else self._fill
    self._thread = threading.Thread(target=fill, args=(make, put, start, stop, depth),
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

  def _fill_from_pool(self, make, put, start: int, stop: int, depth: int) -> None:
    del make  # the workers hold it
    pending: "collections.deque" = collections.deque()
    i = start
    while True:
      while i < stop and len(pending) < depth + self.workers:
        pending.append((i, self._pool.submit(_make_in_worker, i)))
        i += 1
      if not pending:
        return
      index, future = pending.popleft()
      try:
        item = (index, put(future.result()), None)
      except BaseException as e:  # handed to the loop at this step; nothing more is made
        item = (index, None, e)
      if not self._offer(item) or item[2] is not None:
        for _, f in pending:
          f.cancel()
        return

  def _offer(self, item) -> bool:
    """Puts `item` on the queue unless closed first; False when closed."""
    while not self._closed.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def get(self, i: int) -> Any:
    """Batch i (the next one in order)."""
    if i != self._next or i >= self._stop:
      raise ValueError(f"Prefetcher.get({i}): expected batch {self._next} of "
                       f"[{self._next}, {self._stop})")
    index, batch, error = self._queue.get()
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
               workers: int = 0) -> Optional[Prefetcher]:
  """A Prefetcher, or None when `depth` is 0 or None (batches made in the loop, in turn)."""
  if not depth or start >= stop:
    return None
  return Prefetcher(make, start, stop, depth, workers=workers)
