"""How far a site moves the parameter gradient: one switch board for a round's sites
measures as each site's own program, and the distance is the float64 relative norm."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from loka_jax.dispatch import validate
from loka_jax.plan.file import FALLBACK
from loka_jax.kernels import FUSED_OP, registry
from validate_helpers import (BAD_SITE, GOOD_SITE, OTHER_SITE, context, kernels, plan_of,
                              register_test_kernels, switched_candidates, unregister_test_kernels)


def setUpModule():
  register_test_kernels()


def tearDownModule():
  unregister_test_kernels()


class SwitchedGradientTest(chex.TestCase):
  """The training checks' per-site gradient changes through one compiled program
  (`gradient_one_program`): the same values as each site's own gradient program, the same
  decisions."""

  def test_each_site_moves_the_gradient_as_its_own_program(self):
    ctx = context()
    wanted = switched_candidates()
    batches = 2
    reference = {}   # each way's bf16 gradient, computed once
    base = validate.gradients._gradient(ctx, validate.BASELINE, batches)
    off = validate.gradient_switched(ctx, wanted, (), batches)
    # Every switch off: the bf16+Mods gradient; the FP8 products that still run add nothing.
    chex.assert_trees_all_equal(off, base)
    changes = {}
    for site, choice in wanted.items():
      own = validate.gradients._gradient(ctx, validate.only_site(site, choice), batches)
      got = validate.gradient_switched(ctx, wanted, (site,), batches)
      self.assertGreater(validate.gradient_distance(got, off), 0.0, site)
      changes[site] = (validate.gradient_change(ctx, site, choice, batches, wanted, reference),
                       validate.gradient_change(ctx, site, choice, batches, None, reference))
      if registry.get(choice.fwd).sort == FUSED_OP:
        # XLA:CPU fuses the program around the pick differently, so a delayed scale follows
        # a bf16 ulp and the FP8 roundings are drawn afresh: the gradient vectors differ, but
        # how far the site moves the gradient stays within a few percent.
        self.assertAlmostEqual(changes[site][0], changes[site][1],
                               delta=0.1 * changes[site][1], msg=site)
      else:  # a per-pass kernel's program, bit for bit
        chex.assert_trees_all_equal(got, own)
        self.assertEqual(changes[site][0], changes[site][1], site)
    # Two bits per operand moves the gradient most either way.
    for way in (0, 1):
      self.assertEqual(max(changes, key=lambda s: changes[s][way]), BAD_SITE)

  def test_gradient_distance_is_the_float64_relative_norm(self):
    # Leaves from 1e-25 to 1e25: float32 squares of either end would underflow or overflow.
    rng = np.random.default_rng(7)
    ref = {"a": rng.normal(size=(64, 33)) * 1e-25, "b": {"c": rng.normal(size=(1000,)) * 1e25},
           "d": rng.normal(size=(5,))}
    g = {"a": ref["a"] * (1 + 0.3 * rng.normal(size=(64, 33))),
         "b": {"c": ref["b"]["c"] + 1e23 * rng.normal(size=(1000,))},
         "d": ref["d"] + rng.normal(size=(5,))}
    as32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
    g32, ref32 = as32(g), as32(ref)
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                     for x in jax.tree.leaves(t)])
    want = np.linalg.norm(flat(g32) - flat(ref32)) / np.linalg.norm(flat(ref32))
    self.assertTrue(np.isfinite(want) and want > 0)
    self.assertAlmostEqual(validate.gradient_distance(g32, ref32) / want, 1.0, delta=1e-5)
    self.assertEqual(validate.gradient_distance(ref32, ref32), 0.0)
    tiny = lambda t: {"a": t["a"]}   # its squares alone underflow float32
    want = (np.linalg.norm(flat(tiny(g32)) - flat(tiny(ref32)))
            / np.linalg.norm(flat(tiny(ref32))))
    self.assertAlmostEqual(validate.gradient_distance(tiny(g32), tiny(ref32)) / want, 1.0,
                           delta=1e-5)
    bad = jax.tree.map(lambda x: x, g32)
    bad["d"] = bad["d"].at[2].set(jnp.nan)
    self.assertEqual(validate.gradient_distance(bad, ref32), math.inf)
    with self.assertRaisesRegex(ValueError, "parameter trees differ"):
      validate.gradient_distance({"a": g32["a"]}, ref32)

  def test_the_leaves_a_gradient_change_moves_most_are_named(self):
    # A small leaf changed through and through is hidden in the whole gradient's change by
    # a large leaf that barely moves; each leaf's own relative change shows it.
    rng = np.random.default_rng(3)
    ref = {"dense": {"kernel": rng.normal(size=(256, 256))},
           "embed": {"table": 1e-3 * rng.normal(size=(50, 8))},
           "norm": {"scale": rng.normal(size=(8,))}, "zero": np.zeros(4)}
    g = {"dense": {"kernel": ref["dense"]["kernel"] * 1.001},
         "embed": {"table": -ref["embed"]["table"]},
         "norm": {"scale": ref["norm"]["scale"] * 1.1}, "zero": np.full(4, 0.5)}
    as32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
    value, extras = validate.gradient_distance(as32(g), as32(ref), largest_leaves=2)
    self.assertEqual(value, validate.gradient_distance(as32(g), as32(ref)))
    self.assertLess(value, 0.01)
    (first, change), (second, zero_change) = extras["largest_leaf_changes"]
    self.assertEqual(first, "['embed']['table']")
    self.assertAlmostEqual(change, 2.0, places=5)
    # A zero reference leaf reads its change's own norm: ||0.5 x 4|| = 1.
    self.assertEqual(second, "['zero']")
    self.assertAlmostEqual(zero_change, 1.0, places=5)
    self.assertLen(validate.gradient_distance(as32(g), as32(ref), largest_leaves=9)[1][
        "largest_leaf_changes"], 4)
    bad = as32(g)
    bad["norm"]["scale"] = bad["norm"]["scale"].at[0].set(jnp.inf)
    self.assertEqual(validate.gradient_distance(bad, as32(ref), largest_leaves=2),
                     (math.inf, {"largest_leaf_changes": []}))

  def test_the_shadow_check_decides_as_with_one_program_per_site(self):
    ctx = context()
    plan = plan_of({BAD_SITE: {"grad_rhs": "test_flipped"}, GOOD_SITE: "xla_fp8_rowwise",
                    OTHER_SITE: "flax_fp8_delayed"})
    outs = {}
    for one_program in (False, True):
      config = validate.ValidationConfig(shadow_steps=20, shadow_window=10,
                                         max_measured_sites=None,
                                         gradient_one_program=one_program)
      outs[one_program] = validate.check_shadow(plan, ctx, config)
    for site in (BAD_SITE, GOOD_SITE, OTHER_SITE):
      self.assertEqual(kernels(outs[True], site), kernels(outs[False], site), site)
    self.assertEqual(kernels(outs[True], BAD_SITE)["grad_rhs"], FALLBACK)
    first = {k: [r for r in validate.validation_records(o, "quality_shadow") if "round" in r][0]
             for k, o in outs.items()}
    self.assertFalse(first[True]["passed"])
    got, want = (first[k]["gradient_contributions"] for k in (True, False))
    self.assertEqual(sorted(got), sorted(want))
    for site in want:
      self.assertAlmostEqual(got[site], want[site], delta=0.05 * want[site], msg=site)


if __name__ == "__main__":
  absltest.main()
