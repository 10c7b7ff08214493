"""Batches made ahead on a background thread (`train/prefetch.py`): in order, on the device,
errors at the step that meets them, and a thread that stops when asked."""
import sys
import threading
import time
import types
import warnings
from concurrent.futures.process import BrokenProcessPool
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest

import train_toys
from loka_jax.train import prefetch


def make(i):
  return {"x": np.full((4, 3), i, np.float32), "ids": np.arange(4, dtype=np.int32) + i}


class FailingAtTwo:
  """A picklable maker (worker processes import it from this module) that fails at batch 2."""

  def __call__(self, i):
    if i == 2:
      raise ValueError("sparse_ids: id -3 out of range at row 5")
    return make(i)


class SlowMaker:
  """A picklable maker that takes `seconds` a batch and fails at batch `fail_at`."""

  def __init__(self, seconds, fail_at=None):
    self.seconds, self.fail_at = seconds, fail_at

  def __call__(self, i):
    time.sleep(self.seconds)
    if i == self.fail_at:
      raise ValueError(f"dense: non-finite value at batch {i}")
    return make(i)


class DiesInAWorkerAt:
  """A picklable maker whose worker dies at batch `at` (the pool breaks, as when the kernel
  kills a process for memory); the prefetch thread makes that batch as any other."""

  def __init__(self, at):
    self.at = at

  def __call__(self, i):
    if i == self.at and threading.current_thread().name.startswith("stand-in-worker"):
      raise BrokenProcessPool("A process in the process pool was terminated abruptly")
    return make(i)


def thread_pool(maker, workers):
  """What `prefetch.worker_pool` gives, on threads: the same calls in this process (an AUTO
  test measures when and how many start, not process start-up)."""
  import concurrent.futures
  return concurrent.futures.ThreadPoolExecutor(workers, initializer=prefetch._start_worker,
                                               initargs=(maker,),
                                               thread_name_prefix="stand-in-worker")


