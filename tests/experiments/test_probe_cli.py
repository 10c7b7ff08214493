"""`python -m experiments.probe` end to end on a tiny Wukong, then resumed with a timing table;
`experiments.timing_cache compare`, `merge` and `table` on small caches."""
import json
import os
import tempfile

import chex
from absl.testing import absltest

from cli_helpers import run_module

from loka_jax.probe import timing_table
from loka_jax.probe import evaluate, kernel_timing
from loka_jax.probe import report as report_lib

SITES = "layer_0/fmb/(fm_proj|optimized_fm|mlp/dense_0)"
ARGS = ("--config.run.model=wukong", "--config.run.preset=tiny", "--config.run.steps=4",
        "--config.run.batch_size=64", "--config.run.num_eval=256", "--config.stats.cadence=2",
        "--config.evaluate.samples=4",
        "--config.evaluate.kernels=xla_bf16,xla_fp8_tensorwise,xla_fp8_rowwise",
        f"--config.evaluate.sites={SITES}",
        # conftest's cache of this run, shared with the probe notebook's (same tiny shapes)
        f"--config.compilation_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}")


def run_cli(*args, timeout=300, module="experiments.probe"):
  return run_module(module, *args, timeout=timeout)


def _write_table(path):
  """A GPU-like timing table for the dense product only: the other sites get estimates."""
  entries = []
  for kernel, us in (("xla_bf16", 30.0), ("xla_fp8_rowwise", 20.0)):
    for p, (spec, lhs, rhs) in {"fwd": ("mk,kn->mn", [64, 36], [36, 32]),
                                "grad_lhs": ("mn,kn->mk", [64, 32], [36, 32]),
                                "grad_rhs": ("mk,mn->kn", [64, 36], [64, 32])}.items():
      entries.append({"kernel": kernel, "pass": p, "spec": spec, "lhs_shape": lhs,
                      "rhs_shape": rhs, "dtype": "bfloat16", "median_us": us,
                      "ci_us": [0.95 * us, 1.05 * us], "backend": "cublaslt_fp8",
                      "repeats": 20, "jax": "0.11.2", "date": "2026-11-26"})
  timing_table.update_file(path, "NVIDIA H100 80GB HBM3", entries)


