"""The public API end to end on models loka_jax did not build: probe -> select -> wrap, on a
plain nn.Dense MLP (squared error), a DenseGeneral / Einsum model, and a model with two heads
(a weighted sum of a cross-entropy and a squared error).

Each model is probed once per class (setUpClass). Expected site names, shapes and FLOPs are
written by hand from the model definitions in api_models.py.
"""
import hashlib
import json
import math
import os
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest

import api_models as am
import loka_jax
from loka_jax.kernels import KernelPlan

PROBED = 3   # batches the probe observes


class _ProbeSelectWrap:
  """The checks every model gets; subclasses name the model and what it should give."""
  make_model = None
  make_batches = staticmethod(am.regression_batches)
  loss = staticmethod(am.mse)
  # {site: (lhs, rhs, out)} in call order, by hand
  expected = {}
  # {site: einsum spec}, for the sites whose spec the user wrote (nn.Einsum)
  expected_specs = {}

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = cls.make_model()
    cls.batches = cls.make_batches(PROBED)
    cls.x = cls.batches[0]["x"]
    cls.variables = jax.jit(cls.model.init)(jax.random.PRNGKey(0), cls.x)
    cls.variables_before = am.host_copy(cls.variables)
    cls.batches_before = am.host_copy(cls.batches)
    cls.report = loka_jax.probe(cls.model, cls.variables, cls.batches, cls.loss,
                                apply_fn=am.x_of(cls.model), samples=4)
    cls.plan = loka_jax.select(cls.report, min_speedup=None)
    cls.fp8 = loka_jax.wrap(cls.model, cls.plan)
    cls.bf16 = loka_jax.wrap(cls.model, KernelPlan.uniform("xla_bf16"))

  def fp8_forward_sites(self):
    return [s for s, e in self.plan["sites"].items() if e["fwd"]["kernel"] in am.FP8_KERNELS]

  def test_sites_are_the_linen_paths_of_every_layer(self):
    self.assertEqual(self.report["schema"], "loka.probe/2")
    self.assertEqual(list(self.report["sites"]), list(self.expected))
    self.assertEqual(self.report["unrouted_products"], [])
    self.assertEqual(sorted(self.plan["sites"]), sorted(self.expected))
    self.assertEqual(self.report["model"], type(self.model).__name__)

  def test_site_shapes_specs_and_flops(self):
    for name, (lhs, rhs, out) in self.expected.items():
      with self.subTest(site=name):
        site = self.report["sites"][name]
        self.assertEqual(site["shapes"], {"lhs": list(lhs), "rhs": list(rhs), "out": list(out)})
        self.assertEqual(site["kind"], "act_weight")
        # M*K * K*N * M*N = (M*K*N)^2
        flops = 2 * math.isqrt(math.prod(lhs) * math.prod(rhs) * math.prod(out))
        self.assertEqual(site["flops"], flops)
        if name in self.expected_specs:
          self.assertEqual(site["spec"], self.expected_specs[name])

  def test_every_site_saw_every_batch(self):
    self.assertEqual(self.report["run"]["observed_batches"], PROBED)
    # the batch tree's leaves (in key order): x is one of them
    self.assertIn([am.BATCH, am.IN, "float32"], self.report["run"]["batch"])
    for name in self.expected:
      with self.subTest(site=name):
        stats = self.report["sites"][name]["stats"]
        self.assertEqual(stats["observations"], PROBED)
        self.assertEqual(stats["lhs"]["rows_seen"], PROBED * am.BATCH)
        self.assertEqual(stats["reservoir"]["seen"], PROBED * am.BATCH)

  def test_plan_round_trips_through_its_file(self):
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    written = loka_jax.save_plan(self.plan, path)
    self.assertEqual(written, self.plan.to_dict())
    with open(path) as f:
      on_disk = json.load(f)
    # The file is the plan plus the sha256 of its content, which reading it checks and drops.
    digest = on_disk.pop("sha256")
    self.assertEqual(on_disk, self.plan.to_dict())
    self.assertEqual(digest, hashlib.sha256(json.dumps(
        on_disk, sort_keys=True, separators=(",", ":")).encode()).hexdigest())
    self.assertEqual(loka_jax.read_plan(path).to_dict(), self.plan.to_dict())
    kernel_plan = loka_jax.load_plan(path)
    self.assertEqual(kernel_plan, self.plan.kernel_plan())
    self.assertEqual(sorted(n for n, _ in kernel_plan.sites), sorted(self.expected))
    # the wrapped model from the file is the same model
    self.assertEqual(loka_jax.wrap(self.model, path).plan, self.fp8.plan)

  def test_wrap_keeps_the_models_variables(self):
    for wrapped in (self.fp8, self.bf16):
      chex.assert_trees_all_equal(jax.jit(wrapped.init)(jax.random.PRNGKey(0), self.x),
                                  self.variables)

  def test_probing_changes_neither_variables_nor_batches(self):
    chex.assert_trees_all_equal(am.host_copy(self.variables), self.variables_before)
    chex.assert_trees_all_equal(am.host_copy(self.batches), self.batches_before)

  def test_forward_is_fp8_where_the_plan_says_and_close_to_bf16(self):
    on_fp8 = self.fp8_forward_sites()
    # accuracy-only selection on unit-Gaussian inputs: some forward is FP8
    self.assertNotEmpty(on_fp8)
    out = jax.jit(self.fp8.apply)(self.variables, self.x)
    ref = jax.jit(self.bf16.apply)(self.variables, self.x)
    chex.assert_trees_all_equal_shapes(out, ref)
    chex.assert_tree_all_finite(out)
    err = am.rel_err(out, ref)
    self.assertGreater(err, 0.0)     # FP8 really ran
    self.assertLess(err, 0.1)
    # one e4m3 forward product per site the plan put on FP8, none elsewhere
    text = jax.jit(self.fp8.apply).lower(self.variables, self.x).as_text()
    self.assertEqual(am.fp8_dots(text), len(on_fp8))
    text = jax.jit(self.bf16.apply).lower(self.variables, self.x).as_text()
    self.assertEqual(am.fp8_dots(text), 0)

  def test_gradients_are_finite_and_close_to_bf16(self):
    def grad_fn(wrapped):
      loss = lambda params, batch: self.loss(wrapped.apply({"params": params}, batch["x"]),
                                             batch)
      return jax.jit(jax.grad(loss))
    params = self.variables["params"]
    got = grad_fn(self.fp8)(params, self.batches[1])
    ref = grad_fn(self.bf16)(params, self.batches[1])
    chex.assert_trees_all_equal_structs(got, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, params)
    chex.assert_tree_all_finite(got)
    err = am.rel_err(got, ref)
    self.assertGreater(err, 0.0)
    self.assertLess(err, 0.15)