class PrefetcherTest(absltest.TestCase):

  def test_batches_arrive_in_order_on_the_device(self):
    with prefetch.Prefetcher(make, 3, 9, depth=2) as p:
      for i in range(3, 9):
        batch = p.get(i)
        self.assertIsInstance(batch["x"], jax.Array)
        np.testing.assert_array_equal(np.asarray(batch["x"]), make(i)["x"])
        np.testing.assert_array_equal(np.asarray(batch["ids"]), make(i)["ids"])

  def test_it_stays_depth_ahead_and_no_further(self):
    made = []
    def counting(i):
      made.append(i)
      return make(i)
    with prefetch.Prefetcher(counting, 0, 100, depth=2) as p:
      p.get(0)
      deadline = time.monotonic() + 30
      while max(made) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
      self.assertGreaterEqual(max(made), 2)
      time.sleep(0.2)
      # Batch 0 taken: 1 and 2 wait in the queue, 3 is made and waits for room.
      self.assertLessEqual(max(made), 3)

  def test_an_error_is_raised_at_the_batch_that_met_it(self):
    def failing(i):
      if i == 2:
        raise ValueError("sparse_ids: id -3 out of range at row 5")
      return make(i)
    with prefetch.Prefetcher(failing, 0, 5, depth=3) as p:
      p.get(0)
      p.get(1)
      with self.assertRaisesRegex(ValueError, "id -3 out of range"):
        p.get(2)

  def test_close_stops_a_thread_waiting_on_a_full_queue(self):
    made = threading.Event()
    def signalling(i):
      made.set()
      return make(i)
    p = prefetch.Prefetcher(signalling, 0, 10_000, depth=1)
    self.assertTrue(made.wait(30))
    p.close()
    self.assertFalse(p._thread.is_alive())

  def test_any_exception_of_the_thread_reaches_the_loop(self):
    class Stop(BaseException):
      pass
    def stopping(i):
      raise Stop()
    with prefetch.Prefetcher(stopping, 0, 3, depth=1) as p:
      with self.assertRaises(Stop):
        p.get(0)

  def test_batches_out_of_order_or_past_the_end_are_refused(self):
    with prefetch.Prefetcher(make, 0, 2, depth=1) as p:
      with self.assertRaisesRegex(ValueError, "expected batch 0"):
        p.get(1)
      p.get(0)
      p.get(1)
      with self.assertRaisesRegex(ValueError, "expected batch 2"):
        p.get(2)

  def test_device_arrays_are_left_as_they_are(self):
    on_device = jax.device_put(np.ones(3, np.float32))
    out = prefetch.to_device({"a": on_device, "b": np.zeros(2)})
    self.assertIs(out["a"], on_device)
    self.assertIsInstance(out["b"], jax.Array)

  def test_worker_processes_make_the_batches_in_order_and_errors_at_their_batch(self):
    with prefetch.Prefetcher(FailingAtTwo(), 0, 6, depth=1, workers=2) as p:
      self.assertEqual(p.workers, 2)
      for i in (0, 1):
        np.testing.assert_array_equal(np.asarray(p.get(i)["x"]), make(i)["x"])
      with self.assertRaisesRegex(ValueError, "id -3 out of range"):
        p.get(2)

  def test_a_maker_that_does_not_pickle_is_run_on_the_thread(self):
    with self.assertWarnsRegex(UserWarning, "does not pickle"):
      p = prefetch.Prefetcher(lambda i: make(i), 0, 3, depth=1, workers=2)
    with p:
      self.assertEqual(p.workers, 0)
      for i in range(3):
        np.testing.assert_array_equal(np.asarray(p.get(i)["ids"]), make(i)["ids"])
    with self.assertRaisesRegex(ValueError, "workers=-2: must be >= 0, or -1"):
      prefetch.Prefetcher(make, 0, 5, depth=1, workers=-2)

  def test_workers_for_keeps_a_step_fed_within_the_cap(self):
    self.assertEqual(prefetch.workers_for(0.030, 0.007, 8), 7)   # ceil(1.5 * 30 / 7)
    self.assertEqual(prefetch.workers_for(0.030, 0.001, 8), 8)   # the cap
    self.assertEqual(prefetch.workers_for(0.010, 0.010, 8), 0)   # one thread keeps pace
    self.assertEqual(prefetch.workers_for(0.0105, 0.010, 8), 0)  # within 10%: still pace
    self.assertEqual(prefetch.workers_for(0.012, 0.010, 8), 2)
    self.assertEqual(prefetch.workers_for(0.030, 0.007, 0), 0)   # none allowed

  def test_auto_starts_workers_once_the_loop_waits_on_the_thread(self):
    # The loop takes no time between batches, so it waits on every one the thread makes in
    # 20 ms: after the windows fill, workers (at most max_workers) make the rest, in order,
    # and an error still reaches its own batch.
    with mock.patch.object(prefetch, "worker_pool", thread_pool):
      with prefetch.Prefetcher(SlowMaker(0.02, fail_at=40), 0, 60, depth=2, put=lambda b: b,
                               workers=prefetch.AUTO, max_workers=3) as p:
        for i in range(40):
          np.testing.assert_array_equal(p.get(i)["ids"], make(i)["ids"])
        with self.assertRaisesRegex(ValueError, "non-finite value at batch 40"):
          p.get(40)
        self.assertEqual(p.workers, 3)
        events = p.take_events()
    self.assertLen(events, 1)
    event = events[0]
    self.assertEqual((event["event"], event["workers"]), ("batch_workers", 3))
    # Not before both windows are full: the skipped gets, then AUTO_WINDOW measured ones.
    self.assertBetween(event["from_batch"], prefetch.AUTO_SKIP + prefetch.AUTO_WINDOW + 1, 25)
    self.assertGreaterEqual(event["make_ms"], 20.0)
    self.assertLess(event["loop_ms"], event["make_ms"] / 1.1)
    self.assertEqual(p.take_events(), [])

  def test_after_a_worker_dies_the_thread_makes_the_batches_on(self):
    with mock.patch.object(prefetch, "worker_pool", thread_pool), \
        self.assertWarnsRegex(UserWarning, "from batch 5 on: a worker process died"):
      with prefetch.Prefetcher(DiesInAWorkerAt(5), 0, 12, depth=2, put=lambda b: b,
                               workers=2) as p:
        for i in range(12):
          np.testing.assert_array_equal(p.get(i)["ids"], make(i)["ids"])
        self.assertEqual(p.workers, 0)

  def test_an_unexpected_error_of_the_thread_reaches_the_loop(self):
    # Anything the fill thread meets outside a batch (here: the pool refusing work) is
    # raised by the get that expects the next batch, instead of leaving it waiting.
    class Refusing:
      def submit(self, *args):
        raise RuntimeError("cannot schedule new futures after shutdown")

      def shutdown(self, **kwargs):
        pass

    with mock.patch.object(prefetch, "worker_pool", lambda maker, n: Refusing()):
      with prefetch.Prefetcher(make, 0, 6, depth=1, put=lambda b: b, workers=2) as p:
        with self.assertRaisesRegex(RuntimeError, "cannot schedule new futures"):
          p.get(0)

  def test_auto_starts_no_worker_that_would_rerun_a_script_or_miss_a_class(self):
    script = types.ModuleType("__main__")
    script.__file__, script.__spec__ = "/home/me/train_my_model.py", None
    module = types.ModuleType("__main__")
    module.__file__, module.__spec__ = "/x/experiments/train.py", mock.Mock()
    session = types.ModuleType("__main__")
    session.__spec__ = None

    class Local:   # pickles by reference to a module a worker could not import
      def __call__(self, i):
        return make(i)
    Local.__module__ = "__main__"
    Local.__qualname__ = "Local"
    for main, maker, expected in ((module, SlowMaker(0.0), None),
                                  (script, SlowMaker(0.0), "would run /home/me/"),
                                  (session, SlowMaker(0.0), None),
                                  (lambda: None, lambda i: i, "does not pickle")):
      with mock.patch.dict(sys.modules, {"__main__": main}):
        blocker = prefetch.spawn_blocker(maker)
      if expected is None:
        self.assertIsNone(blocker)
      else:
        self.assertIn(expected, blocker)
    with mock.patch.dict(sys.modules, {"__main__": session}):
      session.Local = Local
      self.assertIn("notebook or interactive session", prefetch.spawn_blocker(Local()))

  def test_auto_keeps_the_thread_when_batches_keep_pace(self):
    with mock.patch.object(prefetch, "worker_pool", thread_pool):
      with prefetch.Prefetcher(make, 0, 30, depth=2, put=lambda b: b, workers=prefetch.AUTO,
                               max_workers=3) as p:
        for i in range(30):
          p.get(i)
          time.sleep(0.005)   # a 5 ms step; a batch takes microseconds
        self.assertEqual((p.workers, p.take_events()), (0, []))

  def test_auto_starts_none_on_a_cpu_backend(self):
    # These tests run on XLA:CPU, where the step needs the cores the workers would take.
    self.assertEqual(prefetch.auto_worker_cap(), 0)
    with mock.patch.object(prefetch, "worker_pool", thread_pool):
      with prefetch.Prefetcher(SlowMaker(0.01), 0, 25, depth=2, put=lambda b: b,
                               workers=prefetch.AUTO) as p:
        for i in range(25):
          p.get(i)
        self.assertEqual((p.workers, p.take_events()), (0, []))

  def test_depth_zero_means_no_prefetcher(self):
    self.assertIsNone(prefetch.prefetcher(make, 0, 5, 0))
    self.assertIsNone(prefetch.prefetcher(make, 5, 5, 2))
    with self.assertRaisesRegex(ValueError, "depth=-1"):
      prefetch.Prefetcher(make, 0, 5, depth=-1)



