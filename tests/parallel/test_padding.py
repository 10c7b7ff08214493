"""Tables of any vocabulary on any `model` size: padded rows are invisible to the math, to the
optimizer and to checkpoints, which restore across meshes (M shards -> 1 device, -> other M)."""
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest
from jax.sharding import PartitionSpec as P

from loka_jax import parallel
from loka_jax.parallel import checkpoint as parallel_ckpt
from loka_jax.train import Checkpointer, bce_with_logits, compiled_steps, make_optimizer
from sharded_fixtures import (MAX_VOCAB, ODD_VOCABS, OPTIM, copy, host, mesh, odd_dlrm,
                              odd_state, odd_step)

FP32 = parallel.ParallelConfig(collectives="fp32")


def padding_rows(state, m):
  """{path: rows past the table's own} of every table leaf of a state padded for m shards."""
  out = {}
  for f, vocab in enumerate(ODD_VOCABS):
    name, vocab = f"sparse_{f}", min(vocab, MAX_VOCAB)
    out[f"params/{name}"] = np.asarray(state.params["embeddings"][name])[vocab:]
    leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(host(state.opt_state))
              if name in jax.tree_util.keystr(path)]
    for i, x in enumerate(leaves):
      out[f"opt/{name}/{i}"] = x[vocab:]
    assert leaves, name
  return out


class PaddingTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    """One sharded train step of the odd-vocabulary DLRM on data:2,model:2 and the training
    loop's step from the same state on one device."""
    super().setUpClass()
    model, _ = odd_dlrm()
    batch, state = odd_state()
    cls.tx = make_optimizer(OPTIM)
    cls.mesh = mesh("data:2,model:2")
    cls.sharded, sharded_batch, step = odd_step("fp32")   # test_traffic compiles it too
    cls.new, cls.out = step(copy(cls.sharded), sharded_batch)
    loop_step, _ = compiled_steps(model, OPTIM, "stop")
    cls.ref, cls.ref_out = loop_step(copy(state), batch)
    cls.layout = parallel.table_layout(model, cls.tx, batch, cls.mesh)

  def test_tables_are_padded_to_the_model_size(self):
    self.assertEqual(self.layout.padding(), {f"sparse_{f}": 1 for f in range(7)})
    tables = self.sharded.params["embeddings"]
    self.assertEqual(tables["sparse_1"].shape, (584, 16))
    self.assertEqual(tables["sparse_2"].shape, (996, 16))   # 1000 ids hashed onto 995 rows
    self.assertEqual(tables["sparse_7"].shape, (24, 16))
    self.assertEqual(tables["sparse_1"].sharding.spec, P("model"))
    # The ids reach the last real row of a small table, the one beside its padding row.
    batch, _ = odd_state()
    self.assertEqual(int(np.max(batch["sparse_ids"][:, 5])), ODD_VOCABS[5] - 1)

  def test_step_matches_one_device_and_padding_stays_zero(self):
    self.assertTrue(bool(self.out["ok"]))
    np.testing.assert_allclose(float(self.out["loss"]), float(self.ref_out["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(self.out["grad_norm"]), float(self.ref_out["grad_norm"]),
                               rtol=1e-4)
    unpadded = parallel.unshard_state(self.new, self.layout)
    chex.assert_trees_all_close(host(unpadded.params), host(self.ref.params), rtol=1e-4,
                                atol=1e-5)
    chex.assert_trees_all_close(host(unpadded.opt_state), host(self.ref.opt_state), rtol=1e-3,
                                atol=1e-7)
    for where, rows in padding_rows(self.new, 2).items():
      self.assertEqual(rows.size and np.count_nonzero(rows), 0, where)

  def test_a_model_size_of_three_pads_too(self):
    model, _ = odd_dlrm()
    batch, state = odd_state()
    three = mesh("data:1,model:3")
    sharded = parallel.shard_state(state, three)
    self.assertEqual(sharded.params["embeddings"]["sparse_3"].shape, (15, 16))
    small = {k: v[:48] for k, v in batch.items()}   # 16 examples per device
    sharded_batch = parallel.shard_batch(small, three)
    fn = parallel.make_loss_and_grads(model, three, sharded, sharded_batch, FP32)
    loss, grads, _ = fn(sharded.params, sharded.fp8_meta, sharded_batch, sharded.rng)
    logits = jax.jit(lambda p: model.apply({"params": p}, small, train=True))(state.params)
    np.testing.assert_allclose(float(loss), float(np.mean(np.asarray(
        bce_with_logits(logits, small["label"])))), rtol=1e-5)
    pad = np.asarray(grads["embeddings"]["sparse_3"])[13:]
    self.assertEqual(pad.shape, (2, 16))
    self.assertEqual(np.count_nonzero(pad), 0)

  def test_checkpoints_hold_unpadded_tables_and_move_across_meshes(self):
    model, _ = odd_dlrm()
    batch, state = odd_state()
    with tempfile.TemporaryDirectory() as directory:
      # Written on model:2 ...
      parallel_ckpt.save_sharded(directory, self.new, self.layout)
      # ... read by the single-device training loop, unpadded: 2 -> 1.
      template = copy(state)
      with Checkpointer(directory) as checkpointer:
        one, _ = checkpointer.restore(template)
      self.assertEqual(one.params["embeddings"]["sparse_1"].shape, (583, 16))
      expected = host(parallel.unshard_state(self.new, self.layout))
      chex.assert_trees_all_equal(host(one), expected)
      # ... and restored on model:4, padded for it: 2 -> 4.
      four = mesh("data:1,model:4")
      restored, _ = parallel_ckpt.restore_sharded(
          directory, parallel_ckpt.sharded_template(model, self.tx, batch, four),
          parallel.table_layout(model, self.tx, batch, four))
      self.assertEqual(restored.params["embeddings"]["sparse_1"].shape, (584, 16))
      self.assertEqual(restored.params["embeddings"]["sparse_3"].shape, (16, 16))
      self.assertEqual(restored.params["embeddings"]["sparse_1"].sharding.spec, P("model"))
      layout4 = parallel.table_layout(model, self.tx, batch, four)
      chex.assert_trees_all_equal(host(parallel.unshard_state(restored, layout4)), expected)
      for where, rows in padding_rows(restored, 4).items():
        self.assertEqual(rows.size and np.count_nonzero(rows), 0, where)
    with tempfile.TemporaryDirectory() as directory:
      # Written by one device (a 1-device mesh needs no padding) and restored on model:2.
      single = mesh("data:1,model:1")
      parallel_ckpt.save_sharded(directory, parallel.shard_state(state, single),
                                 parallel.table_layout(model, self.tx, batch, single))
      restored, _ = parallel_ckpt.restore_sharded(
          directory, parallel_ckpt.sharded_template(model, self.tx, batch, self.mesh),
          self.layout)
      chex.assert_trees_all_equal(host(restored), host(self.sharded))


if __name__ == "__main__":
  absltest.main()
