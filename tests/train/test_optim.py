"""The optimizers' learning-rate schedules: warm-up and cooldown, checked against rates
worked out by hand, in the schedule and in the updates Adam and row-wise Adagrad apply."""
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax.train.optim import (OptimConfig, cooldown_at_end, learning_rate_schedule,
                                  make_optimizer)


class ScheduleTest(absltest.TestCase):

  def test_warm_up_then_constant_then_cooldown_to_zero(self):
    schedule = learning_rate_schedule(1e-3, 2, 6, 4)
    # Steps 0-1 warm up, 2-5 hold the peak, 6-9 fall by a quarter each, 10 on are 0.
    want = [0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0, 0]
    np.testing.assert_allclose([float(schedule(i)) for i in range(12)], want, atol=1e-12)
    np.testing.assert_allclose([float(learning_rate_schedule(0.5, 0, 2, 2)(i))
                                for i in range(5)], [0.5, 0.5, 0.5, 0.25, 0.0], atol=1e-12)
    self.assertEqual(float(learning_rate_schedule(0.5, 0)(1000)), 0.5)

  def test_both_optimizers_follow_the_cooldown(self):
    # A constant gradient of 1: Adam's bias-corrected step is then the rate itself, and
    # row-wise Adagrad's after t steps is the rate / sqrt(t) (a row's sum of mean squares
    # is t).
    config = OptimConfig(learning_rate=1e-3, embedding_learning_rate=0.05, cooldown_start=2,
                         cooldown_steps=2)
    params = {"embeddings": {"table": jnp.ones((3, 2))}, "dense": {"w": jnp.ones((2,))}}
    grads = {"embeddings": {"table": jnp.ones((3, 2))}, "dense": {"w": jnp.ones((2,))}}
    tx = make_optimizer(config)
    state = tx.init(params)
    dense, table = [], []
    for _ in range(5):
      updates, state = tx.update(grads, state, params)
      dense.append(float(updates["dense"]["w"][0]))
      table.append(float(updates["embeddings"]["table"][0, 0]))
    rate = [1.0, 1.0, 1.0, 0.5, 0.0]
    np.testing.assert_allclose(dense, [-1e-3 * r for r in rate], rtol=1e-4)
    np.testing.assert_allclose(table, [-0.05 * r / np.sqrt(t + 1) for t, r in enumerate(rate)],
                               rtol=1e-4)

  def test_a_cooldown_at_the_end_starts_its_length_before_the_last_step(self):
    self.assertEqual(cooldown_at_end(600, 200), {"cooldown_start": 400, "cooldown_steps": 200})
    self.assertEqual(cooldown_at_end(600, 0), {"cooldown_start": 0, "cooldown_steps": 0})
    self.assertEqual(cooldown_at_end(600, 500, warmup_steps=100)["cooldown_start"], 100)
    with self.assertRaisesRegex(ValueError, r"cooldown_steps must be in \[0, steps - "
                                r"warmup_steps = 500\], got 501"):
      cooldown_at_end(600, 501, warmup_steps=100)

  def test_a_wrong_cooldown_is_refused_naming_it(self):
    with self.assertRaisesRegex(ValueError, "cooldown_steps must be >= 0, got -1"):
      OptimConfig(cooldown_steps=-1)
    with self.assertRaisesRegex(ValueError, r"cooldown_start=3 is inside the warm-up "
                                r"\(warmup_steps=5\)"):
      OptimConfig(warmup_steps=5, cooldown_start=3, cooldown_steps=2)


if __name__ == "__main__":
  absltest.main()
