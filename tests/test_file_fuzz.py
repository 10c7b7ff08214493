"""Fuzzing the JSON files loka_jax writes and reads back (plan, probe report, timing table):
random truncations, bit flips and field deletions each end in the reader's one-line error
naming the file, or in a result identical to the clean one; never another exception, never a
silently different result (each file carries the sha256 of its content). A data spec is the
user's own file and carries no digest: a truncated one is an error naming it. Checkpoints get
the same treatment in tests/train/test_checkpoint_integrity.py."""
import copy
import json
import os
import random
import tempfile

from absl.testing import absltest, parameterized

import report_builders as hm
from loka_jax import dispatch, jsonio
from loka_jax.data import make, sources
from loka_jax.plan.file import PlanFileError, read_plan, save_plan
from loka_jax.probe import timing_table
from loka_jax.probe.report import ProbeReportError, load_report, save_report
from train_toys import TOY_FEATURES

TRIALS = 40   # per mutation kind and file kind; seeded, so a failure reproduces


def write_plan(path):
  plan = dispatch.Plan({
      "schema": dispatch.SCHEMA, "model": "toy",
      "sites": {"mlp/dense_0": {"fwd": {"kernel": "xla_fp8_rowwise", "reason": "test"},
                                "grad_lhs": {"kernel": "xla_bf16", "reason": "test"},
                                "grad_rhs": {"kernel": "xla_bf16", "reason": "test"}}},
      "rules": [], "default": None})
  save_plan(plan, path)


def write_report(path):
  kernels = {"xla_fp8_rowwise": hm.entry(sqnr=28.0, speedup=(1.2, 1.3, 1.4))}
  save_report(hm.report({"mlp/dense_0": hm.site(hm.same_passes(kernels))}), path)


def write_table(path):
  timing_table.save_table(hm.dense_table("NVIDIA H200", 256, 64, 32,
                                         {"xla_fp8_rowwise": {"fwd": 9.0, "grad_lhs": 9.0,
                                                              "grad_rhs": 9.0}}), path)


def write_spec(path):
  with open(path, "w") as f:
    json.dump({"base_ctr": 0.2, "zipf_exponent": 1.1, "teacher_hidden": 16}, f)


def read_spec(path):
  return make.make_source("synthetic", features=TOY_FEATURES, spec=path).spec


# name: (write, read, the reader's error classes, the value compared with the clean read)
KINDS = {
    "plan": (write_plan, read_plan, (PlanFileError,), lambda p: p.to_dict()),
    "probe_report": (write_report, load_report, (ProbeReportError,), lambda r: r),
    "timing_table": (write_table, timing_table.load_table, (timing_table.TimingTableError,),
                     lambda t: t),
    "data_spec": (write_spec, read_spec, (sources.DataFileError, FileNotFoundError),
                  lambda s: sources.config_to_dict(s)),
}


def truncated(raw, rng):
  return raw[:rng.randrange(len(raw))]


def bit_flipped(raw, rng):
  out = bytearray(raw)
  i = rng.randrange(len(out))
  out[i] ^= 1 << rng.randrange(8)
  return bytes(out)


def field_deleted(raw, rng):
  data = json.loads(raw)
  paths = []

  def walk(node, path):
    if isinstance(node, dict):
      for k, v in node.items():
        paths.append(path + (k,))
        walk(v, path + (k,))
  walk(data, ())
  path = rng.choice(paths)
  node = data
  for k in path[:-1]:
    node = node[k]
  del node[path[-1]]
  return json.dumps(data).encode()


MUTATIONS = {"truncation": truncated, "bit_flip": bit_flipped, "field_deletion": field_deleted}


class FileFuzzTest(parameterized.TestCase):

  @parameterized.parameters(
      *[(k, m) for k in KINDS for m in MUTATIONS if k != "data_spec" or m == "truncation"])
  def test_a_damaged_file_is_a_one_line_error_naming_it_or_reads_as_the_clean_one(
      self, kind, mutation):
    write, read, errors, value = KINDS[kind]
    folder = tempfile.mkdtemp(prefix=f"loka_fuzz_{kind}_")
    path = os.path.join(folder, f"{kind}.json")
    write(path)
    with open(path, "rb") as f:
      clean_raw = f.read()
    clean = copy.deepcopy(value(read(path)))
    rng = random.Random(f"{kind}/{mutation}")
    outcomes = {"error": 0, "same": 0}
    for trial in range(TRIALS):
      damaged = MUTATIONS[mutation](clean_raw, rng)
      with open(path, "wb") as f:
        f.write(damaged)
      try:
        got = value(read(path))
      except errors as e:
        message = str(e)
        self.assertIn(path, message, (trial, message))
        self.assertNotIn("\n", message.strip(), (trial, message))
        outcomes["error"] += 1
        continue
      self.assertTrue(jsonio.same_json(got, clean),
                      f"trial {trial}: a damaged {kind} read as a different value")
      outcomes["same"] += 1
    self.assertEqual(sum(outcomes.values()), TRIALS)
    # Deleting the digest itself, or a field whose absence means its default, reads as the
    # clean file; every other deletion and flip is caught.
    self.assertGreater(outcomes["error"], TRIALS // 2)


if __name__ == "__main__":
  absltest.main()
