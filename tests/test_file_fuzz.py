"""Fuzzing the files loka_jax writes and reads back (plan, probe report, timing table, the
MovieLens parsed cache): random truncations, bit flips and field deletions each end in the
reader's one-line error naming the file, or in a result identical to the clean one; never
another exception, never a silently different result (each file carries a digest of its
content). A data spec is the user's own file and carries no digest: a truncated one is an
error naming it. A Criteo TSV is the user's too: a damaged one is an error naming its file
and line, or reads as the clean file but for the row and column the damage touched (a flipped
digit is another valid value). Checkpoints get the same treatment in
tests/train/test_checkpoint_integrity.py."""
import copy
import io
import json
import os
import random
import tempfile
import zipfile

import numpy as np
from absl.testing import absltest, parameterized

import report_builders as hm
from loka_jax import dispatch, jsonio
from loka_jax.data import criteo, make, movielens, sources
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


# ---- data files -----------------------------------------------------------------------------
DATA_TRIALS = 30

ML_USER = ("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
           "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n3\t17\tM\twriter\t32067\n")
ML_ITEM = ("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
           "1\tToy Story\t1995\tAnimation Comedy\n2\tGoldenEye\t1995\tAction Thriller\n"
           "3\tFour Rooms\tV\tThriller\n")


def write_movielens_zip(path):
  rng = np.random.default_rng(0)
  inter = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(
      f"{rng.integers(1, 4)}\t{rng.integers(1, 4)}\t{rng.integers(1, 6)}\t{880000000 + 97 * i}\n"
      for i in range(12))
  with zipfile.ZipFile(path, "w") as z:
    for part, text in (("inter", inter), ("user", ML_USER), ("item", ML_ITEM)):
      z.writestr(f"{movielens.MEMBER_DIR}/ml-100k.{part}", text)


def member_deleted(raw, rng):
  """The npz without one of its arrays (a field deletion)."""
  out = io.BytesIO()
  with zipfile.ZipFile(io.BytesIO(raw)) as old, zipfile.ZipFile(out, "w") as new:
    names = old.namelist()
    gone = rng.choice(names)
    for name in names:
      if name != gone:
        new.writestr(old.getinfo(name), old.read(name))
  return out.getvalue()


def value_changed(raw, rng):
  """The npz written again, valid, with one element of one numeric array changed."""
  with np.load(io.BytesIO(raw)) as z:
    arrays = {k: z[k] for k in z.files}
  key = rng.choice([k for k, v in arrays.items() if v.size and v.dtype.kind in "if"])
  changed = arrays[key].copy().reshape(-1)
  changed[rng.randrange(changed.size)] += 1
  arrays[key] = changed.reshape(arrays[key].shape)
  out = io.BytesIO()
  np.savez(out, **arrays)
  return out.getvalue()


