"""Evaluation compiled while the probe trains (`ProbeOptions.compile_evaluation_while_training`):
when the first site's evaluation starts, every site's evaluation functions are compiled or
compiling, where without the option only the sites within the evaluation's lookahead are, and
the evaluation compiles nothing on first call. The thread that works out the jobs (`Precompiler.
submit_from_thread`) queues what its makers return and ends quietly on a failing maker or a
closed pool."""
import dataclasses
import tempfile
import threading
from unittest import mock

import chex
import jax
import jax.numpy as jnp
from absl.testing import absltest

from loka_jax.probe import assemble, executables, runner
from loka_jax.probe.collector import ProbeConfig
from loka_jax.train import TrainConfig, experiment

# Three sites of three shapes, so the evaluation's lookahead on two compile threads (two
# sites) leaves the third to be compiled after the first is evaluated.
SITES = "layer_0/fmb/(fm_proj|mlp/dense_0|mlp/dense_1)"
BATCH = 64


def _keys_held():
  with executables._LOCK:
    return len(set(executables._EXECUTABLES) | set(executables._PENDING))


class CompileWhileTrainingTest(chex.TestCase):

  def _probe(self, early):
    spec = experiment.RunSpec(model="wukong", preset="tiny", mods=("all",), num_eval=256)
    train_config = TrainConfig(steps=4, batch_size=BATCH, progress=False, log_every=0)
    options = runner.ProbeOptions(samples=2, kernels=("xla_bf16", "xla_fp8_rowwise"),
                                  sites=SITES, bootstrap=20, plots=False, compile_workers=2,
                                  compile_evaluation_while_training=early)
    held_at_first = []
    real = assemble.evaluated_passes

    def spy(*args, **kwargs):
      if not held_at_first:
        held_at_first.append(_keys_held())
      return real(*args, **kwargs)
    executables.clear()
    with mock.patch.object(assemble, "evaluated_passes", side_effect=spy):
      result = runner.run_probe(spec, tempfile.mkdtemp(prefix="loka_early_"), train_config,
                                ProbeConfig(cadence=2), options)
    described = runner.describe_probe(spec, train_config, ProbeConfig(cadence=2), options)
    return result, held_at_first[0], described, executables.counts()

  def test_every_sites_evaluation_is_compiled_or_compiling_when_evaluation_starts(self):
    # Without the option, the evaluation's lookahead (two sites on two threads) holds 14 of
    # these 19 functions when the first site is evaluated; the third site's come later.
    result, held, described, counts = self._probe(early=True)
    every = described["evaluation_functions"] + described["statistics_functions"]
    self.assertEqual((every, held), (19, 19))
    # Every call took a function compiled ahead, each compiled once: the jobs worked out from
    # the statistics' shapes before training are the ones the evaluation calls.
    self.assertEqual((counts["inline"], counts["compiled"]), (0, every))
    self.assertTrue(result.complete)


class DefaultTest(absltest.TestCase):
  """Unset, the option is on where the probe trains on a GPU and off on the CPU, where the
  compiles would take the training's cores; set, it is what it says; a resumed probe (an
  evaluation cache) or compiles on first call never take it."""

  def test_unset_follows_the_backend_and_a_set_value_wins(self):
    unset, on, off = (runner.ProbeOptions(compile_evaluation_while_training=v)
                      for v in (None, True, False))
    wanted = runner._EarlyEvaluationCompiles.wanted
    self.assertIsNone(runner.ProbeOptions().compile_evaluation_while_training)
    self.assertEqual((wanted(unset, {}), wanted(on, {}), wanted(off, {})), (False, True, False))
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
      self.assertEqual((wanted(unset, {}), wanted(on, {}), wanted(off, {})),
                       (True, True, False))
      self.assertFalse(wanted(unset, {"site": {}}))
      self.assertFalse(wanted(dataclasses.replace(unset, compile_workers=0), {}))


class SubmitFromThreadTest(chex.TestCase):

  def test_makers_are_called_in_turn_and_a_failing_one_ends_the_thread(self):
    first, last = jax.jit(lambda x: x + 1), jax.jit(lambda x: x * 3)
    arg = (jax.ShapeDtypeStruct((2,), jnp.float32),)

    def failing():
      raise ValueError("cannot work out the jobs")
    before = executables.counts()
    with executables.Precompiler(1) as precompiler:
      precompiler.submit_from_thread([lambda: [(first, arg)], failing,
                                      lambda: [(last, arg)]]).join(10)
      self.assertEqual(precompiler.queued, 1)
      self.assertEqual(list(executables.call(first, jnp.ones(2))), [2.0, 2.0])
      self.assertEqual(list(executables.call(last, jnp.ones(2))), [3.0, 3.0])
    counts = executables.counts()
    self.assertEqual((counts["ahead"] - before["ahead"], counts["inline"] - before["inline"]),
                     (1, 1))

  def test_a_closed_pool_ends_the_thread_without_queueing(self):
    precompiler = executables.Precompiler(1)
    precompiler.close()
    called = threading.Event()

    def maker():
      called.set()
      return [(jax.jit(lambda x: x), (jax.ShapeDtypeStruct((1,), jnp.float32),))]
    thread = precompiler.submit_from_thread([maker, maker])
    thread.join(10)
    self.assertFalse(thread.is_alive())
    self.assertTrue(called.is_set())
    self.assertEqual(precompiler.queued, 0)


if __name__ == "__main__":
  absltest.main()
