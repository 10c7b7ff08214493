"""The bytes model of the sharded step (traffic.py) against hand-computed bytes of a tiny
tower and against the collectives of the compiled step."""
import collections

import jax
import numpy as np
from absl.testing import absltest

from loka_jax import parallel
from loka_jax.parallel import traffic
from loka_jax.train import make_optimizer
from sharded_fixtures import OPTIM, mesh, odd_dlrm, odd_state


def rows_of(mode, data=2, model=2):
  dlrm, _ = odd_dlrm()
  batch, _ = odd_state()
  rows = traffic.model_collectives(dlrm, batch, 64, data, model,
                                   parallel.ParallelConfig(collectives=mode))
  return {r.name: r for r in rows}


class HandComputedTest(absltest.TestCase):
  """Odd-vocabulary tiny DLRM, global batch 64, d = 16, 8 tables, on data:2,model:2."""

  def test_dense_parameters(self):
    _, state = odd_state()
    dense = {k: v for k, v in state.params.items() if k != "embeddings"}
    self.assertEqual(sum(x.size for x in jax.tree.leaves(dense)), 6321)

  def test_bf16(self):
    rows = rows_of("bf16")
    # Dense gradients: 6321 bf16 values over 4 devices; a ring sends 2 x 3/4 of them.
    self.assertEqual((rows["grads/dense"].payload, rows["grads/dense"].wire), (12642, 18963))
    # Table gradients over data:2: every table's rows padded to even, halved, times d:
    # (498 + 292 + 498 + 7 + 153 + 4 + 498 + 12) x 16 = 31392 values, 2 x 1/2 of them sent.
    self.assertEqual(rows["grads/tables"].elements, 31392)
    self.assertEqual((rows["grads/tables"].payload, rows["grads/tables"].wire), (62784, 62784))
    # Exchange over model:2: bags [32, 8, 16] reduce-scattered (half leaves), their gradients
    # [16, 8, 16] all-gathered (all of them go to the other device).
    self.assertEqual((rows["exchange/fwd"].payload, rows["exchange/fwd"].wire), (8192, 4096))
    self.assertEqual((rows["exchange/bwd"].payload, rows["exchange/bwd"].wire), (4096, 4096))
    self.assertNotIn("fp8_meta", rows)

  def test_fp8(self):
    rows = rows_of("fp8")
    # Dense: chunks of ceil(6321 / (4 x 128)) = 13 blocks = 1664 bytes + 13 scales (52 B):
    # an all-to-all of 4 chunks and an all-gather of one (5 x 1716), 2 x 3 chunks sent.
    self.assertEqual((rows["grads/dense"].payload, rows["grads/dense"].wire), (8580, 10296))
    # Tables: ceil(31392 / 256) = 123 blocks per chunk: 15744 + 492 = 16236 bytes; 3 x, 2 x.
    self.assertEqual((rows["grads/tables"].payload, rows["grads/tables"].wire), (48708, 32472))
    # Exchange: d = 16 is not a multiple of 128, so one scale per row of 16 values.
    self.assertEqual((rows["exchange/fwd"].payload, rows["exchange/fwd"].wire), (5120, 2560))
    self.assertEqual((rows["exchange/bwd"].payload, rows["exchange/bwd"].wire), (2560, 2560))

  def test_one_device_moves_nothing_and_data_parallel_no_exchange(self):
    self.assertEqual(rows_of("fp8", 1, 1), {})
    rows = rows_of("bf16", 4, 1)
    self.assertEqual(sorted(rows), ["grads/dense", "grads/tables"])
    # Tables replicated (model:1, no padding): every row's gradient is all-reduced,
    # (995 + 583 + 995 + 13 + 305 + 7 + 995 + 24) = 3917 rows of 16 values.
    self.assertEqual(rows["grads/tables"].elements, 3917 * 16)


class CompiledStepTest(absltest.TestCase):

  def check(self, mode):
    dlrm, _ = odd_dlrm()
    batch, state = odd_state()
    the_mesh = mesh("data:2,model:2")
    tx = make_optimizer(OPTIM)
    sharded = parallel.shard_state(state, the_mesh)
    sharded_batch = parallel.shard_batch(batch, the_mesh)
    config = parallel.ParallelConfig(collectives=mode)
    hlo = parallel.make_train_step(dlrm, tx, the_mesh, sharded, sharded_batch, config).lower(
        sharded, sharded_batch).compile().as_text()
    found = traffic.hlo_collectives(hlo)
    by_op = collections.Counter()
    for c in found:
      by_op[c["op"]] += c["payload"]
    return found, by_op, {r.name: r for r in traffic.model_collectives(dlrm, batch, 64, 2, 2,
                                                                        config)}

  def test_fp8_bytes_are_the_compiled_steps(self):
    found, by_op, rows = self.check("fp8")
    self.assertEqual({d for c in found for d in c["dtypes"]}, {"u8", "f32"})
    self.assertEqual(sum(by_op.values()), sum(r.payload for r in rows.values()))
    # The exchange's backward is the only plain all-gather of whole values besides the
    # all-reduces' second halves (one chunk each).
    chunks = sum(r.payload // 5 if r.name == "grads/dense" else r.payload // 3
                 for r in rows.values() if r.name.startswith("grads/"))
    self.assertEqual(by_op["all-gather"], rows["exchange/bwd"].payload + chunks)

  def test_fp32_bytes_are_the_compiled_steps(self):
    # (XLA:CPU widens bf16 collectives to f32, so on the CPU the fp32 step is the check of
    # the element counts; a GPU keeps bf16 on the wire.)
    _, by_op, rows = self.check("fp32")
    self.assertEqual(sum(by_op.values()), sum(r.payload for r in rows.values()))
    self.assertEqual(by_op["reduce-scatter"], rows["exchange/fwd"].payload)
    self.assertEqual(by_op["all-gather"], rows["exchange/bwd"].payload)


if __name__ == "__main__":
  absltest.main()