def criteo_rows(n, seed):
  """Lines of 40 tab-separated fields: labels, integers (some negative or empty), hex tokens
  (some empty)."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-5, 5000))) for _ in range(13)]
    cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}"
            for _ in range(26)]
    rows.append("\t".join([str(int(rng.integers(0, 2)))] + ints + cats))
  return ("\n".join(rows) + "\n").encode()


def read_criteo(path):
  """Every row of the file in file order as (label, dense, ids), through the source."""
  source = criteo.CriteoSource(path, config={"vocab_size": 1000, "shuffle_window": 1},
                               num_eval=1)
  train = source.train_batch(0, source.num_train_examples())
  (last,) = list(source.eval_batches(1))
  rows = []
  for batch in (train, last):
    for i in range(batch["label"].shape[0]):
      rows.append((float(batch["label"][i]), batch["dense"][i].tolist(),
                   batch["sparse_ids"][i, :, 0].tolist()))
  return rows


def row_without(row, column):
  """A (label, dense, ids) row with Criteo column `column` (0: label, 1-13, 14-39) left out."""
  label, dense, ids = row
  if column == 0:
    return (None, dense, ids)
  if column <= criteo.NUM_INT:
    return (label, dense[:column - 1] + dense[column:], ids)
  j = column - 1 - criteo.NUM_INT
  return (label, dense, ids[:j] + ids[j + 1:])


def where_in(raw, offset):
  """(0-based line, 0-based column) of byte `offset` of a TSV."""
  line = raw.count(b"\n", 0, offset)
  start = raw.rfind(b"\n", 0, offset) + 1
  return line, raw.count(b"\t", start, offset)


def tsv_field_deleted(raw, rng):
  """The TSV with one field (and its tab) of one line taken out; also its line and column."""
  lines = raw.split(b"\n")[:-1]
  i = rng.randrange(len(lines))
  fields = lines[i].split(b"\t")
  del fields[rng.randrange(len(fields))]
  lines[i] = b"\t".join(fields)
  return b"\n".join(lines) + b"\n", i


class DataFileFuzzTest(parameterized.TestCase):

  def assertOneLineNaming(self, error, path, trial):
    message = str(error)
    self.assertIn(path, message, (trial, message))
    self.assertNotIn("\n", message.strip(), (trial, message))
    return message

  @parameterized.parameters("truncation", "bit_flip", "field_deletion", "value_change")
  def test_a_damaged_movielens_cache_is_a_one_line_error_naming_it_or_reads_as_the_clean_one(
      self, mutation):
    folder = tempfile.mkdtemp(prefix=f"loka_fuzz_movielens_{mutation}_")
    source, cache_dir = os.path.join(folder, "ml.zip"), os.path.join(folder, "cache")
    write_movielens_zip(source)
    clean = movielens.load_parsed(source, cache_dir)
    (name,) = [n for n in os.listdir(cache_dir) if n.endswith(".npz")]
    path = os.path.join(cache_dir, name)
    with open(path, "rb") as f:
      clean_raw = f.read()
    mutate = {"truncation": truncated, "bit_flip": bit_flipped, "field_deletion": member_deleted,
              "value_change": value_changed}[mutation]
    rng = random.Random(f"movielens/{mutation}")
    errors = 0
    for trial in range(DATA_TRIALS):
      with open(path, "wb") as f:
        f.write(mutate(clean_raw, rng))
      try:
        got = movielens.load_parsed(source, cache_dir)
      except sources.DataFileError as e:
        message = self.assertOneLineNaming(e, path, trial)
        self.assertIn(f"delete it: it is rebuilt from {source}", message)
        errors += 1
        continue
      self.assertEqual(sorted(got), sorted(clean), trial)
      for key in clean:
        np.testing.assert_array_equal(got[key], clean[key], f"trial {trial}: {key}")
    # A flip in a byte the zip reader ignores (a timestamp, an attribute) reads the same; a
    # flip in a name, a header or the data is caught, and so is every other mutation.
    self.assertGreater(errors, DATA_TRIALS // 2)
    if mutation != "bit_flip":
      self.assertEqual(errors, DATA_TRIALS)

  @parameterized.parameters("truncation", "bit_flip", "field_deletion")
  def test_a_damaged_criteo_file_is_an_error_naming_file_and_line_or_differs_where_damaged(
      self, mutation):
    folder = tempfile.mkdtemp(prefix=f"loka_fuzz_criteo_{mutation}_")
    path = os.path.join(folder, "day_0.tsv")
    clean_raw = criteo_rows(8, seed=3)
    with open(path, "wb") as f:
      f.write(clean_raw)
    clean = read_criteo(path)
    rng = random.Random(f"criteo/{mutation}")
    outcomes = {"error": 0, "read": 0}
    for trial in range(DATA_TRIALS):
      if mutation == "field_deletion":
        damaged, line = tsv_field_deleted(clean_raw, rng)
        column = None
      else:
        damaged = (truncated if mutation == "truncation" else bit_flipped)(clean_raw, rng)
        offset = len(damaged) if mutation == "truncation" else next(
            i for i, (a, b) in enumerate(zip(clean_raw, damaged)) if a != b)
        line, column = where_in(clean_raw, offset)
      with open(path, "wb") as f:
        f.write(damaged)
      try:
        got = read_criteo(path)
      except sources.DataFileError as e:
        message = self.assertOneLineNaming(e, path, trial)
        # The line at fault is the damaged one (a newline flipped away joins it to the next).
        self.assertRegex(message, rf"{path}, line {line + 1}\b", trial)
        outcomes["error"] += 1
        continue
      except ValueError as e:   # a file cut down to one line: no held-out line and training set
        self.assertEqual(mutation, "truncation", trial)
        self.assertLessEqual(line, 1, trial)
        self.assertOneLineNaming(e, path, trial)
        outcomes["error"] += 1
        continue
      self.assertNotEqual(mutation, "field_deletion", f"trial {trial}: a row lost a field")
      outcomes["read"] += 1
      # Rows before the damaged line are the clean ones; the damaged line differs at most in
      # its damaged column; a truncated file ends there, a flipped one goes on as the clean one.
      expected_len = len(clean) if mutation == "bit_flip" else line + (column > 0 or
                                                                       damaged[-1:] != b"\n")
      self.assertLen(got, expected_len, trial)
      for i, (row, want) in enumerate(zip(got, clean)):
        if i == line:
          self.assertEqual(row_without(row, column), row_without(want, column), (trial, i))
        else:
          self.assertEqual(row, want, (trial, i))
    self.assertEqual(sum(outcomes.values()), DATA_TRIALS)
    if mutation == "field_deletion":
      self.assertEqual(outcomes["error"], DATA_TRIALS)
    else:
      self.assertGreater(outcomes["read"], 0)   # different valid values occur, and read


if __name__ == "__main__":
  absltest.main()
