"""The timing loops call the timed function exactly as often as they divide by, however many
calls share one device-loop iteration, and return its result; the compiled loop keeps every
call of a pure product (XLA neither hoists nor merges them)."""
import concurrent.futures
import re
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import timing


def _counted_product(calls):
  def product(a, b):
    jax.debug.callback(lambda: calls.append(1))
    return a @ b
  return product


def _dots_in_loop_bodies(hlo: str) -> int:
  return sum(" dot(" in line for line in timing.loop_body_lines(hlo))


def _operands():
  key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
  return timing.random_normal(key_a, (4, 3)), timing.random_normal(key_b, (3, 2))


class LoopCallsTest(parameterized.TestCase):

  @parameterized.product(iterations=(1, 2, 3, timing.UNROLL + 1, timing.UNROLL + 2, 40),
                          unroll=(None, 1, timing.UNROLL))
  def test_repeat_in_loop_calls_fn_iterations_times(self, iterations, unroll):
    calls = []
    a, b = _operands()
    looped = timing.repeat_in_loop(_counted_product(calls), iterations, unroll=unroll)
    out = jax.block_until_ready(looped(a, b))
    jax.effects_barrier()
    self.assertLen(calls, iterations)
    np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b), rtol=1e-6)

  @parameterized.parameters(1, 2, 16)
  def test_a_chain_calls_the_product_as_often_as_it_says(self, calls):
    counted = []
    a, b = _operands()
    out = jax.block_until_ready(timing.chain(_counted_product(counted), calls)(a, b))
    jax.effects_barrier()
    self.assertLen(counted, calls)
    np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b), rtol=1e-6)

  @parameterized.parameters(1, 4)
  def test_xla_keeps_every_call_of_a_pure_product(self, unroll):
    # No callback here: a side effect would keep the calls alive whatever XLA does. With the
    # operands only passed through an optimization barrier, XLA's CPU pipeline hoisted the
    # product out of the loop (0 dots in the body), and the GPU's merged the unrolled calls.
    a, b = _operands()
    product = lambda x, y: x @ y
    chained = timing.chain(product, 1 + unroll).lower(a, b).compile().as_text()
    self.assertEqual(chained.count(" dot("), 1 + unroll)
    repeat = timing.repeat_in_loop(product, 1 + 2 * unroll, unroll=unroll).lower(a, b).compile()
    self.assertEqual(_dots_in_loop_bodies(repeat.as_text()), unroll)

  def test_a_whole_step_loop_touches_only_the_batch_and_keeps_every_call(self):
    a, b = _operands()
    product = lambda x, y: x @ y
    looped = timing.repeat_in_loop(product, 9, unroll=4, touch=(1,)).lower(a, b).compile()
    self.assertEqual(_dots_in_loop_bodies(looped.as_text()), 4)
    updated = {m.group(1) for l in timing.loop_body_lines(looped.as_text(), follow_calls=False)
               for m in [re.match(r"\s*%\S*dynamic-update-slice\S* = (\S+) ", l)] if m}
    self.assertEqual(updated, {"f32[3,2]{1,0}"})  # the batch (b) only, not a
    np.testing.assert_allclose(looped(a, b), np.asarray(a) @ np.asarray(b), rtol=1e-6)

  def test_a_sample_above_its_floor(self):
    self.assertAlmostEqual(timing.above_floor(10e-6, 4e-6), 6e-6)
    self.assertAlmostEqual(timing.above_floor(1e-6, 5e-6), 1e-8)  # noise: 1% kept

  def test_time_variants_times_work_above_the_chain_floor(self):
    a, b = _operands()
    with mock.patch.object(timing, "loop_unroll", lambda: 4):  # as on a GPU, 4 calls chained
      got = timing.time_variants({"p": (lambda x, y: x @ y, (a, b))}, repeats=3,
                                 min_call_seconds=1.0, max_inner=10)["p"]
    self.assertEqual(got.inner, 12)  # 10 wanted: 3 dispatches of 4 chained calls
    self.assertTrue(np.all(got.seconds > 0))

  def test_a_chain_sampler_times_its_floor_beside_it(self):
    a, b = _operands()
    sampler = timing.ChainSampler(lambda x, y: x @ y, (a, b), calls=3, warmup=1)
    sampler.dispatches = 2
    self.assertEqual(sampler.inner, 6)
    self.assertGreater(sampler.sample(), 0.0)
    self.assertGreater(sampler.floor_us, 0.0)
    single = timing.ChainSampler(lambda x, y: x @ y, (a, b), calls=1, warmup=1)
    single.sample()
    self.assertIsNone(single.floor_us)  # one call: no chain, nothing to subtract

  def test_a_chain_sampler_runs_executables_compiled_ahead_on_another_thread(self):
    a, b = _operands()
    fn = lambda x, y: x @ y
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      built = pool.submit(timing.compile_chain, fn, (a, b), 3).result()
    self.assertEqual((built.calls, built.looped), (3, False))
    sampler = timing.ChainSampler(fn, (a, b), calls=3, warmup=1, executables=built)
    self.assertIs(sampler.compiled, built.compiled)  # nothing compiled again
    self.assertGreater(sampler.sample(), 0.0)
    self.assertGreater(sampler.floor_us, 0.0)
    with self.assertRaisesRegex(ValueError, "compiled for 3 chained calls, asked for 2"):
      timing.ChainSampler(fn, (a, b), calls=2, executables=built)

  def test_depend_on_keeps_every_value_and_dtype(self):
    leaves = {"f": jnp.arange(6.0).reshape(2, 3), "bf": jnp.ones((2,), jnp.bfloat16) * 3,
              "i": jnp.arange(4, dtype=jnp.int32), "b": jnp.array([True, False]),
              "s": jnp.float32(2.5), "e": jnp.zeros((0, 3))}
    for carry in (jnp.float32(7.0), jnp.array([jnp.nan, 1.0]), jnp.array([jnp.inf])):
      got = jax.jit(timing.depend_on)(leaves, carry, timing.corners_of(leaves))
      for k, x in leaves.items():
        self.assertEqual(got[k].dtype, x.dtype, k)
        np.testing.assert_array_equal(got[k], x, err_msg=k)
    with self.assertRaisesRegex(ValueError, "no array element"):
      timing.depend_on((jnp.ones(2),), jnp.zeros((0,)), (jnp.ones((1,)),))

  def test_a_cpu_loop_runs_one_call_an_iteration(self):
    self.assertEqual(timing.loop_unroll(), 1 if jax.default_backend() != "gpu" else 16)