class ProbeCliTest(chex.TestCase):

  def test_tiny_wukong_end_to_end_resumed_then_with_a_timing_table(self):
    workdir = tempfile.mkdtemp(prefix="loka_probe_cli_")
    # A budget that runs out right after training: exit 3, a partial report saying so.
    partial = run_cli(*ARGS, f"--workdir={workdir}", "--config.budget_s=0.001")
    self.assertEqual(partial.returncode, 3, partial.stderr[-3000:] + partial.stdout[-2000:])
    self.assertIn("INCOMPLETE", partial.stdout)
    report = report_lib.load_report(os.path.join(workdir, "probe_report.json"))
    self.assertFalse(report["complete"])
    self.assertEqual(len(report["pending"]), 3)
    # The same command without a budget resumes: no training left, three sites evaluated.
    result = run_cli(*ARGS, f"--workdir={workdir}")
    self.assertEqual(result.returncode, 0, result.stderr[-3000:] + result.stdout[-2000:])
    report = report_lib.load_report(os.path.join(workdir, "probe_report.json"))
    self.assertEqual((report["model"], report["preset"], report["timing_valid"]),
                     ("wukong", "tiny", False))
    # Untimed (CPU) runs fall back on a committed timing table when the checkout has one.
    committed = timing_table.committed_tables()
    self.assertEqual(report["timing_source"]["kind"], "table" if committed else "none")
    self.assertEqual(list(report["sites"]), ["layer_0/fmb/fm_proj", "layer_0/fmb/optimized_fm",
                                             "layer_0/fmb/mlp/dense_0"])
    self.assertEqual(report["overhead"]["observations"], 2)   # steps 2 and 4
    site = report["sites"]["layer_0/fmb/mlp/dense_0"]
    self.assertEqual(site["shapes"], {"lhs": [64, 36], "rhs": [36, 32], "out": [64, 32]})
    for p in ("fwd", "grad_lhs", "grad_rhs"):
      fp8 = site["passes"][p]["xla_fp8_rowwise"]["sqnr_db"]
      bf16 = site["passes"][p]["xla_bf16"]["sqnr_db"]
      self.assertTrue(15.0 < fp8[0] <= fp8[2] < 45.0, (p, fp8))
      self.assertGreater(bf16[0], fp8[2])
    self.assertIn("histogram", site["stats"]["lhs"])
    for name in ("probe_report.md", "plots/heatmap_error.png",
                 "plots/sites/layer_0_fmb_mlp_dense_0.png", "probe_eval.jsonl"):
      self.assertTrue(os.path.exists(os.path.join(workdir, name)), name)
    self.assertIn("layer_0/fmb/optimized_fm", result.stdout)
    self.assertIn("probe overhead:", result.stdout)
    self.assertEqual(result.stdout.count("[probe] evaluated"), 3)

    # Again, with a committed-style timing table and one more candidate, and one site's cached
    # evaluations made by an older evaluator (their key without its version): training is
    # reused; the other sites evaluate only the new candidate (their other candidates come
    # from the cache, unchanged), while every candidate of that site is made again: its cached
    # rows are not what this evaluator measures. The speedups come from the table (nearest
    # shape, estimated) and the report says so.
    older = "layer_0/fmb/mlp/dense_0"
    cache = os.path.join(workdir, "probe_eval.jsonl")
    rows = [json.loads(line) for line in open(cache)]
    with open(cache, "w") as f:
      for row in rows:
        if row["key"]["site"] == older:
          row["key"].pop("evaluator")
        f.write(json.dumps(row) + "\n")
    table = os.path.join(tempfile.mkdtemp(), "NVIDIA_H100_80GB_HBM3.json")
    _write_table(table)
    more = [a if not a.startswith("--config.evaluate.kernels=")
            else a + ",xla_fp8_rowwise_precise" for a in ARGS]
    again = run_cli(*more, f"--workdir={workdir}", f"--config.timing.table={table}",
                    "--config.plots.enabled=false")
    self.assertEqual(again.returncode, 0, again.stderr[-3000:])
    self.assertEqual(again.stdout.count("[probe] evaluated"), 3, again.stdout[-2000:])
    self.assertEqual(again.stdout.count("(1 new candidates, 3 from the cache)"), 2,
                     again.stdout[-2000:])
    made_again = [line for line in again.stdout.splitlines()
                  if line.startswith("[probe] evaluated") and line.split()[3] == older]
    self.assertLen(made_again, 1, again.stdout[-2000:])
    self.assertNotIn("from the cache", made_again[0])
    resumed = report_lib.load_report(os.path.join(workdir, "probe_report.json"))
    self.assertFalse(resumed["timing_valid"])
    self.assertEqual(resumed["timing_source"]["kind"], "table")
    dense = resumed["sites"]["layer_0/fmb/mlp/dense_0"]["passes"]["fwd"]["xla_fp8_rowwise"]
    self.assertEqual(dense["timing"], "table")
    chex.assert_trees_all_close(dense["speedup"], [30 * 0.95 / (20 * 1.05), 1.5,
                                                   30 * 1.05 / (20 * 0.95)])
    fm = resumed["sites"]["layer_0/fmb/fm_proj"]["passes"]["fwd"]["xla_fp8_rowwise"]
    self.assertEqual(fm["timing"], "estimated")
    for name, site in resumed["sites"].items():
      for p, entries in site["passes"].items():
        self.assertEqual(list(entries), ["xla_bf16", "xla_fp8_rowwise",
                                         "xla_fp8_rowwise_precise", "xla_fp8_tensorwise"])
        if name != older:
          self.assertEqual(entries["xla_fp8_rowwise"]["sqnr_db"],
                           report["sites"][name]["passes"][p]["xla_fp8_rowwise"]["sqnr_db"])
    self.assertEqual(resumed["evaluation"]["evaluator"], evaluate.EVALUATOR_VERSION)

  def test_bad_arguments_fail_with_a_clear_message(self):
    workdir = tempfile.mkdtemp(prefix="loka_probe_cli_bad_")
    result = run_cli("--config.run.steps=1", "--config.run.batch_size=8",
                     "--config.evaluate.kernels=xla_fp9", f"--workdir={workdir}",
                     "--config.compilation_cache=")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("unknown kernel(s) ['xla_fp9']", result.stderr)
    result = run_cli("--config.stats.cadence=0", f"--workdir={workdir}")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("cadence must be >= 1", result.stderr)
    result = run_cli("--config.timing.only=true")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("--config.timing.only needs --config.timing.cache", result.stderr)
    result = run_cli("--config.timing.only=true", f"--config.timing.cache={workdir}")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("timing kernels needs a GPU", result.stderr)
    result = run_cli("--config.timing.compile_workers=0")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("--config.timing.compile_workers=0: must be >= 1", result.stderr)


