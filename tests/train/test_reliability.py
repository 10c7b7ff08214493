"""Bad inputs and numeric faults (docs/RELIABILITY.md): each one is refused with a message
naming the field, site, kernel or file and what to do, or handled without NaN or garbage.

Faults already proven elsewhere (checkpoints, probe reports, plans, MovieLens caches, NaN in
training) are listed in docs/RELIABILITY.md with their tests; this file covers the rest.
"""
import errno
import gzip
import json
import os
import tempfile

from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import jsonio
from loka_jax.data import criteo
from loka_jax.data.sources import DataFileError
from loka_jax.data.spec import BatchError, FeatureSpec, validate_batch
from loka_jax.kernels import EinsumSpec, FP8_META, get as get_kernel
from loka_jax.models import ActSite, DenseSite, SiteConfig
from loka_jax.train import (NonFiniteError, OptimConfig, RunSettingsError, TrainConfig,
                            restore_run, train)
from loka_jax.train import experiment

import train_toys

FEATURES = FeatureSpec(num_dense=3, vocab_sizes=(10, 20), bag_size=2)
FP8_KERNELS = ("xla_fp8_tensorwise", "xla_fp8_rowwise")
SIZES = {"m": 8, "k": 32, "n": 16}
SPEC = EinsumSpec.parse("mk,kn->mn")


def batch(seed=0, size=6):
  """A batch that meets the contract of FEATURES, from fresh random values."""
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, v, (size, FEATURES.bag_size)) for v in FEATURES.vocab_sizes],
                 axis=1).astype(np.int32)
  return {"dense": rng.normal(size=(size, FEATURES.num_dense)).astype(np.float32),
          "sparse_ids": ids, "sparse_mask": np.ones(ids.shape, bool),
          "label": (rng.random(size) < 0.3).astype(np.float32)}


def operands(pass_name, seed, scale=1.0):
  """Random operands of `pass_name` of SPEC (the pass's own einsum) and that spec."""
  spec = SPEC.for_pass(pass_name)
  rng = np.random.default_rng(seed)
  a = rng.normal(size=[SIZES[i] for i in spec.lhs]) * scale
  b = rng.normal(size=[SIZES[i] for i in spec.rhs]) * scale
  return spec, jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