class TimeCallsTest(absltest.TestCase):

  def test_a_sample_runs_the_call_as_often_as_it_divides_by(self):
    counts = {"a": 0, "b": 0}

    def call(name):
      def run():
        counts[name] += 1
        return jnp.ones(3) * counts[name]
      return run

    got = timing.time_calls({"a": call("a"), "b": call("b")}, repeats=4, warmup=2,
                            calls_per_sample=3)
    self.assertEqual(counts, {"a": 2 + 4 * 3, "b": 2 + 4 * 3})
    self.assertEqual((got["a"].inner, got["a"].seconds.shape), (3, (4,)))
    with self.assertRaisesRegex(ValueError, "calls_per_sample"):
      timing.time_calls({"a": call("a")}, calls_per_sample=0)

  def test_interleaved_turns_the_order_around_every_repeat(self):
    self.assertEqual("".join(timing.interleaved(["a", "b", "c"], 3)), "abccbaabc")
    self.assertEqual(list(timing.interleaved({"x": 1}, 2)), ["x", "x"])

  def test_repeats_alternate_the_order_of_the_calls(self):
    order = []

    def call(name):
      def run():
        order.append(name)
        return jnp.ones(2)
      return run

    timing.time_calls({"a": call("a"), "b": call("b"), "c": call("c")}, repeats=4, warmup=1,
                      calls_per_sample=2)
    timed = "".join(order[3:])  # after one warm-up call of each
    self.assertEqual(timed, "aabbcc" "ccbbaa" "aabbcc" "ccbbaa")

  def test_calls_for_a_sample_of_at_least_the_wanted_time(self):
    def sleepy():  # at least 4 ms a call
      time.sleep(0.004)
      return jnp.zeros(())
    # A 4 ms sleep never returns early (so never more than 5 calls); a busy machine may stretch
    # all three timed calls, so 3 is not the floor: 2 allows for calls up to 10 ms.
    self.assertIn(timing.calls_for(sleepy, 0.02), (2, 3, 4, 5))
    self.assertEqual(timing.calls_for(sleepy, 0.0), 1)
    self.assertEqual(timing.calls_for(sleepy, 10.0, max_calls=7), 7)

if __name__ == "__main__":
  absltest.main()