class CompareTimingCachesCliTest(absltest.TestCase):

  def test_compares_two_caches_and_refuses_a_broken_one(self):
    d = tempfile.mkdtemp(prefix="loka_compare_caches_")

    def write(name, fp8_us):
      entries = {}
      for kernel, us in (("xla_bf16", 30.0), ("xla_fp8_rowwise", fp8_us)):
        key = kernel_timing.cache_key(kernel, "fwd", "mk,kn->mn", [64, 36], [36, 32],
                                      "bfloat16")
        entries[key] = {"kernel": kernel, "pass": "fwd", "spec": "mk,kn->mn",
                        "lhs_shape": [64, 36], "rhs_shape": [36, 32], "dtype": "bfloat16",
                        "median_us": us, "ci_us": [0.95 * us, 1.05 * us]}
      path = os.path.join(d, name)
      with open(path, "w") as f:
        json.dump({"schema": kernel_timing.CACHE_SCHEMA, "device_kind": "NVIDIA H200",
                   "entries": entries}, f)
      return path

    first, second = write("one.json", 20.0), write("eight.json", 25.0)
    out = os.path.join(d, "rows.json")
    result = run_cli("compare", first, second, f"--out={out}", module="experiments.timing_cache")
    self.assertEqual(result.returncode, 0, result.stderr)
    summary = json.loads(result.stdout.splitlines()[0])
    self.assertEqual(summary["entries"], 2)
    self.assertAlmostEqual(summary["max_speedup_change"], 0.2)  # 1.5x -> 1.2x
    self.assertIn("| xla_fp8_rowwise | fwd | [64, 36] | [36, 32] | 20.0 | 25.0 | 1.250 |",
                  result.stdout)
    with open(out) as f:
      self.assertLen(json.load(f)["rows"], 2)
    broken = os.path.join(d, "broken.json")
    with open(broken, "w") as f:
      f.write("{not json")
    result = run_cli("compare", first, broken, module="experiments.timing_cache")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("broken.json: not a readable timing cache", result.stderr)


class MergeTimingCachesCliTest(absltest.TestCase):

  def test_merges_caches_of_one_card_and_refuses_two_cards(self):
    d = tempfile.mkdtemp(prefix="loka_merge_caches_")

    def write(name, kind, shapes):
      cache = kernel_timing.TimingCache(os.path.join(d, name), kind)
      for k in shapes:
        key = kernel_timing.cache_key("xla_bf16", "fwd", "mk,kn->mn", [64, k], [k, 32],
                                      "bfloat16")
        cache.put(key, {"kernel": "xla_bf16", "pass": "fwd", "spec": "mk,kn->mn",
                        "lhs_shape": [64, k], "rhs_shape": [k, 32], "dtype": "bfloat16",
                        "median_us": float(k)})
      cache.save()
      return cache.path

    own = write("own.json", "NVIDIA H200", [32])
    other = write("other.json", "NVIDIA H200", [32, 64])
    result = run_cli("merge", f"--out={own}", own, other, module="experiments.timing_cache")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("wrote", result.stdout)
    merged = kernel_timing.TimingCache(own, "NVIDIA H200")
    self.assertEqual(sorted(e["lhs_shape"][1] for e in merged.entries.values()), [32, 64])
    h100 = write("h100.json", "NVIDIA H100 80GB HBM3", [128])
    result = run_cli("merge", f"--out={os.path.join(d, 'x.json')}", own, h100,
                     module="experiments.timing_cache")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("different device kinds", result.stderr)
    result = run_cli("merge", f"--out={os.path.join(d, 'x.json')}", os.path.join(d, "missing.json"),
                     module="experiments.timing_cache")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("missing.json: not a readable timing cache", result.stderr)