class BatchContractTest(chex.TestCase):
  """validate_batch, which every data source runs on every batch it yields."""

  @parameterized.parameters((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf"))
  def test_non_finite_dense_names_field_row_and_column(self, value, text):
    b = batch(1)
    b["dense"][4, 2] = value
    with self.assertRaisesRegex(BatchError,
                                f"dense: non-finite value {text} at row 4, column 2; clean"):
      validate_batch(b, FEATURES)

  def test_non_finite_or_out_of_range_label(self):
    b = batch(2)
    b["label"][3] = np.nan
    with self.assertRaisesRegex(BatchError, "label: non-finite value nan at row 3"):
      validate_batch(b, FEATURES)
    b = batch(2)
    b["label"][1] = 2.0
    with self.assertRaisesRegex(BatchError, r"label: value 2.0 at row 1 is outside \[0, 1\]"):
      validate_batch(b, FEATURES)

  @parameterized.parameters((-3, "-3"), (20, "20"), (10, "10"))
  def test_out_of_vocabulary_id_names_field_row_and_remedy(self, value, text):
    b = batch(3)
    b["sparse_ids"][5, 0, 1] = value  # table 0 has 10 ids: 10 and 20 are out of range
    with self.assertRaisesRegex(
        BatchError, f"sparse_ids: id {text} out of range at row 5, position \\(0, 1\\).*"
        "id_policy='hash' or 'clip'"):
      validate_batch(b, FEATURES)

  def test_hash_and_clip_policies_map_bad_ids_into_the_vocabulary(self):
    b = batch(4)
    b["sparse_ids"][0, 0, 0] = -3
    b["sparse_ids"][1, 1, 1] = 47
    hashed = validate_batch(dict(b), FEATURES, id_policy="hash")["sparse_ids"]
    clipped = validate_batch(dict(b), FEATURES, id_policy="clip")["sparse_ids"]
    self.assertEqual((hashed[0, 0, 0], hashed[1, 1, 1]), (7, 7))     # -3 mod 10, 47 mod 20
    self.assertEqual((clipped[0, 0, 0], clipped[1, 1, 1]), (0, 19))
    untouched = np.ones(b["sparse_ids"].shape, bool)
    untouched[0, 0, 0] = untouched[1, 1, 1] = False
    np.testing.assert_array_equal(hashed[untouched], b["sparse_ids"][untouched])

  def test_padding_slots_may_hold_anything(self):
    b = batch(5)
    b["sparse_ids"][2, 1, 0] = -99
    b["sparse_mask"][2, 1, 0] = False
    out = validate_batch(b, FEATURES)
    self.assertEqual(out["sparse_ids"][2, 1, 0], -99)  # masked out: never looked up

  def test_wrong_shape_dtype_or_missing_field(self):
    b = batch(6)
    with self.assertRaisesRegex(BatchError, r"dense: shape \(6, 2\), expected \(6, 3\)"):
      validate_batch(dict(b, dense=b["dense"][:, :2]), FEATURES)
    with self.assertRaisesRegex(BatchError, "sparse_ids: dtype float32, expected int32"):
      validate_batch(dict(b, sparse_ids=b["sparse_ids"].astype(np.float32)), FEATURES)
    with self.assertRaisesRegex(BatchError, "no 'sparse_mask' field"):
      validate_batch({k: v for k, v in b.items() if k != "sparse_mask"}, FEATURES)

  def test_invalid_feature_spec_names_the_field(self):
    with self.assertRaisesRegex(ValueError, r"vocab_sizes\[1\]=0 \(must be >= 1\)"):
      FeatureSpec(num_dense=2, vocab_sizes=(5, 0))


class KernelInputTest(chex.TestCase):
  """Wrong shapes or dtypes into a kernel or a site name it."""

  @parameterized.parameters("xla_bf16", *FP8_KERNELS)
  def test_wrong_shape_names_the_kernel_and_index(self, name):
    _, a, _ = operands("fwd", 0)
    b = jnp.ones((SIZES["k"] + 3, SIZES["n"]))
    with self.assertRaisesRegex(ValueError, f"kernel {name} \\(fwd\\): einsum mk,kn->mn: "
                                            "index 'k' has size 32 in lhs but 35 in rhs"):
      get_kernel(name).einsum(SPEC, a, b, pass_name="fwd", out_dtype=jnp.float32)

  @parameterized.parameters("xla_bf16", *FP8_KERNELS)
  def test_integer_operand_names_the_kernel(self, name):
    _, a, b = operands("fwd", 1)
    with self.assertRaisesRegex(TypeError, f"kernel {name} .*rhs operand has dtype int32"):
      get_kernel(name).einsum(SPEC, a, b.astype(jnp.int32), pass_name="fwd",
                              out_dtype=jnp.float32)

  def test_site_names_itself_on_a_shape_mismatch(self):
    # (Sites cast their operands to the policy's compute dtype, as nn.Dense does.)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5)), jnp.float32)
    act = ActSite("be,ce->bc", config=SiteConfig.for_precision("fp8_all"), name="interaction")
    with self.assertRaisesRegex(ValueError, "site interaction: einsum be,ce->bc: index 'e' "
                                            "has size 5 in lhs but 4 in rhs"):
      act.init(jax.random.PRNGKey(0), x, x[:, :4])


class Fp8NumericFaultTest(chex.TestCase):
  """FP8 overflow saturates and all-zero operands stay zero: never NaN or Inf."""

  @parameterized.product(name=FP8_KERNELS, pass_name=("fwd", "grad_lhs", "grad_rhs"))
  def test_values_far_beyond_the_fp8_range_stay_finite_and_accurate(self, name, pass_name):
    # e4m3 ends at 448 and e5m2 at 57344; these operands are ~1e18, with one row ~1e-30.
    spec, a, b = operands(pass_name, 3, scale=1e18)
    a = a.at[0].multiply(1e-48)
    out = np.asarray(get_kernel(name).einsum(spec, a, b, pass_name=pass_name,
                                             out_dtype=jnp.float32), np.float64)
    ref = np.einsum(f"{spec.lhs},{spec.rhs}->{spec.out}", np.asarray(a, np.float64),
                    np.asarray(b, np.float64))
    self.assertTrue(np.isfinite(out).all())
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    self.assertLess(rel, 0.1)

  @parameterized.product(name=FP8_KERNELS, pass_name=("fwd", "grad_lhs", "grad_rhs"))
  def test_all_zero_operand_gives_an_exact_zero(self, name, pass_name):
    spec, a, b = operands(pass_name, 4)
    product = jax.jit(lambda x, y: get_kernel(name).einsum(spec, x, y, pass_name=pass_name,
                                                           out_dtype=jnp.float32))
    for zero_lhs in (True, False):
      x, y = (jnp.zeros_like(a), b) if zero_lhs else (a, jnp.zeros_like(b))
      out = np.asarray(product(x, y))
      self.assertTrue(np.isfinite(out).all())
      np.testing.assert_array_equal(out, 0.0)

  def test_delayed_scaling_saturates_a_stale_scale(self):
    # Flax's delayed scaling starts with scale 1: inputs ~1e6 overflow e4m3 on the first call.
    site = DenseSite(8, use_bias=False, name="tower",
                     config=SiteConfig.for_precision("fp8_all", kernel="flax_fp8_delayed"))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 16)), jnp.float32) * 1e6
    variables = site.init(jax.random.PRNGKey(1), x)

    def loss(params, meta, x):
      return jnp.sum(site.apply({"params": params, FP8_META: meta}, x).astype(jnp.float32))

    value, (g_params, g_meta) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
        variables["params"], variables[FP8_META], x)
    self.assertTrue(np.isfinite(float(value)))
    for leaf in jax.tree.leaves((g_params, g_meta)):
      self.assertTrue(np.isfinite(np.asarray(leaf, np.float32)).all())
    # Saturated, not wrapped: every input counted at most at the format max.
    out = np.asarray(site.apply(variables, x), np.float32)
    weight = np.asarray(variables["params"]["kernel"], np.float32)
    bound = 448.0 * np.abs(weight).sum(axis=0) * 1.1
    self.assertTrue((np.abs(out) <= bound).all())
    self.assertGreater(np.abs(out).max(), 0.1 * bound.max())

  @parameterized.parameters("xla_fp8_rowwise", "flax_fp8_delayed")
  def test_all_zero_input_keeps_gradients_finite(self, kernel):
    site = DenseSite(8, name="tower", config=SiteConfig.for_precision("fp8_all", kernel=kernel))
    x = jnp.zeros((4, 16), jnp.float32)
    variables = site.init(jax.random.PRNGKey(2), x)

    def loss(variables, x):
      return jnp.sum(site.apply(variables, x).astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss))(variables, x)
    for leaf in jax.tree.leaves(grads):
      self.assertTrue(np.isfinite(np.asarray(leaf, np.float32)).all())
    np.testing.assert_array_equal(np.asarray(grads["params"]["kernel"], np.float32), 0.0)


