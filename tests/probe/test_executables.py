"""Evaluation functions compiled ahead on a thread pool (`probe.executables`): the same
numbers as jit compiling on first call, nothing compiled twice, failures left to jit. A
whole probe takes every evaluation function compiled ahead: tests/probe/test_timing_ahead.py."""
import threading
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax import kernels as kernels_lib
from loka_jax.probe import collector, evaluate, executables
from loka_jax.probe.collector import ProbeConfig

CONFIG = ProbeConfig()
# A per-pass kernel, an FP8 one and a fused op: each evaluator sort.
KERNELS = ("xla_bf16", "xla_fp8_rowwise", "flax_fp8_delayed")


def _observed_site(name, m, k, n, seed):
  """An act x weight site with statistics from two real update passes on random operands."""
  site = collector.make_site_probe(name, "mk,kn->mn", "act_weight", (m, k), (k, n), CONFIG)
  state = collector.init_site_state(site, CONFIG, dtype=jnp.bfloat16)
  update = jax.jit(lambda s, x, w, g, key: collector.update_site_state(s, site, x, w, g, key,
                                                                       CONFIG))
  rng = np.random.default_rng(seed)
  for i in range(2):
    operands = [rng.standard_normal(shape) for shape in ((m, k), (k, n), (m, n))]
    state = update(state, *(jnp.asarray(a, jnp.bfloat16) for a in operands),
                   jax.random.PRNGKey(i))
  return site, jax.device_get(state)


def _delta(before):
  """Calls since `before`, ahead and inline."""
  return {k: v - before[k] for k, v in executables.counts().items() if k != "compiled"}


class _BlockingFn:
  """Stands in for a jitted function whose compile takes until `release` is set."""

  def __init__(self, release: threading.Event):
    self.release, self.lowered = release, 0

  def lower(self, *args):
    self.lowered += 1
    self.release.wait(10)
    return self

  def compile(self, compiler_options=None):
    return lambda *args: "compiled"


class ExecutablesTest(chex.TestCase):

  def test_signature_is_shape_dtype_and_weak_type_of_concrete_or_abstract_args(self):
    x = jnp.ones((2, 3), jnp.float32)
    shape = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    self.assertEqual(executables.signature((x, {"a": x})),
                     executables.signature((shape, {"a": shape})))
    self.assertNotEqual(executables.signature((x,)), executables.signature((x.T,)))
    self.assertNotEqual(executables.signature((x,)),
                        executables.signature((x.astype(jnp.bfloat16),)))
    weak = jnp.asarray(1.0) * 2.0
    self.assertNotEqual(executables.signature((weak,)),
                        executables.signature((np.float32(2.0),)))

  def test_precompiled_site_evaluation_equals_jit_and_compiles_nothing_inline(self):
    kernels = [kernels_lib.get(k) for k in KERNELS]
    config = evaluate.EvalConfig(samples=3, reservoir_samples=3)
    site, state = _observed_site("ahead", 48, 96, 40, seed=3)
    executables.clear()
    before = executables.counts()
    with executables.Precompiler(2) as precompiler:
      jobs = evaluate.compile_jobs(site, state, kernels, "bfloat16", config)
      # Two samplers, the references and one evaluator per kernel.
      self.assertEqual(precompiler.submit(jobs), 2 + 1 + len(KERNELS))
      self.assertEqual(precompiler.submit(jobs), 0)      # queued or done: never twice
      ahead = evaluate.evaluate_site(site, state, kernels, "bfloat16", config)
    counts = _delta(before)
    self.assertEqual(counts["inline"], 0)
    # Per source: its sampler, the references and every kernel.
    self.assertEqual(counts["ahead"], 2 * (2 + len(KERNELS)))

    executables.clear()
    before = executables.counts()
    inline = evaluate.evaluate_site(site, state, kernels, "bfloat16", config)
    self.assertEqual(_delta(before), {"ahead": 0, "inline": 2 * (2 + len(KERNELS))})
    self.assertEqual(ahead.errors, {})
    self.assertEqual(set(ahead.results), {"gaussian", "reservoir"})
    for source, per_pass in inline.results.items():
      for p, per_kernel in per_pass.items():
        self.assertEqual(set(per_kernel), set(KERNELS), (source, p))
        for k, metrics in per_kernel.items():
          for metric, values in metrics.items():
            np.testing.assert_array_equal(ahead.results[source][p][k][metric], values,
                                          err_msg=f"{source} {p} {k} {metric}")
            self.assertEqual(len(values), 3)

  def test_a_compile_that_fails_ahead_fails_again_where_jit_reports_it(self):
    fn = jax.jit(lambda x: x @ jnp.ones((3, 3)))
    arg = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    before = executables.counts()
    with executables.Precompiler(1) as precompiler:
      precompiler.submit([(fn, (arg,))])
      with self.assertRaisesRegex(TypeError, "dot_general"):
        executables.call(fn, jnp.ones((2, 2)))
    self.assertEqual(_delta(before), {"ahead": 0, "inline": 1})
    self.assertNotIn(fn, [f for f, _ in executables._PENDING])   # no stale entry left

  def test_closing_cancels_queued_compiles_and_finishes_the_running_one(self):
    release = threading.Event()
    running, queued = _BlockingFn(release), [_BlockingFn(release) for _ in range(2)]
    arg = (jax.ShapeDtypeStruct((1,), jnp.float32),)
    precompiler = executables.Precompiler(1)
    precompiler.submit([(running, arg)] + [(fn, arg) for fn in queued])
    threading.Timer(0.3, release.set).start()
    precompiler.close()
    self.assertEqual(running.lowered, 1)
    self.assertEqual([fn.lowered for fn in queued], [0, 0])
    self.assertEqual(executables.call(running, jnp.ones((1,))), "compiled")
    self.assertFalse(any(f in queued for f, _ in executables._PENDING))

  def test_on_a_gpu_only_the_statistics_pass_compiles_with_autotuning(self):
    sites = {"s": collector.make_site_probe("s", "mk,kn->mn", "act_weight", (8, 4), (4, 2),
                                            CONFIG)}
    stats_pass = collector.make_observe(lambda v, b, r: 0.0, sites, CONFIG,
                                        {"s": jax.ShapeDtypeStruct((8, 2), jnp.float32)})
    evaluator = jax.jit(lambda x: x * 2)
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
      self.assertEqual(executables.compiler_options(evaluator), {"xla_gpu_autotune_level": 0})
      for fn in (stats_pass.extract, *stats_pass.updates.values()):
        self.assertEqual(executables.compiler_options(fn), {})
    self.assertEqual(executables.compiler_options(evaluator), {})  # the CPU has no autotuner
    # What the options ask for reaches XLA: a compile with them computes the same.
    x = jnp.arange(6.0)
    compiled = evaluator.lower(x).compile(compiler_options={"xla_gpu_autotune_level": 0})
    np.testing.assert_array_equal(compiled(x), x * 2)

  def test_needs_a_worker(self):
    with self.assertRaisesRegex(ValueError, "at least one worker"):
      executables.Precompiler(0)


if __name__ == "__main__":
  absltest.main()
