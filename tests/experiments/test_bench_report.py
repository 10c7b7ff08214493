"""A report over committed rows (`experiments.report rows`): rows merged from several files,
a later measurement replacing an earlier one, and the at-a-glance table of the targets."""
import json
import os

import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from bench_rows import speed, tempdir
from experiments.bench import collect, tables, targets


def _row(model, preset, variant, train, infer, rng, device="NVIDIA H200"):
  return {"suite": "models", "model": model, "preset": preset, "variant": variant,
          "device": device, "batch_size": 4096, "train": speed(train, rng),
          "infer": speed(infer, rng)}


def _quality(arm, seed, logloss, device="NVIDIA H200"):
  return {"suite": "quality", "data": "synthetic", "model": "dlrm", "preset": "small",
          "arm": arm, "seed": seed, "device": device, "logloss": logloss, "ne": 0.9,
          "auc": 0.7, "eval_fingerprint": "same"}


def _write(directory, name, rows):
  path = os.path.join(directory, name)
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return path


class ReadRowsTest(absltest.TestCase):

  def test_a_later_file_replaces_the_rows_it_measures_again_and_keeps_the_rest(self):
    rng = np.random.default_rng(1)
    d = tempdir(self)
    first = _write(d, "first.jsonl", [_row("dlrm", "small", "bf16", 1.0, 1.0, rng),
                                      _row("dlrm", "small", "loka", 0.9, 1.0, rng),
                                      _row("dlrm", "small", "bf16_mods", 1.0, 1.0, rng),
                                      _quality("bf16", 0, 0.50), _quality("bf16", 1, 0.51)])
    second = _write(d, "second.jsonl", [_row("dlrm", "small", "loka", 1.2, 1.3, rng),
                                        _quality("bf16", 1, 0.52)])
    rows = collect.read_rows([first, second])
    self.assertLen(rows, 5)
    loka = [r for r in rows if r.get("variant") == "loka"]
    self.assertLen(loka, 1)
    self.assertAlmostEqual(loka[0]["train"]["speedup"], 1.2, delta=0.05)
    seeds = sorted((r["seed"], r["logloss"]) for r in rows if r["suite"] == "quality")
    self.assertEqual(seeds, [(0, 0.50), (1, 0.52)])
    # Oldest last: the first file's measurement wins.
    again = collect.read_rows([second, first])
    self.assertAlmostEqual([r for r in again if r.get("variant") == "loka"][0]["train"]
                           ["speedup"], 0.9, delta=0.05)

  def test_device_filter(self):
    rng = np.random.default_rng(2)
    d = tempdir(self)
    path = _write(d, "rows.jsonl", [_row("dlrm", "small", "bf16", 1.0, 1.0, rng),
                                    _row("dlrm", "small", "bf16", 1.0, 1.0, rng,
                                         device="NVIDIA H100 80GB HBM3")])
    self.assertLen(collect.read_rows([path]), 2)     # the device is part of the key
    only = collect.read_rows([path], device="NVIDIA H100 80GB HBM3")
    self.assertEqual(collect.devices(only), ["NVIDIA H100 80GB HBM3"])

  def test_unreadable_files_are_errors_naming_the_place(self):
    d = tempdir(self)
    with self.assertRaisesRegex(collect.RowsError, "does not exist"):
      collect.read_rows([os.path.join(d, "missing.jsonl")])
    cut = os.path.join(d, "cut.jsonl")
    with open(cut, "w") as f:
      f.write(json.dumps(_quality("bf16", 0, 0.5)) + "\n" + '{"suite": "qual')
    with self.assertRaisesRegex(collect.RowsError, r"cut.jsonl:2 is not a JSON row"):
      collect.read_rows([cut])
    other = _write(d, "other.jsonl", [{"kernel": "xla_bf16", "median_us": 3.0}])
    with self.assertRaisesRegex(collect.RowsError, r"other.jsonl:1 is not a benchmark row"):
      collect.read_rows([other])


  def test_a_runs_own_results_file_skips_the_torn_line_a_report_refuses(self):
    from experiments.bench import quality, results
    d = tempdir(self)
    path = os.path.join(d, "quality.jsonl")
    with open(path, "w") as f:
      f.write(json.dumps(_quality("bf16", 0, 0.5)) + "\n" + '{"suite": "qual')
    own = results.ResultsFile(path, quality.KEY_FIELDS)   # the bench measures it again
    self.assertLen(list(own.rows()), 1)
    with self.assertRaisesRegex(collect.RowsError, "quality.jsonl:2"):
      collect.read_rows([path])


