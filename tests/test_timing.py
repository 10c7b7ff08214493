"""The timing loops call the timed function exactly as often as they divide by, however many
calls share one device-loop iteration, and return its result."""
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import timing
from loka_jax.probe import kernel_timing


def _counted_product(calls):
  def product(a, b):
    jax.debug.callback(lambda: calls.append(1))
    return a @ b
  return product


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

  @parameterized.parameters((1, 1), (3, 1), (1, 16), (4, 16))
  def test_the_probe_loop_calls_the_product_as_often_as_it_says(self, n, unroll):
    calls = []
    a, b = _operands()
    looped = kernel_timing._looped(_counted_product(calls), unroll)
    out = jax.block_until_ready(looped(jnp.int32(n), a, b))
    jax.effects_barrier()
    self.assertLen(calls, kernel_timing.loop_calls(n, unroll))
    np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b), rtol=1e-6)

  def test_a_cpu_loop_runs_one_call_an_iteration(self):
    self.assertEqual(timing.loop_unroll(), 1 if jax.default_backend() != "gpu" else 16)

  def test_loop_calls(self):
    self.assertEqual(kernel_timing.loop_calls(1, 16), 1)
    self.assertEqual(kernel_timing.loop_calls(4, 16), 49)



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

  def test_calls_for_a_sample_of_at_least_the_wanted_time(self):
    def sleepy():  # at least 4 ms a call
      time.sleep(0.004)
      return jnp.zeros(())
    self.assertIn(timing.calls_for(sleepy, 0.02), (3, 4, 5))
    self.assertEqual(timing.calls_for(sleepy, 0.0), 1)
    self.assertEqual(timing.calls_for(sleepy, 10.0, max_calls=7), 7)

if __name__ == "__main__":
  absltest.main()
