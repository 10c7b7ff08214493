"""Sharded training on 4 fake CPU devices: meshes, collectives, the sharded step, checkpoints."""
import functools
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

from loka_jax import kernels, parallel
from loka_jax.parallel import checkpoint as parallel_ckpt
from loka_jax.parallel import collectives, mesh as mesh_lib, step as step_lib
from loka_jax.precision import E4M3, metrics
from loka_jax.train import bce_with_logits, compiled_steps, create_train_state, make_optimizer
from loka_jax.train.experiment import RunSpec, build_run
from loka_jax.train.optim import OptimConfig

BATCH = 64          # 16 examples per device on data:2,model:2
OPTIM = OptimConfig()
FP32 = parallel.ParallelConfig(collectives="fp32")


@functools.lru_cache(maxsize=None)
def setup_model(name, precision="fp32"):
  """(model, batch, single-device state) of a tiny tower, built once per session."""
  model, source, _ = build_run(RunSpec(model=name, preset="tiny", precision=precision, seed=3))
  batch = source.train_batch(0, BATCH)
  state = create_train_state(model, make_optimizer(OPTIM), batch, seed=1)
  return model, batch, state


@functools.lru_cache(maxsize=None)
def mesh_2x2():
  return parallel.build_mesh("data:2,model:2")


@functools.lru_cache(maxsize=None)
def reference_loss_and_grads(name):
  """Single-device loss and gradients of `setup_model(name)` (plain jit, one device)."""
  model, batch, state = setup_model(name)

  def loss_fn(p):
    logits = model.apply({"params": p}, batch, train=True)
    return jnp.mean(bce_with_logits(logits, batch["label"]))
  return jax.jit(jax.value_and_grad(loss_fn))(state.params)


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