class DenseMLPTest(_ProbeSelectWrap, chex.TestCase):
  make_model = am.DenseMLP
  expected = {"Dense_0": ((32, 16), (16, 32), (32, 32)),
              "block/up": ((32, 32), (32, 64), (32, 64)),
              "block/down": ((32, 64), (64, 32), (32, 32)),
              "Dense_1": ((32, 32), (32, 1), (32, 1))}


class DenseGeneralEinsumTest(_ProbeSelectWrap, chex.TestCase):
  make_model = am.GeneralEinsum
  expected = {"proj": ((32, 16), (16, 4, 8), (32, 4, 8)),
              "mix": ((32, 4, 8), (4, 8, 16), (32, 16)),
              "fold": ((32, 4, 4), (4, 4, 1), (32, 1))}
  expected_specs = {"mix": "bhd,hde->be"}

  def test_params_keep_flax_shapes(self):
    shapes = jax.tree.map(np.shape, self.variables["params"])
    self.assertEqual(shapes["proj"], {"kernel": (16, 4, 8), "bias": (4, 8)})
    self.assertEqual(shapes["mix"], {"kernel": (4, 8, 16), "bias": (16,)})
    self.assertEqual(shapes["fold"], {"kernel": (4, 4, 1), "bias": (1,)})


class TwoHeadsTest(_ProbeSelectWrap, chex.TestCase):
  make_model = am.TwoHeads
  make_batches = staticmethod(am.labelled_batches)
  loss = staticmethod(am.two_head_loss)
  expected = {"trunk": ((32, 16), (16, 32), (32, 32)),
              "cls": ((32, 32), (32, 5), (32, 5)),
              "reg": ((32, 32), (32, 1), (32, 1))}

  def test_both_heads_come_back(self):
    out = jax.jit(self.fp8.apply)(self.variables, self.x)
    self.assertEqual(sorted(out), ["logits", "value"])
    self.assertEqual(out["logits"].shape, (am.BATCH, 5))
    self.assertEqual(out["value"].shape, (am.BATCH,))
    # the cross-entropy gradient reaches the shared trunk through both heads
    self.assertGreater(self.report["sites"]["trunk"]["stats"]["grad"]["mean_abs"], 0.0)


if __name__ == "__main__":
  absltest.main()
