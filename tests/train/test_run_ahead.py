"""The loop's run-ahead (`TrainConfig.run_ahead`): a step's metrics are read after the next step
is dispatched, where nothing else needs the step, and that changes no number: not the metrics
lines, not final.json, not the state a non-finite step stops with or skips past."""
import os
import shutil
import tempfile
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest

from loka_jax.train import (NonFiniteError, OptimConfig, TrainConfig, loop, read_metrics,
                            restore_run, train)
from loka_jax.train import run_files

import train_toys


def _without_wall_clock(record):
  return {k: v for k, v in record.items() if k not in run_files.WALL_CLOCK_FIELDS}


class RunAheadTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix="loka_run_ahead_")
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

  def run_both(self, name, config, source):
    """{run_ahead: (final or the NonFiniteError, metrics lines, restored state)}."""
    out = {}
    for ahead in (False, True):
      workdir = os.path.join(self.dir, f"{name}_{ahead}")
      run_config = TrainConfig(**{**config, "run_ahead": ahead})
      try:
        result = train(train_toys.ToyClickModel(), source, workdir, run_config)
      except NonFiniteError as e:
        result = e
      lines = [_without_wall_clock(r) for r in read_metrics(os.path.join(workdir,
                                                                         "metrics.jsonl"))]
      restored = restore_run(workdir, train_toys.ToyClickModel(), source, run_config)
      out[ahead] = (result, lines, restored[0] if restored else None)
    return out

  def assert_same_state(self, a, b):
    self.assertEqual(int(a.step), int(b.step))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

  def test_a_skipped_step_behind_one_dispatched_ahead_trains_as_without(self):
    # Batch 7 is non-finite; step 8 (its line) is read after step 9 was dispatched, which
    # changes nothing and runs again once the skip is recorded.
    config = dict(steps=12, batch_size=64, log_every=1, checkpoint_every=6, progress=False,
                  nan_policy="skip")
    runs = self.run_both("skip", config, train_toys.ToySource(nan_at_step=7))
    (final_off, lines_off, state_off), (final_on, lines_on, state_on) = runs[False], runs[True]
    self.assertEqual(lines_on, lines_off)
    self.assertEqual([r["step"] for r in lines_on if r.get("skipped")], [8])
    self.assertEqual(_without_wall_clock(final_on), _without_wall_clock(final_off))
    self.assertEqual(final_on["skipped_steps"], 1)
    self.assert_same_state(state_on, state_off)

  def test_a_stop_behind_one_dispatched_ahead_keeps_the_state_before_it(self):
    config = dict(steps=20, batch_size=64, log_every=5, checkpoint_every=5, progress=False)
    runs = self.run_both("stop", config, train_toys.ToySource(nan_at_step=7))
    (err_off, lines_off, state_off), (err_on, lines_on, state_on) = runs[False], runs[True]
    self.assertIsInstance(err_on, NonFiniteError)
    self.assertEqual((err_on.step, err_on.site), (err_off.step, err_off.site))
    self.assertEqual(err_on.step, 8)
    self.assertEqual(lines_on, lines_off)
    self.assertEqual(int(state_on.step), 7)   # saved at the bad step: the state before it
    self.assert_same_state(state_on, state_off)

  def test_a_steps_metrics_are_read_after_the_next_step_is_dispatched(self):
    # "D" for each dispatch, the step number for each metrics line written. The first step
    # (its compile is timed) and the last (evaluated) are read at once; the others one step
    # behind.
    def order(run_ahead):
      events = []
      real_steps, real_write = loop.compiled_steps, run_files.MetricsWriter.write

      def recording_steps(*args, **kwargs):
        train_step, eval_step = real_steps(*args, **kwargs)

        def step(*step_args):
          events.append("D")
          return train_step(*step_args)
        return step, eval_step

      def write(writer, record):
        if "loss" in record:
          events.append(record["step"])
        return real_write(writer, record)

      config = TrainConfig(steps=6, batch_size=32, log_every=1, keep_checkpoints=0,
                           progress=False, run_ahead=run_ahead)
      with mock.patch.object(loop, "compiled_steps", recording_steps), \
          mock.patch.object(run_files.MetricsWriter, "write", write):
        train(train_toys.ToyClickModel(), train_toys.ToySource(),
              os.path.join(self.dir, f"order_{run_ahead}"), config)
      return events

    self.assertEqual(order(False), ["D", 1, "D", 2, "D", 3, "D", 4, "D", 5, "D", 6])
    self.assertEqual(order(True), ["D", 1, "D", "D", 2, "D", 3, "D", 4, "D", 5, 6])

  def test_the_step_compiles_once(self):
    # The flag the loop starts with and the one each step returns are placed alike: one
    # program, not a second compile a few steps in. (A learning rate of its own gives this
    # test a jitted step no other test has called.)
    optim = OptimConfig(learning_rate=0.00123)
    config = TrainConfig(steps=8, batch_size=32, log_every=1, keep_checkpoints=0,
                         progress=False, optim=optim)
    with jax.log_compiles(True), self.assertLogs("jax._src.interpreters.pxla", "WARNING") as logs:
      train(train_toys.ToyClickModel(), train_toys.ToySource(),
            os.path.join(self.dir, "once"), config)
    self.assertEqual(sum("Compiling jit(train_step)" in m for m in logs.output), 1)


if __name__ == "__main__":
  absltest.main()