class MeshSpecTest(parameterized.TestCase):

  def test_parses_and_builds(self):
    self.assertEqual(parallel.parse_mesh_spec("model:2, data:2"), (("data", 2), ("model", 2)))
    self.assertEqual(parallel.parse_mesh_spec("data:4"), (("data", 4), ("model", 1)))
    mesh = parallel.build_mesh("data:1,model:4")
    self.assertEqual(dict(mesh.shape), {"data": 1, "model": 4})
    self.assertEqual(parallel.format_mesh_spec(mesh), "data:1,model:4")

  @parameterized.named_parameters(
      ("product", "data:3,model:2", r"needs 6 devices \(3 x 2\) but 4"),
      ("too_few", "data:2", r"needs 2 devices \(2 x 1\) but 4"),
      ("unknown_axis", "data:2,expert:2", "unknown axis 'expert'"),
      ("not_int", "data:two", "not an integer"),
      ("zero", "data:0,model:4", "sizes are >= 1"),
      ("twice", "data:2,data:2", "given twice"),
      ("no_colon", "data2", "is not AXIS:SIZE"),
  )
  def test_bad_specs_name_the_problem(self, spec, message):
    with self.assertRaisesRegex(parallel.MeshSpecError, message):
      parallel.build_mesh(spec)

  def test_batch_must_split_over_devices(self):
    model, batch, _ = setup_model("dlrm")
    odd = {k: v[:10] for k, v in batch.items()}
    with self.assertRaisesRegex(parallel.MeshSpecError, "batch size 10 .* multiple of 4"):
      parallel.shard_batch(odd, mesh_2x2())

  def test_partial_multihost_settings_are_an_error(self):
    self.assertIsNone(mesh_lib.distributed_settings(env={}))
    with self.assertRaisesRegex(parallel.MeshSpecError, "num_processes, process_id missing"):
      mesh_lib.distributed_settings(env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    self.assertEqual(mesh_lib.distributed_settings("h:1", 2, 1, env={}), ("h:1", 2, 1))


class CollectivesTest(chex.TestCase):
  """Every op in every mode against float64 numpy sums of the same per-device inputs."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(7)
    # Heavy tails and mixed magnitudes per block: what gradients and pooled rows look like.
    x = rng.standard_t(3, size=(4, 4, 6, 256)) * np.exp(rng.normal(0, 2, size=(4, 4, 6, 1)))
    cls.x = x.astype(np.float32)
    mesh = parallel.build_mesh("data:2,model:2")

    def body(local):
      local = local[0]
      out = {}
      for mode in collectives.MODES:
        codec = parallel.Codec(mode)
        out[mode] = {"all_reduce": parallel.all_reduce(local, parallel.BATCH_AXES, codec),
                     "reduce_scatter": parallel.reduce_scatter(local, parallel.BATCH_AXES, codec),
                     "all_gather": parallel.all_gather(local, parallel.BATCH_AXES, codec),
                     "all_to_all": parallel.all_to_all(local, parallel.BATCH_AXES, codec)}
      # Buckets of at most 300 values: leaf "a" (256) and "b" (3072) travel separately.
      out["tree"] = parallel.tree_all_reduce({"a": local[0, 0], "b": local[1:3]},
                                             parallel.BATCH_AXES, parallel.Codec("fp8"),
                                             bucket_elements=300)
      return jax.tree.map(lambda v: v[None], out)

    fn = parallel.shard_map(body, mesh, in_specs=P(parallel.BATCH_AXES),
                            out_specs=P(parallel.BATCH_AXES))
    cls.out = host(jax.jit(fn)(cls.x))

  def expected(self, op, x):
    """Per device (axis 0) what `op` must return, in float64, and sum |x_i| per element."""
    x = x.astype(np.float64)
    n = x.shape[0]
    if op == "all_reduce":
      return np.broadcast_to(x.sum(0), x.shape), np.broadcast_to(np.abs(x).sum(0), x.shape)
    if op == "reduce_scatter":
      return x.sum(0), np.abs(x).sum(0)                       # device i keeps chunk i
    if op == "all_gather":
      return np.broadcast_to(x, (n,) + x.shape), np.abs(np.broadcast_to(x, (n,) + x.shape))
    moved = np.swapaxes(x, 0, 1)                              # chunk j of device i -> j's slot i
    return moved, np.abs(moved)

  def check(self, mode, op, rel_bound):
    ref, mag = self.expected(op, self.x)
    got = self.out[mode][op]
    chex.assert_shape(got, ref.shape)
    # FP8: a value below the block's smallest subnormal flushes; allow half its spacing.
    scale = np.abs(self.x).max() / E4M3.max
    floor = (E4M3.min_subnormal / 2) * scale * self.x.shape[0] if mode == "fp8" else 0.0
    err = np.abs(got - ref)
    bound = rel_bound * (mag + np.abs(ref)) + floor + 1e-6 * mag
    worst = float(np.max(err - bound))
    self.assertLessEqual(worst, 0.0, f"{mode} {op}: error exceeds its bound by {worst}")
    return float(metrics.sqnr_db(jnp.asarray(got), jnp.asarray(ref)))

  def test_fp32_is_exact_up_to_summation_order(self):
    for op in collectives.OPS:
      self.check("fp32", op, 2 ** -22)

  def test_bf16_is_nearly_exact(self):
    for op in collectives.OPS:
      # One rounding of each input and of every partial sum (4 devices: at most 4 roundings).
      sqnr = self.check("bf16", op, 4 * 2 ** -8)
      self.assertGreater(sqnr, 40.0, op)

  def test_fp8_within_the_e4m3_bound(self):
    half_ulp = E4M3.epsilon / 2
    for op in collectives.OPS:
      # Inputs rounded once; an all-reduce also rounds the fp32 sum once before the gather.
      sqnr = self.check("fp8", op, half_ulp)
      self.assertGreater(sqnr, 25.0, op)
    # Data movement alone (all-to-all, all-gather) is a single e4m3 rounding: > 28 dB.
    self.assertGreater(self.check("fp8", "all_gather", half_ulp), 28.0)

  def test_tree_all_reduce_buckets_leaves(self):
    tree = self.out["tree"]
    chex.assert_shape(tree["a"], (4, 256))
    chex.assert_shape(tree["b"], (4, 2, 6, 256))
    # Scale blocks (128 values) fall on the same elements whether a leaf travels in its own
    # bucket or inside the whole buffer, so bucketing changes no value beyond fp32 rounding.
    whole = self.out["fp8"]["all_reduce"]
    np.testing.assert_allclose(tree["a"], whole[:, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(tree["b"], whole[:, 1:3], rtol=1e-6)
    self.assertFalse(np.array_equal(tree["a"], self.out["fp32"]["all_reduce"][:, 0, 0]))

  def test_fp8_does_not_sum_in_fp8(self):
    # Summing in e4m3 would round every partial sum; the fp32 local sum keeps the error of
    # the all-reduce within twice one rounding of the inputs, measured like a kernel.
    errors = parallel.measure("all_reduce", "fp8", jnp.asarray(self.x), mesh_2x2())
    ref, _ = self.expected("all_reduce", self.x)
    self.assertGreater(errors["sqnr_db"], 25.0)
    self.assertLess(errors["rel_fro"], 2 * E4M3.epsilon)
    self.assertGreater(errors["rel_fro"], 0.0)  # it really quantized

  def test_bad_mode_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "unknown collective mode 'int8'"):
      parallel.Codec("int8")


class ShardedStepTest(parameterized.TestCase):

  @parameterized.parameters("dlrm", "wukong")
  def test_sharded_loss_and_grads_match_one_device(self, name):
    model, batch, state = setup_model(name)
    mesh = mesh_2x2()
    sharded_state = parallel.shard_state(state, mesh)
    sharded_batch = parallel.shard_batch(batch, mesh)
    fn = parallel.make_loss_and_grads(model, mesh, sharded_state, sharded_batch, FP32)
    loss, grads, _ = fn(sharded_state.params, sharded_state.fp8_meta, sharded_batch,
                        sharded_state.rng)
    ref_loss, ref_grads = reference_loss_and_grads(name)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    chex.assert_trees_all_close(host(grads), host(ref_grads), rtol=1e-4, atol=1e-6)
    tables = sharded_state.params["embeddings"]
    self.assertEqual(tables["sparse_0"].sharding.spec, P("model"))
    self.assertEqual(grads["embeddings"]["sparse_0"].sharding.spec, P("model"))

  def test_train_step_matches_the_loop_and_gathers_no_activation(self):
    model, batch, state = setup_model("wukong")
    mesh = mesh_2x2()
    tx = make_optimizer(OPTIM)
    sharded_state = parallel.shard_state(state, mesh)
    sharded_batch = parallel.shard_batch(batch, mesh)
    step = parallel.make_train_step(model, tx, mesh, sharded_state, sharded_batch, FP32)
    compiled = step.lower(sharded_state, sharded_batch).compile()
    hlo = compiled.as_text()
    self.assertEqual(parallel.unexpected_all_gathers(hlo), [])
    # The one all-gather left is the embedding exchange's backward: pooled bags, not tower
    # activations ([model, B/devices, tables, d]).
    gathered = [g["shape"] for g in parallel.all_gathers(hlo)]
    self.assertEqual(gathered, [(2, BATCH // 4, 8, 16)])
    new, out = compiled(sharded_state, sharded_batch)
    loop_step, _ = compiled_steps(model, OPTIM, "stop")
    ref, ref_out = loop_step(jax.tree.map(jnp.copy, state), batch)  # it donates
    self.assertTrue(bool(out["ok"]))
    np.testing.assert_allclose(float(out["loss"]), float(ref_out["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(out["grad_norm"]), float(ref_out["grad_norm"]), rtol=1e-4)
    chex.assert_trees_all_close(host(new.params), host(ref.params), rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(host(new.opt_state), host(ref.opt_state), rtol=1e-3, atol=1e-7)
    self.assertEqual(int(new.step), 1)

  def test_hlo_check_catches_an_activation_all_gather(self):
    # A dense layer under plain jit whose activation is forced onto every device: the
    # partitioner gathers it, and the check must say so.
    mesh = mesh_2x2()
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, 24)),
                                   jnp.float32),
                       jax.sharding.NamedSharding(mesh, P(parallel.BATCH_AXES)))
    w = jnp.asarray(np.random.default_rng(2).normal(size=(24, 40)), jnp.float32)
    replicated = jax.sharding.NamedSharding(mesh, P())
    fn = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, replicated) * 2.0)
    found = parallel.unexpected_all_gathers(fn.lower(x, w).compile().as_text())
    self.assertNotEqual(found, [])
    self.assertIn(BATCH, found[0]["shape"])

  def test_fp8_collectives_stay_close_and_gather_only_gradients(self):
    model, batch, state = setup_model("wukong")
    mesh = mesh_2x2()
    config = parallel.ParallelConfig(collectives="fp8")
    sharded_state = parallel.shard_state(state, mesh)
    sharded_batch = parallel.shard_batch(batch, mesh)
    fn = parallel.make_loss_and_grads(model, mesh, sharded_state, sharded_batch, config)
    args = (sharded_state.params, sharded_state.fp8_meta, sharded_batch, sharded_state.rng)
    compiled = fn.lower(*args).compile()
    hlo = compiled.as_text()
    self.assertEqual(parallel.unexpected_all_gathers(hlo), [])
    grad_gathers = [g for g in parallel.all_gathers(hlo) if step_lib.GRAD_SCOPE in g["op_name"]]
    self.assertTrue(grad_gathers)
    # FP8 payloads (as bytes) and their fp32 scales: nothing else travels.
    self.assertEqual({g["dtype"] for g in grad_gathers}, {"u8", "f32"})
    self.assertNotIn(BATCH // 4, {d for g in grad_gathers for d in g["shape"]})
    loss, grads, _ = compiled(*args)
    ref_loss, ref_grads = reference_loss_and_grads("wukong")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)
    flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(host(t))])
    error = metrics.product_errors(flat(grads), flat(ref_grads))
    self.assertGreater(float(error["sqnr_db"]), 20.0)
    self.assertGreater(float(error["rel_fro"]), 0.0)

  def test_global_amax_gives_the_single_device_scales(self):
    mesh = mesh_2x2()
    kernel = kernels.get("xla_fp8_tensorwise")
    spec = kernels.EinsumSpec.parse("mk,kn->mn")
    rng = np.random.default_rng(5)
    x = rng.normal(size=(BATCH, 32)).astype(np.float32)
    x[3] *= 50.0  # the outlier lives on device 0 only: per-shard scales differ
    w = rng.normal(size=(32, 8)).astype(np.float32)

    def product(global_amax):
      def body(x, w):
        ctx = step_lib.global_tensorwise_amax() if global_amax else _null()
        with ctx:
          return kernel.einsum(spec, x, w, pass_name="fwd", out_dtype=jnp.float32)
      fn = parallel.shard_map(body, mesh, in_specs=(P(parallel.BATCH_AXES), P()),
                              out_specs=P(parallel.BATCH_AXES))
      return np.asarray(jax.jit(fn)(x, w))

    single = np.asarray(jax.jit(functools.partial(kernel.einsum, spec, pass_name="fwd",
                                                  out_dtype=jnp.float32))(x, w))
    np.testing.assert_allclose(product(True), single, rtol=1e-6, atol=1e-6)
    self.assertGreater(np.max(np.abs(product(False) - single)), 1e-3)


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


class CheckpointTest(absltest.TestCase):

  def test_saved_on_four_devices_restores_on_two(self):
    model, batch, state = setup_model("dlrm")
    tx = make_optimizer(OPTIM)
    four = parallel.shard_state(state, mesh_2x2())
    # Make the optimizer state non-trivial without a compile: fresh random accumulators.
    rng = np.random.default_rng(11)
    four = four.replace(opt_state=jax.tree.map(
        lambda x: jax.device_put((rng.random(x.shape) + 0.5).astype(x.dtype), x.sharding)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x, four.opt_state))
    with tempfile.TemporaryDirectory() as directory:
      parallel_ckpt.save_sharded(directory, four, parallel.TableLayout.of(state.params, 2),
                                 extras={"mesh": "data:2,model:2"})
      two = parallel.build_mesh("data:1,model:2", devices=jax.devices()[2:])
      template = parallel_ckpt.sharded_template(model, tx, batch, two)
      restored, extras = parallel_ckpt.restore_sharded(
          directory, template, parallel.table_layout(model, tx, batch, two))
    self.assertEqual(extras, {"mesh": "data:2,model:2"})
    table = restored.params["embeddings"]["sparse_3"]
    self.assertEqual(table.sharding.mesh.devices.size, 2)
    self.assertEqual(table.sharding.spec, P("model"))
    self.assertEqual({d.id for d in table.devices()}, {2, 3})
    chex.assert_trees_all_equal(host(restored), host(four))

  def test_missing_directory_is_a_clear_error(self):
    model, batch, _ = setup_model("dlrm")
    template = parallel_ckpt.sharded_template(model, make_optimizer(OPTIM), batch, mesh_2x2())
    with self.assertRaisesRegex(parallel_ckpt.CheckpointError, "no checkpoint"):
      parallel_ckpt.restore_sharded("/nonexistent/loka_ckpt", template,
                                    parallel.TableLayout.of(template.params, 2))


class ShardedRunTest(absltest.TestCase):

  def test_run_resumes_on_another_mesh(self):
    from loka_jax.parallel import run as parallel_run
    from loka_jax.train import TrainConfig, read_metrics
    model, source, _ = build_run(RunSpec(model="dlrm", preset="tiny", precision="fp32",
                                         seed=3, num_eval=128))
    with tempfile.TemporaryDirectory() as workdir:
      config = TrainConfig(steps=2, batch_size=BATCH, seed=1, log_every=1, progress=False)
      parallel_run.train_sharded(model, source, workdir, config, mesh_2x2(), FP32)
      more = TrainConfig(steps=3, batch_size=BATCH, seed=1, log_every=1, progress=False)
      final = parallel_run.train_sharded(model, source, workdir, more,
                                         parallel.build_mesh("data:1,model:4"), FP32)
      lines = read_metrics(f"{workdir}/metrics.jsonl")
    self.assertEqual([line["step"] for line in lines], [1, 2, 3])
    self.assertEqual((final["steps"], final["mesh"]), (3, "data:1,model:4"))
    self.assertTrue(np.isfinite([final["ne"], final["logloss"]]).all())
    # Step 1 starts from create_train_state's parameters: the loop's first loss.
    loop_step, _ = compiled_steps(model, OPTIM, "stop")
    state = create_train_state(model, make_optimizer(OPTIM), source.train_batch(0, BATCH), 1)
    _, out = loop_step(state, source.train_batch(0, BATCH))
    np.testing.assert_allclose(lines[0]["loss"], float(out["loss"]), rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