class GlanceTableTest(absltest.TestCase):

  def test_one_line_per_subject_with_its_misses(self):
    rng = np.random.default_rng(3)
    rows = [_row("dlrm", "small", v, t, i, rng)
            for v, t, i in (("bf16", 1.0, 1.0), ("bf16_mods", 1.2, 1.2),
                            ("flax_fp8_delayed", 1.1, 1.1), ("loka", 1.0, 1.5))]
    rows += [_row("dhen", "large", "bf16", 1.0, 1.0, rng)]
    rows += [_quality(a, s, 0.5 + 0.001 * s + (0.0001 if a == "loka" else 0))
             for a, seeds in (("bf16", (0, 1, 2)), ("bf16_mods", (0,)), ("loka", (0,)))
             for s in seeds]
    text = tables.glance_table(targets.check_all(rows))
    header = [h.strip() for h in text.splitlines()[0].strip("| ").split(" | ")]
    lines = {}
    for line in text.splitlines()[2:]:
      cells = [c.strip() for c in line.strip("| ").split(" | ")]
      lines[cells[0]] = dict(zip(header, cells))
    self.assertEqual(sorted(lines), ["dhen/large", "dlrm/small"])
    dlrm = lines["dlrm/small"]
    # LoKA trains at 1.0 / 1.2 of bf16+Mods: a miss, said in its cell and in the last column.
    train, verdict = dlrm["train vs bf16+Mods"].split()
    self.assertAlmostEqual(float(train.rstrip("x")), 1 / 1.2, delta=0.02)
    self.assertEqual(verdict, "MISSED")
    self.assertIn("loka_not_slower_than_bf16_mods (train)", dlrm["missed"])
    self.assertAlmostEqual(float(dlrm["infer vs bf16+Mods"].rstrip("x")), 1.25, delta=0.02)
    self.assertNotIn("(infer)", dlrm["missed"])                     # 1.5x over the peer's 1.1x
    # One paired seed, 0.5001 against 0.5 (+0.02%): the paired verdict, unresolved.
    self.assertEqual(dlrm["quality vs bf16+Mods (paired)"], "unresolved (+0.020%)")
    self.assertEqual(dlrm["quality vs bf16 (paired)"], "unresolved (+0.020%)")
    self.assertNotIn("quality", dlrm["missed"])   # unresolved is no miss
    self.assertEqual(lines["dhen/large"]["missed"], "no LoKA row yet")


class CliTest(absltest.TestCase):

  def _run(self, *args):
    return run_module("experiments.report", "rows", *args, timeout=120)

  def test_writes_the_report_targets_and_plots_and_refuses_mixed_cards(self):
    rng = np.random.default_rng(4)
    d = tempdir(self)
    h200 = _write(d, "h200.jsonl", [_row("wukong", "small", v, t, t, rng)
                                    for v, t in (("bf16", 1.0), ("bf16_mods", 1.1),
                                                 ("loka", 1.3))])
    h100 = _write(d, "h100.jsonl", [_row("wukong", "small", "bf16", 1.0, 1.0, rng,
                                         device="NVIDIA H100 80GB HBM3")])
    out = os.path.join(d, "out")
    mixed = self._run(f"--rows={h200},{h100}", f"--out={out}")
    self.assertNotEqual(mixed.returncode, 0)
    self.assertIn("2 device kinds", mixed.stderr + mixed.stdout)
    done = self._run(f"--rows={h200},{h100}", f"--out={out}", "--device=NVIDIA H200")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("## Targets at a glance", done.stdout)
    self.assertIn("3 rows from 2 files", done.stdout)
    with open(os.path.join(out, "targets.json")) as f:
      verdicts = json.load(f)
    over_mods = [v for v in verdicts if v["target"] == "loka_not_slower_than_bf16_mods"
                 and v["mode"] == "train"]
    self.assertAlmostEqual(over_mods[0]["value"], 1.3 / 1.1, delta=0.03)
    self.assertTrue(os.path.exists(os.path.join(out, "plots", "speedup_models.png")))
    broken = self._run(f"--rows={os.path.join(d, 'nope.jsonl')}", f"--out={out}")
    self.assertNotEqual(broken.returncode, 0)
    self.assertIn("nope.jsonl does not exist", broken.stderr + broken.stdout)


if __name__ == "__main__":
  absltest.main()
