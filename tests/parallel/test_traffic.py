"""The bytes model of the sharded step (traffic.py) against hand-computed bytes of a tiny
tower and against the collectives of the compiled step."""
import collections
import tempfile

import jax
import ml_dtypes
import numpy as np
from absl.testing import absltest
from jax._src.lib import xla_client

from cli_helpers import run_module
from loka_jax import parallel
from loka_jax.parallel import traffic
from sharded_fixtures import odd_dlrm, odd_state, odd_step


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

  def test_a_batch_that_does_not_split_over_the_mesh_is_refused(self):
    dlrm, _ = odd_dlrm()
    batch, _ = odd_state()
    # 66 splits over data:2 but not over the 4 devices the step splits the batch over.
    for data, model in ((2, 2), (4, 1)):
      with self.assertRaisesRegex(ValueError, f"batch size 66 .* mesh data:{data},model:{model}"):
        traffic.model_collectives(dlrm, batch, 66, data, model)


class CompiledStepTest(absltest.TestCase):

  def check(self, mode):
    dlrm, _ = odd_dlrm()
    batch, _ = odd_state()
    sharded, sharded_batch, step = odd_step(mode)   # test_padding trains the fp32 one
    config = parallel.ParallelConfig(collectives=mode)
    hlo = step.lower(sharded, sharded_batch).compile().as_text()
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



# Types that are no arrays: no operand of a collective has them.
NOT_ARRAYS = {"PRIMITIVE_TYPE_INVALID", "TUPLE", "OPAQUE_TYPE", "TOKEN", "BUFFER"}


def expected_bits(xla_name):
  """Bits of a value of an XLA primitive type by numpy / ml_dtypes (None: no type known
  there)."""
  if xla_name == "PRED":
    return 8 * np.dtype(bool).itemsize
  kind, rest = xla_name[0], xla_name[1:].lower()
  if xla_name == "BF16":
    return ml_dtypes.finfo(ml_dtypes.bfloat16).bits
  if kind == "C":
    return 8 * np.dtype(f"complex{rest}").itemsize
  if kind in "SU":
    name = ("" if kind == "S" else "u") + f"int{rest}"
    found = getattr(np, name, None) or getattr(ml_dtypes, name, None)
    return None if found is None else ml_dtypes.iinfo(found).bits
  if rest.isdigit():
    return ml_dtypes.finfo(np.dtype(f"float{rest}")).bits
  bits, fmt = rest.split("e", 1)
  found = getattr(ml_dtypes, f"float{bits}_e{fmt}", None)
  return None if found is None else ml_dtypes.finfo(found).bits


def hlo(*lines, header="HloModule m, num_partitions=4"):
  return "\n".join([header, *lines])