class TrainingFaultTest(chex.TestCase):

  def test_fp8_overflow_in_training_stops_naming_step_site_and_checkpoint(self):
    model = train_toys.ToyClickModel(config=SiteConfig.for_precision("fp8_all",
                                                                     kernel="xla_fp8_rowwise"))
    workdir = tempfile.mkdtemp(prefix="loka_rel_")
    config = TrainConfig(steps=10, batch_size=32, log_every=5, progress=False,
                         optim=OptimConfig(learning_rate=1e30))
    with self.assertRaises(NonFiniteError) as caught:
      train(model, train_toys.ToySource(seed=2), workdir, config)
    err = caught.exception
    self.assertEqual(err.step, 2)
    self.assertRegex(err.site, "'(hidden|out)'")
    self.assertIn("train.nan_policy=skip", str(err))
    state, _ = restore_run(workdir, model, train_toys.ToySource(seed=2), config)
    self.assertEqual(int(state.step), 1)  # the last good state, saved when it stopped
    for leaf in jax.tree.leaves(state.params):
      self.assertTrue(np.isfinite(leaf).all())

  def test_corrupt_run_config_names_the_file(self):
    workdir = tempfile.mkdtemp(prefix="loka_rel_")
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write('{"run": {"model": "dl')
    config = TrainConfig(steps=2, batch_size=32, progress=False)
    with self.assertRaisesRegex(RunSettingsError, f"{workdir}/config.json: not valid JSON.*"
                                                  "new run directory"):
      train(train_toys.ToyClickModel(), train_toys.ToySource(), workdir, config)

  def test_a_plan_for_another_model_is_refused_before_training(self):
    plan = {"schema": "loka.plan/1", "model": "wukong",
            "sites": {"wukong/layer_0/fmb/mlp_0": {"fwd": "xla_fp8_rowwise",
                                                   "grad_lhs": "xla_bf16",
                                                   "grad_rhs": "xla_bf16"}}}
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rel_"), "plan.json")
    with open(path, "w") as f:
      json.dump(plan, f)
    spec = experiment.RunSpec(model="dlrm", preset="tiny", precision="loka", plan=path,
                              num_eval=64)
    with self.assertRaises(experiment.PlanError) as caught:
      experiment.build_run(spec)
    text = str(caught.exception)
    self.assertIn(path, text)
    self.assertRegex(text, r"unknown site\(s\) \['wukong/layer_0/fmb/mlp_0'\]")
    self.assertRegex(text, r"uncovered site\(s\) \['bottom_mlp/dense_0'")
    self.assertIn("experiments.dispatch", text)


