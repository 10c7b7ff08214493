"""The state the checks run on: runs consume the context's one device copy and put it
back, also after an error."""

import chex
import jax
import numpy as np
from absl.testing import absltest

from loka_jax.dispatch import validate
from validate_helpers import (GOOD_SITE, context, plan_of, register_test_kernels,
                              unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class WorkingStateTest(chex.TestCase):
  """Training runs consume the context's one device copy of the state and put it back."""

  def test_shadow_and_timed_runs_leave_the_context_state_as_it_was(self):
    ctx = context()
    ctx._cache.pop("host_state", None)  # the backup is taken from the state the run donates
    before = jax.tree.map(lambda x: np.array(x, copy=True), ctx.state)
    kplan = plan_of({GOOD_SITE: "flax_fp8_delayed"}).kernel_plan()   # with fp8_meta
    run = validate.shadow_run(ctx, kplan, steps=3)
    self.assertTrue(run["finite"])
    validate.measure_steps(ctx, {"bf16": validate.BASELINE, "plan": kplan}, "bf16")
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, ctx.state), before)
    # A second shadow run of another plan starts from the same values.
    other = validate.shadow_run(ctx, plan_of({}).kernel_plan(), steps=3)
    self.assertTrue(other["finite"])
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, ctx.state), before)

  def test_an_error_inside_still_puts_the_state_back(self):
    ctx = context()
    before = jax.tree.map(lambda x: np.array(x, copy=True), ctx.state)
    with self.assertRaisesRegex(RuntimeError, "boom"):
      with validate.working_state(ctx) as state:
        self.assertIsNone(ctx.state)          # consumed while the run holds it
        del state
        raise RuntimeError("boom")
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, ctx.state), before)


if __name__ == "__main__":
  absltest.main()