class HloWidthsAndGroupsTest(absltest.TestCase):
  """`hlo_collectives` on hand-written HLO lines: every primitive type's width, packed
  sub-byte layouts, every replica-group form and group mode."""

  def test_every_xla_primitive_type_has_its_width(self):
    names = [n for n in dir(xla_client.PrimitiveType) if n.isupper() and n not in NOT_ARRAYS]
    self.assertGreater(len(names), 20)
    checked = 0
    for name in names:
      width = traffic.dtype_bits(name.lower())   # every array type has one
      expected = expected_bits(name)
      if expected is not None:
        self.assertEqual(width, expected, name)
        checked += 1
    self.assertGreaterEqual(checked, len(names) - 2)
    with self.assertRaisesRegex(ValueError, "'q7x'"):
      traffic.hlo_collectives(hlo("  %a = q7x[4]{0} all-reduce(%p), channel_id=1, "
                                  "replica_groups={{0,1,2,3}}, use_global_device_ids=true"))

  def test_payload_bytes_of_wide_narrow_and_packed_types(self):
    flat = "channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true"
    found = traffic.hlo_collectives(hlo(
        f"  %a = s16[8]{{0}} all-reduce(%p), {flat}, to_apply=%r",
        f"  %b = u64[2,3]{{1,0}} all-reduce(%p), {flat}, to_apply=%r",
        f"  %c = f8e5m2fnuz[16]{{0}} all-gather(%p), {flat}, dimensions={{0}}",
        f"  %d = s4[64]{{0:E(4)}} all-reduce(%p), {flat}, to_apply=%r",
        f"  %e = s4[64]{{0}} all-reduce(%p), {flat}, to_apply=%r",
        f"  %f = (c64[4]{{0}}, pred[3]{{0}}) all-to-all(%p, %q), {flat}",
        f"  %g = f4e2m1fn[32]{{0:E(4)}} reduce-scatter(%p), {flat}, dimensions={{0}}"))
    self.assertEqual([c["payload"] for c in found], [16, 48, 8, 32, 64, 35, 32])
    self.assertEqual({c["group"] for c in found}, {2})

  def test_group_sizes(self):
    line = lambda groups, extra="": (f"  %a = f32[8]{{0}} all-reduce(%p), {extra}"
                                     f"replica_groups={groups}, to_apply=%r")
    cases = [  # (header, line, devices in the group)
        # Empty groups: every device of the group mode's kind.
        ("HloModule m, num_partitions=4",
         line("{}", "channel_id=1, use_global_device_ids=true, "), 4),
        ("HloModule m, replica_count=2, num_partitions=4",
         line("{}", "channel_id=1, use_global_device_ids=true, "), 8),
        ("HloModule m, replica_count=2, num_partitions=4", line("{}"), 2),     # replicas
        ("HloModule m, replica_count=2, num_partitions=4",
         line("{}", "channel_id=1, "), 8),                     # replicas, each with partitions
        ("HloModule m, replica_count=2, num_partitions=4",
         "  %a = f32[8]{0} all-to-all(%p), channel_id=1, replica_groups={}", 4),  # partitions
        ("HloModule m", line("{}"), 1),
        # Listed and iota groups.
        ("HloModule m, num_partitions=4",
         line("{{0,2},{1,3}}", "channel_id=1, use_global_device_ids=true, "), 2),
        ("HloModule m, num_partitions=8",
         line("[2,4]<=[8]", "channel_id=1, use_global_device_ids=true, "), 4),
        ("HloModule m, num_partitions=8",
         line("[4,2]<=[2,4]T(1,0)", "channel_id=1, use_global_device_ids=true, "), 2),
        ("HloModule m, replica_count=2, num_partitions=4", line("{{0,1}}", "channel_id=1, "), 8),
        # Mesh groups: the product of the named axes' sizes, a sub-axis by its own size.
        ("HloModule m, num_partitions=4", line("mesh['data'=2,'model'=2] {'model'}",
                                               "channel_id=1, use_global_device_ids=true, "), 2),
        ("HloModule m, num_partitions=4", line("mesh['data'=2,'model'=2] {'data','model'}",
                                               "channel_id=1, use_global_device_ids=true, "), 4),
        ("HloModule m, num_partitions=8", line("mesh['x'=4,'y'=2] {'x':(1)2,'y'}",
                                               "channel_id=1, use_global_device_ids=true, "), 4),
        ("HloModule m, num_partitions=4",
         line("mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'x'}",
              "channel_id=1, use_global_device_ids=true, "), 2),
        ("HloModule m, num_partitions=8", line("mesh[x=8] {x}",
                                               "channel_id=1, use_global_device_ids=true, "), 8),
        ("HloModule m, replica_count=2, num_partitions=4",
         line("mesh['r'=2] {'r'}", "channel_id=1, "), 8),      # replicas, each with partitions
    ]
    for header, text, group in cases:
      [found] = traffic.hlo_collectives(hlo(text, header=header))
      self.assertEqual(found["group"], group, f"{header}\n{text}")
      # An all-gather's payload is one device's piece of its output (32 bytes).
      if "all-reduce" in text:
        [gathered] = traffic.hlo_collectives(hlo(text.replace("all-reduce", "all-gather"),
                                                 header=header))
        self.assertEqual(gathered["payload"], 32 // group)

  def test_a_mesh_group_naming_no_axis_of_its_mesh_is_refused(self):
    with self.assertRaisesRegex(ValueError, "'z' is no axis of mesh"):
      traffic.hlo_collectives(hlo("  %a = f32[8]{0} all-reduce(%p), channel_id=1, "
                                  "replica_groups=mesh['x'=2,'y'=2] {'z'}, "
                                  "use_global_device_ids=true, to_apply=%r"))


class BytesCommandTest(absltest.TestCase):
  """`python -m experiments.parallel_bytes` on bad settings: one line naming the field."""

  def test_bad_settings_are_one_line_errors(self):
    with tempfile.TemporaryDirectory() as tmp:
      cases = [
          (["--config.output=" + f"{tmp}/missing/bytes.json"],
           f"--config.output={tmp}/missing/bytes.json: no folder {tmp}/missing"),
          (["--config.run.precision=loka"], "--config.run.precision=loka: this config has no "
                                            "run.plan"),
          (["--config.run.model=dlrm", "--config.run.presets=tiny",
            "--config.parallel.meshes=data:2,model:2", "--config.parallel.batch_size=66"],
           "batch size 66 does not split over the 4 devices of mesh data:2,model:2"),
      ]
      for args, said in cases:
        done = run_module("experiments.parallel_bytes", *args)
        self.assertEqual(done.returncode, 1, done.stderr[-2000:])
        self.assertNotIn("Traceback", done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        self.assertLen(lines, 1, done.stderr[-2000:])
        self.assertIn(said, lines[0])


if __name__ == "__main__":
  absltest.main()