class SlowToySource(train_toys.ToySource):
  """The toy source, 30 ms a batch: slower than the toy model's step on XLA:CPU."""

  def train_batch(self, step, batch_size):
    time.sleep(0.03)
    return super().train_batch(step, batch_size)


class LoopTest(absltest.TestCase):
  """The training loop with batches made ahead trains exactly as with batches made in turn."""

  def test_prefetching_changes_no_number_and_resumes_the_same(self):
    import json
    import os
    import tempfile
    from loka_jax.train import TrainConfig, train

    def run(workdir, prefetch_depth, steps=12, workers=0):
      config = TrainConfig(steps=steps, batch_size=32, log_every=3, checkpoint_every=6,
                           progress=False, prefetch=prefetch_depth, batch_workers=workers)
      final = train(train_toys.ToyClickModel(), train_toys.ToySource(seed=1), workdir, config)
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
      return final, [(r["step"], r["loss"]) for r in lines if "loss" in r]

    with tempfile.TemporaryDirectory() as tmp:
      final_0, lines_0 = run(os.path.join(tmp, "in_turn"), 0)
      final_2, lines_2 = run(os.path.join(tmp, "ahead"), 2)
      self.assertEqual(lines_0, lines_2)
      self.assertEqual(final_0["logloss"], final_2["logloss"])
      # Batches made in a worker process are the same batches. With batch_workers -1 (the
      # default) and a source slower than the toy step, the loop starts a worker once it
      # has waited on the thread (windows of 2 and one batch ahead here, so the waits show
      # early; a real backend's cap, 1): the toy source pickles, so the worker makes the
      # rest, with no fallback to the thread; the order across several workers is
      # PrefetcherTest's. (The test runner's main module is not a user's script: which
      # main modules rule workers out is PrefetcherTest's.)
      self.assertEqual(TrainConfig().batch_workers, prefetch.AUTO)
      with warnings.catch_warnings(), \
          mock.patch.object(prefetch, "auto_worker_cap", return_value=1), \
          mock.patch.multiple(prefetch, AUTO_WINDOW=2, AUTO_SKIP=1,
                              spawn_blocker=lambda make: None), \
          mock.patch.object(train_toys, "ToySource", SlowToySource):
        warnings.filterwarnings("error", message="batches are made on one thread")
        final_w, lines_w = run(os.path.join(tmp, "workers"), 1, workers=prefetch.AUTO)
      self.assertEqual(lines_w, lines_0)
      self.assertEqual(final_w["logloss"], final_0["logloss"])
      with open(os.path.join(tmp, "workers", "metrics.jsonl")) as f:
        started = [json.loads(line) for line in f if '"batch_workers"' in line]
      self.assertLen(started, 1)
      self.assertEqual(started[0]["workers"], 1)
      self.assertGreater(started[0]["make_ms"], started[0]["loop_ms"])
      self.assertBetween(started[0]["step"], 4, 11)
      with self.assertRaisesRegex(ValueError, "batch_workers must be >= 0, or -1"):
        TrainConfig(batch_workers=-2)
      # A run stopped at step 6 and resumed with prefetching reads the same batches.
      resumed = os.path.join(tmp, "resumed")
      run(resumed, 2, steps=6)
      final_r, lines_r = run(resumed, 2)
      self.assertEqual(lines_r, lines_0)
      self.assertEqual(final_r["logloss"], final_0["logloss"])

  def test_a_bad_batch_met_ahead_stops_the_run_at_its_own_step(self):
    import os
    import tempfile
    import train_toys
    from loka_jax.data.spec import BatchError
    from loka_jax.train import TrainConfig, train

    class BadAtFour(train_toys.ToySource):
      def train_batch(self, step, batch_size):
        if step == 4:
          raise BatchError("dense: non-finite value nan at row 1, column 0")
        return super().train_batch(step, batch_size)

    with tempfile.TemporaryDirectory() as tmp:
      config = TrainConfig(steps=8, batch_size=32, log_every=1, progress=False, prefetch=3)
      with self.assertRaisesRegex(BatchError, "non-finite value nan"):
        train(train_toys.ToyClickModel(), BadAtFour(), tmp, config)
      with open(os.path.join(tmp, "metrics.jsonl")) as f:
        # Met where the loop makes batch 4: after starting step 4, before its line.
        self.assertEqual(len(f.readlines()), 3)


if __name__ == "__main__":
  absltest.main()