def criteo_lines(n, seed):
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    row = [str(int(rng.integers(0, 2)))] + [str(int(v)) for v in rng.integers(0, 900, 13)]
    row += [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)]
    rows.append("\t".join(row))
  return ("\n".join(rows) + "\n").encode()


class DamagedFileTest(chex.TestCase):

  def gz_file(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rel_"), "day_0.tsv.gz")
    with gzip.open(path, "wb") as f:
      f.write(criteo_lines(400, 7))
    return path

  def test_truncated_criteo_gzip_names_the_file(self):
    path = self.gz_file()
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
    with self.assertRaisesRegex(DataFileError, f"{path}: cannot read the file to its end "
                                               r"\(EOFError.*truncated or corrupt.*fetch it"):
      criteo.CriteoSource(path, config={"vocab_size": 100})

  def test_corrupt_criteo_gzip_names_the_file(self):
    path = self.gz_file()
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      f.write(bytes(np.random.default_rng(8).integers(0, 256, 64, dtype=np.uint8)))
    with self.assertRaisesRegex(DataFileError, f"{path}: cannot read the file to its end"):
      criteo.CriteoSource(path, config={"vocab_size": 100})

  def test_atomic_json_refuses_nan_and_keeps_the_old_file(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rel_"), "final.json")
    jsonio.write_json_atomic(path, {"ne": 0.75})
    with self.assertRaises(ValueError):
      jsonio.write_json_atomic(path, {"ne": float("nan")})
    with open(path) as f:
      self.assertEqual(json.load(f), {"ne": 0.75})

  def test_a_full_disk_keeps_the_previous_file_and_says_so(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rel_"), "plan.json")
    jsonio.write_json_atomic(path, {"kept": True})
    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch.object(jsonio.os, "fsync", side_effect=full):
      with self.assertRaisesRegex(OSError, f"cannot write {path} .*No space left on device.*; "
                                           "the previous one is intact"):
        jsonio.write_json_atomic(path, {"kept": False})
    with open(path) as f:
      self.assertEqual(json.load(f), {"kept": True})
    self.assertEqual(os.listdir(os.path.dirname(path)), ["plan.json"])

  def test_empty_json_names_the_file_and_the_remedy(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_rel_"), "plan.json")
    open(path, "w").close()
    with self.assertRaisesRegex(ValueError, f"{path}: the plan file is empty .*: run it again"):
      jsonio.read_json(path, "plan", "run it again", ValueError)


if __name__ == "__main__":
  absltest.main()
