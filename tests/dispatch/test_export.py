"""Inference export of a planned tiny DLRM: e4m3 weights, static activation scales from real
probe statistics, predictions close to the planned model, no amax reduction in the exported
forward, and a save/load round trip with clear errors on damaged files."""
import dataclasses
import os
import shutil
import tempfile

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest

from loka_jax import dispatch
from loka_jax.data.make import make_source
from loka_jax.data.spec import FeatureSpec
from loka_jax.dispatch import export as export_lib
from loka_jax.kernels import EinsumSpec, KernelPlan
from loka_jax.models import SiteConfig, build_model, get_config
from loka_jax.precision import BF16
from loka_jax.precision.metrics import sqnr_db
from loka_jax.train.metrics import bce_with_logits
from plan_builders import BF16_SITE, make_plan, probe_stats

BATCH = 64


def reduce_max_count(hlo_text):
  """Reductions with a max combiner in lowered StableHLO (an amax is one)."""
  count = 0
  for line in hlo_text.splitlines():
    if "stablehlo.reduce" in line and "stablehlo.maximum" in line:
      count += 1
  return count


class ExportTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = get_config("dlrm", "tiny")
    cls.features = FeatureSpec.from_dict(dict(cls.config.features))
    cls.source = make_source("synthetic", features=cls.features, seed=5, num_eval=256)
    cls.batch = cls.source.train_batch(100, BATCH)
    bf16 = build_model(cls.config, cls.features, SiteConfig(BF16, KernelPlan.uniform("xla_bf16")))
    cls.variables = jax.jit(lambda b: bf16.init(jax.random.PRNGKey(3), b, train=False))(
        cls.batch)
    cls.report = probe_stats(bf16, cls.variables, cls.source)
    cls.plan = make_plan(cls.report["sites"])
    cls.planned = dispatch.apply(cls.config, cls.plan)
    cls.exported = export_lib.export(cls.config, cls.variables["params"], cls.plan, cls.report,
                                     batch=cls.batch)
    cls.dir = tempfile.mkdtemp(prefix="loka_export_")

  def test_sites_modes_and_e4m3_weights(self):
    sites = self.exported.sites
    self.assertEqual(sites[BF16_SITE].mode, export_lib.HIGH)
    fp8 = [n for n, s in sites.items() if s.mode == export_lib.FP8]
    self.assertLen(fp8, len(sites) - 1)
    self.assertEqual(sites["interaction/dot"].kind, "act_act")
    chex.assert_shape(self.exported.variables[export_lib.EXPORT]["interaction"]["dot"][
        "rhs_scale"], ())
    store = self.exported.variables[export_lib.EXPORT]
    top = store["top_mlp"]["dense_0"]
    self.assertEqual(top["weight"].dtype, jnp.float8_e4m3fn)
    # Stored contraction-last (`nk` for a `kn` kernel) with one scale per output column.
    kernel = self.variables["params"]["top_mlp"]["dense_0"]["kernel"]
    self.assertEqual(self.exported.sites["top_mlp/dense_0"].weight_axes, "nk")
    chex.assert_shape(top["weight"], kernel.shape[::-1])
    chex.assert_shape(top["weight_scale"], (kernel.shape[1], 1))
    np.testing.assert_allclose(
        np.asarray(top["weight"], np.float32) * np.asarray(top["weight_scale"]),
        np.asarray(kernel, np.float32).T, rtol=0.07, atol=1e-3 * float(jnp.abs(kernel).max()))
    self.assertNotIn("kernel", self.exported.variables["params"]["top_mlp"]["dense_0"])
    self.assertEqual(self.exported.variables["params"]["top_mlp"]["dense_2"]["kernel"].dtype,
                     jnp.bfloat16)
    # Static scale = the largest amax the probe saw / 448.
    amax = self.report["sites"]["top_mlp/dense_0"]["stats"]["lhs"]["amax"]["max"]
    np.testing.assert_allclose(float(top["lhs_scale"]), amax / 448.0, rtol=1e-6)
    memory = self.exported.memory
    self.assertLess(memory["site_weight_bytes_exported"], memory["site_weight_bytes"] / 3)
    self.assertGreater(memory["saved_bytes"], 0)

  def test_predictions_close_to_the_planned_model(self):
    planned = jax.jit(lambda v, b: self.planned.apply(v, b, train=False))
    fp32_model = dispatch.apply(self.config, KernelPlan.uniform("xla_fp32"))
    fp32 = jax.jit(lambda v, b: fp32_model.apply(v, b, train=False))
    sqnr = lambda a, b: float(sqnr_db(jnp.asarray(a), jnp.asarray(b)))
    for step in (200, 201):
      batch = self.source.train_batch(step, BATCH)
      ref = np.asarray(fp32(self.variables, batch), np.float32)
      plan_out = np.asarray(planned(self.variables, batch), np.float32)
      out = np.asarray(self.exported.apply(batch))
      chex.assert_shape(out, (BATCH,))
      self.assertGreater(np.abs(out - plan_out).max(), 0.0)  # really another computation
      # As close to the fp32 model as the planned FP8 model is (static vs current scales),
      # and close to the planned model itself.
      self.assertGreater(sqnr(out, ref), sqnr(plan_out, ref) - 3.0)
      self.assertGreater(sqnr(out, plan_out), 12.0)
      loss = lambda z: float(jnp.mean(bce_with_logits(jnp.asarray(z), batch["label"])))
      # Log loss moves no more than the planned FP8 model's own move from fp32 (+ 0.5%).
      self.assertLess(abs(loss(out) - loss(plan_out)),
                      2 * abs(loss(plan_out) - loss(ref)) + 5e-3 * loss(ref))

  def test_static_scales_no_amax_reduction_and_saturation(self):
    planned_text = jax.jit(lambda v, b: self.planned.apply(v, b, train=False)).lower(
        self.variables, self.batch).as_text()
    exported_text = jax.jit(self.exported.forward).lower(self.exported.variables,
                                                         self.batch).as_text()
    self.assertGreater(reduce_max_count(planned_text), 0)  # dynamic scaling takes amaxes
    self.assertEqual(reduce_max_count(exported_text), 0)
    self.assertIn("f8E4M3FN", exported_text)
    # A static scale does not follow the input: dense features far beyond the calibrated
    # amax saturate in the exported model but not in the planned one (current scaling).
    big = dict(self.batch, dense=(self.batch["dense"] * 1e4).astype(np.float32))
    ref = np.asarray(self.planned.apply(self.variables, big, train=False), np.float32)
    out = np.asarray(self.exported.apply(big))
    self.assertLess(float(sqnr_db(jnp.asarray(out), jnp.asarray(ref))), 15.0)

  def test_one_scale_products_write_the_output_dtype(self):
    # A product under one scalar scale (tensorwise or act x act) is an e4m3 dot writing the
    # model's output dtype, scaled after (Flax's `out_dq` form); rowwise weight scales keep a
    # float32 product until scaled.
    outputs = []

    def walk(jaxpr):
      for eqn in jaxpr.eqns:
        if (eqn.primitive.name == "dot_general"
            and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
            and eqn.invars[0].aval.dtype.itemsize == 1):
          outputs.append(eqn.outvars[0].aval.dtype)
        for param in eqn.params.values():
          for sub in (param if isinstance(param, (list, tuple)) else (param,)):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
              walk(inner)

    walk(jax.make_jaxpr(self.exported.forward)(self.exported.variables, self.batch).jaxpr)
    fp8 = [s for s in self.exported.sites.values() if s.mode == export_lib.FP8]
    rowwise = [s for s in fp8 if s.granularity == "rowwise"]
    self.assertNotEmpty(rowwise)
    self.assertLess(len(rowwise), len(fp8))
    self.assertEqual(sorted(map(str, outputs)),
                     sorted(["float32"] * len(rowwise) + ["bfloat16"] * (len(fp8) - len(rowwise))))

  def test_fp8_weights_reach_the_dot_without_a_transpose(self):
    # Every e4m3 dot of the exported forward reads its weight contraction-last as stored
    # (rhs contracting dimension last) and no e4m3 array is transposed on the way.
    dots, fp8_transposes = [], 0
    for eqn in jax.make_jaxpr(self.exported.forward)(self.exported.variables,
                                                     self.batch).jaxpr.eqns:
      dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
      if eqn.primitive.name == "transpose" and dtypes[0] == jnp.float8_e4m3fn:
        fp8_transposes += 1
      if eqn.primitive.name == "dot_general" and dtypes[1] == jnp.float8_e4m3fn:
        (_, rhs_contracting), _ = eqn.params["dimension_numbers"]
        dots.append((tuple(rhs_contracting), eqn.invars[1].aval.ndim))
    weight_sites = [s for s in self.exported.sites.values()
                    if s.mode == export_lib.FP8 and s.kind == "act_weight"]
    self.assertGreaterEqual(len(dots), len(weight_sites))
    self.assertNotEmpty(weight_sites)
    for contracting, ndim in dots:
      self.assertEqual(contracting, tuple(range(ndim - len(contracting), ndim)))
    self.assertEqual(fp8_transposes, 0)

  def test_exports_stored_in_the_specs_own_order_still_run(self):
    # An export saved before the contraction-last layout (`weight_axes` None, weights `kn`):
    # the same model, the same predictions.
    variables = jax.tree.map(np.asarray, self.exported.variables)
    sites = {}
    for name, info in self.exported.sites.items():
      if info.weight_axes is not None:
        node = variables[export_lib.EXPORT]
        for key in name.split("/"):
          node = node[key]
        order = [info.weight_axes.index(c) for c in EinsumSpec.parse(info.spec).rhs]
        node["weight"] = np.transpose(node["weight"], order)
        node["weight_scale"] = np.transpose(node["weight_scale"], order)
        info = dataclasses.replace(info, weight_axes=None)
      sites[name] = info
    old = export_lib.ExportedModel(self.exported.module, variables, sites, self.exported.plan,
                                   self.exported.memory)
    np.testing.assert_allclose(np.asarray(old.apply(self.batch)),
                               np.asarray(self.exported.apply(self.batch)), rtol=1e-5,
                               atol=1e-5)

  def test_a_serving_plans_fused_forward_exports_from_bf16_parameters(self):
    # A serving plan (`select(objective="serve")`) names a stateful fused op (delayed
    # scaling) for every pass of a site whose forward alone pays; the bench exports it on
    # the parameters the training arm (bf16 there) trained, which hold no FP8 state.
    fused = "flax_fp8_delayed_fwd"
    sites = {n: {p: {"kernel": fused if "mlp" in n and n != BF16_SITE else "xla_bf16",
                     "reason": "test"} for p in ("fwd", "grad_lhs", "grad_rhs")}
             for n in self.report["sites"]}
    plan = dispatch.Plan({"schema": dispatch.SCHEMA, "model": "dlrm", "sites": sites,
                          "rules": [], "default": None,
                          "provenance": {"objective": "serve"}})
    exported = export_lib.export(self.config, self.variables["params"], plan, self.report,
                                 batch=self.batch)
    modes = {n: s.mode for n, s in exported.sites.items()}
    mlp = [n for n in modes if "mlp" in n and n != BF16_SITE]
    self.assertNotEmpty(mlp)
    self.assertTrue(all(modes[n] == export_lib.FP8 for n in mlp), modes)
    self.assertTrue(all(exported.sites[n].granularity == "tensorwise" for n in mlp))
    bf16 = jax.jit(lambda v, b: dispatch.apply(self.config, KernelPlan.uniform(
        "xla_bf16")).apply(v, b, train=False))
    batch = self.source.train_batch(300, BATCH)
    out = np.asarray(exported.apply(batch), np.float32)
    ref = np.asarray(bf16(self.variables, batch), np.float32)
    self.assertTrue(np.all(np.isfinite(out)))
    self.assertGreater(np.abs(out - ref).max(), 0.0)
    self.assertGreater(float(sqnr_db(jnp.asarray(out), jnp.asarray(ref))), 12.0)

  def test_save_load_round_trip_and_errors(self):
    path = os.path.join(self.dir, "model")
    manifest = self.exported.save(path)
    with np.load(os.path.join(path, export_lib.ARRAYS)) as npz:
      entry = manifest["arrays"]["export/top_mlp/dense_0/weight"]
      raw = npz[entry["id"]]
    self.assertEqual(entry["dtype"], "float8_e4m3fn")
    self.assertEqual(raw.dtype, np.uint8)  # one byte per weight on disk
    np.testing.assert_array_equal(
        raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32),
        np.asarray(self.exported.variables["export"]["top_mlp"]["dense_0"]["weight"],
                   np.float32))
    again = export_lib.load(path)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, again.variables),
                                jax.tree.map(np.asarray, self.exported.variables))
    np.testing.assert_array_equal(np.asarray(again.apply(self.batch)),
                                  np.asarray(self.exported.apply(self.batch)))
    self.assertEqual(again.memory, self.exported.memory)
    broken = os.path.join(self.dir, "broken")
    shutil.copytree(path, broken)
    with open(os.path.join(broken, export_lib.ARRAYS), "r+b") as f:
      f.seek(100)
      f.write(b"\x00garbage\x00")
    with self.assertRaisesRegex(export_lib.ExportError, "checksum .* corrupt"):
      export_lib.load(broken)
    os.remove(os.path.join(broken, export_lib.ARRAYS))
    with self.assertRaisesRegex(export_lib.ExportError, "arrays.npz is missing"):
      export_lib.load(broken)
    os.remove(os.path.join(broken, export_lib.MANIFEST))
    with self.assertRaisesRegex(export_lib.ExportError, "no manifest.json"):
      export_lib.load(broken)
    with open(os.path.join(broken, export_lib.MANIFEST), "w") as f:
      f.write('{"schema": "loka.export/1", "arr')
    with self.assertRaisesRegex(export_lib.ExportError, "truncated or corrupt"):
      export_lib.load(broken)


if __name__ == "__main__":
  absltest.main()