class TimingCacheTableCliTest(absltest.TestCase):

  def test_a_cards_cache_goes_into_its_committed_table_and_a_cpus_does_not(self):
    d = tempfile.mkdtemp(prefix="loka_cache_table_")
    kind = "NVIDIA H100 80GB HBM3"

    def write(name, device, rows):
      cache = kernel_timing.TimingCache(os.path.join(d, name), device)
      for kernel, k, us in rows:
        key = kernel_timing.cache_key(kernel, "fwd", "mk,kn->mn", [64, k], [k, 32], "bfloat16")
        entry = {"kernel": kernel, "pass": "fwd", "spec": "mk,kn->mn", "lhs_shape": [64, k],
                 "rhs_shape": [k, 32], "dtype": "bfloat16", "median_us": us,
                 "ci_us": [0.9 * us, 1.1 * us], "backend": "xla", "seconds": [1e-6 * us],
                 "jax": "0.11.2", "date": "2026-12-05", "revision": 1}
        cache.put(key, entry if us else {**entry, "error": "RESOURCE_EXHAUSTED"})
      cache.save()
      return cache.path

    tables = os.path.join(d, "timings")
    first = write("first.json", kind, [("xla_bf16", 32, 10.0), ("xla_fp8_rowwise", 32, 8.0),
                                       ("xla_fp8_tensorwise", 64, 0.0)])
    result = run_cli("table", first, f"--table_dir={tables}", module="experiments.timing_cache")
    self.assertEqual(result.returncode, 0, result.stderr)
    path = timing_table.table_path(kind, tables)
    self.assertIn(f"{path}: 2 entries (0 before, 2 from {first}", result.stdout)
    table = timing_table.load_table(path)
    self.assertEqual(table["device_kind"], kind)
    hit = timing_table.lookup(table, "xla_fp8_rowwise", "fwd", "mk,kn->mn", [64, 32], [32, 32],
                              "bfloat16")
    self.assertAlmostEqual(hit["speedup"], 10.0 / 8.0)   # the error entry was left out
    self.assertFalse(hit["estimated"])
    # A second cache's timing of the same problem replaces what it measured again; the
    # rowwise time stays, beside its own run's bf16; other problems stay.
    second = write("second.json", kind, [("xla_bf16", 32, 12.0), ("xla_bf16", 128, 30.0)])
    result = run_cli("table", second, f"--table_dir={tables}", module="experiments.timing_cache")
    self.assertEqual(result.returncode, 0, result.stderr)
    table = timing_table.load_table(path)
    self.assertEqual(sorted((e["kernel"], e["lhs_shape"][1], e["median_us"])
                            for e in table["entries"]),
                     [("xla_bf16", 32, 12.0), ("xla_bf16", 128, 30.0),
                      ("xla_fp8_rowwise", 32, 8.0)])
    hit = timing_table.lookup(table, "xla_fp8_rowwise", "fwd", "mk,kn->mn", [64, 32], [32, 32],
                              "bfloat16")
    self.assertAlmostEqual(hit["speedup"], 10.0 / 8.0)
    for name, device, says in (("cpu.json", "cpu", "a CPU's timings"),
                               ("empty.json", kind, "no timing without an error")):
      bad = write(name, device, [("xla_bf16", 32, 10.0)] if device == "cpu" else [])
      result = run_cli("table", bad, f"--table_dir={tables}", module="experiments.timing_cache")
      self.assertNotEqual(result.returncode, 0)
      self.assertIn(says, result.stderr)
      self.assertNotIn("Traceback", result.stderr)
    result = run_cli("table", os.path.join(d, "missing.json"), f"--table_dir={tables}",
                     module="experiments.timing_cache")
    self.assertIn("missing.json: not a readable timing cache", result.stderr)



if __name__ == "__main__":
  absltest.main()
