"""ProbeReport files, markdown, plots, kernel timing and the committed timing tables."""
import functools
import json
import math
import os
import tempfile
import threading
from unittest import mock

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import kernels as kernels_lib
from loka_jax import timing as timing_lib
from loka_jax.probe import timing_table
from loka_jax.probe import candidates, collector, eligibility, kernel_timing, plots, timing_caches
from loka_jax.probe import report as report_lib
from loka_jax.probe.stats_report import histogram

CONFIG = collector.ProbeConfig()


def _flush(value):
  grans = ("tensorwise", "rowwise", "block_1x128", "block_128x128")
  table = {f: {g: value for g in grans} for f in ("e4m3", "e5m2")}
  return {"mean": table, "max": table}


def _operand_stats(seed, uses):
  rng = np.random.default_rng(seed)
  return {"mode": "full", "features": 8, "spectrum": sorted(rng.uniform(0.1, 3, 8))[::-1],
          "histogram": histogram(rng.standard_normal(500) * 10.0 ** rng.uniform(-3, 1, 500)),
          "flush": {u: _flush(float(rng.uniform(0, 0.02))) for u in uses}}


def _entry(rng, speed=True):
  sq = float(rng.uniform(20, 40))
  out = {"sqnr_db": [sq - 1, sq, sq + 1], "rel_fro": [0.01, 0.02, 0.03],
         "mere": [0.05, 0.06, 0.07], "median_rel": [0.01, 0.01, 0.02],
         "underflow": [0.0, 0.001, 0.002],
         "operands": {"lhs": {"underflow": [0.0, 0.001, 0.002], "saturation": None}},
         "error": None, "backend": "xla_cpu", "time_us": None, "speedup": None}
  if speed:
    s = float(rng.uniform(0.8, 1.5))
    out.update(time_us=[9.0, 10.0, 11.0], speedup=[s - 0.05, s, s + 0.05])
  return out


REPO_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "results")


def make_report(sites=("tower/dense_0", "tower/fm")):
  """A small but complete loka.probe/2 report (the structure run_probe writes)."""
  rng = np.random.default_rng(0)
  kernels = ("xla_bf16", "xla_fp8_rowwise")
  info = {k: {"sort": kernels_lib.get(k).sort, "fp8": kernels_lib.get(k).fp8,
              "backend": "xla"} for k in kernels}
  report = report_lib.new_report(
      model="wukong", preset="tiny", device="cpu", device_kind="cpu", platform="cpu",
      jax_version="0.0", timing_valid=False, timing_source={"kind": "none"},
      run={"steps": 4, "batch_size": 8, "data": "synthetic", "precision": "bf16"},
      probe_config=CONFIG.to_dict(), evaluation={"samples": 4, "reservoir_samples": 4},
      criteria=eligibility.Criteria().to_dict(),
      overhead={"observations": 2, "cadence": 2, "probe_ms": 3.0, "step_ms": 10.0,
                "fraction": 0.15, "compile_s": 1.0},
      kernels=info, excluded_kernels={"xla_fp32": "reference arm"})
  for i, name in enumerate(sites):
    report["sites"][name] = {
        "kind": "act_weight", "spec": "mk,kn->mn",
        "shapes": {"lhs": [8, 16], "rhs": [16, 4], "out": [8, 4]}, "flops": 1024,
        "stats": {"observations": 2, "lhs": _operand_stats(i, ("fwd", "grad_rhs")),
                  "rhs": _operand_stats(i + 10, ("fwd", "grad_lhs")),
                  "grad": _operand_stats(i + 20, ("grad_lhs", "grad_rhs"))},
        "evaluation": {"slices": 8, "of": 8, "slice_index": "m"},
        "passes": {p: {k: _entry(rng) for k in kernels}
                   for p in ("fwd", "grad_lhs", "grad_rhs")}}
  report_lib.attach_best(report, eligibility.Criteria())
  return report


class ReportFileTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix="loka_report_")
    self.path = os.path.join(self.dir, "probe_report.json")

  def test_a_committed_version_1_report_still_loads(self):
    # loka.probe/1 differs only in how delayed-scaling ops were warmed; its fields read alike.
    path = os.path.join(REPO_RESULTS, "probe_report_dcnv2_small_h200_2026-11-27.json.gz")
    loaded = report_lib.load_report(path)
    self.assertEqual(loaded["schema"], "loka.probe/1")
    self.assertNotIn("evaluator", loaded["evaluation"])

  def test_save_load_round_trip(self):
    report = make_report()
    written = report_lib.save_report(report, self.path)
    loaded = report_lib.load_report(self.path)
    self.assertEqual(loaded, written)
    self.assertEqual(loaded["schema"], "loka.probe/2")
    self.assertEqual(set(loaded["sites"]), {"tower/dense_0", "tower/fm"})
    chex.assert_trees_all_close(loaded["sites"]["tower/fm"]["passes"]["fwd"]["xla_bf16"]["sqnr_db"],
                                report["sites"]["tower/fm"]["passes"]["fwd"]["xla_bf16"]["sqnr_db"])

  def test_truncated_file_is_rejected_naming_it(self):
    report_lib.save_report(make_report(), self.path)
    with open(self.path) as f:
      text = f.read()
    with open(self.path, "w") as f:
      f.write(text[: len(text) // 2])
    with self.assertRaisesRegex(report_lib.ProbeReportError,
                                f"{self.path}: not valid JSON .* truncated or corrupt"):
      report_lib.load_report(self.path)

  def test_empty_and_binary_files_are_rejected(self):
    open(self.path, "w").close()
    with self.assertRaisesRegex(report_lib.ProbeReportError, "empty"):
      report_lib.load_report(self.path)
    with open(self.path, "wb") as f:
      f.write(bytes(range(256)))
    with self.assertRaisesRegex(report_lib.ProbeReportError, "not valid JSON"):
      report_lib.load_report(self.path)

  @parameterized.parameters(
      (lambda r: r.update(schema="loka.probe/3"),
       "schema 'loka.probe/3' is not one of 'loka.probe/1', 'loka.probe/2'"),
      (lambda r: r.pop("schema"), "not a probe report"),
      (lambda r: r.pop("timing_valid"), "missing field 'timing_valid'"),
      (lambda r: r["sites"]["tower/fm"].update(kind="act_x"), "site 'tower/fm': kind 'act_x'"),
      (lambda r: r["sites"]["tower/fm"]["passes"].update(bwd={}), "unknown pass 'bwd'"),
      (lambda r: r["sites"]["tower/fm"]["passes"]["fwd"]["xla_bf16"].update(sqnr_db=[3, 2, 1]),
       "fwd, xla_bf16, sqnr_db: lower bound 3"),
      (lambda r: r["sites"]["tower/fm"]["passes"]["fwd"]["xla_bf16"].update(mere="high"),
       "mere: expected null or"),
  )
  def test_wrong_version_or_structure_is_rejected(self, corrupt, message):
    data = report_lib.json_ready(make_report())
    corrupt(data)
    with open(self.path, "w") as f:
      json.dump(data, f)
    with self.assertRaises(report_lib.ProbeReportError) as ctx:
      report_lib.load_report(self.path)
    self.assertIn(message, str(ctx.exception))
    self.assertIn(self.path, str(ctx.exception))

  def test_non_finite_numbers_become_null_with_an_error(self):
    report = make_report()
    report["sites"]["tower/fm"]["passes"]["fwd"]["xla_bf16"]["rel_fro"] = [0.1, math.nan, 0.2]
    report["overhead"]["fraction"] = math.inf
    written = report_lib.save_report(report, self.path)
    with open(self.path) as f:
      text = f.read()
    self.assertNotIn("NaN", text)
    self.assertNotIn("Infinity", text)
    self.assertIsNone(written["overhead"]["fraction"])
    self.assertTrue(any("overhead.fraction=inf" in e for e in written["errors"]))
    # A CI with a non-finite end is no CI: null, and the entry says why.
    entry = written["sites"]["tower/fm"]["passes"]["fwd"]["xla_bf16"]
    self.assertIsNone(entry["rel_fro"])
    self.assertIn("non-finite rel_fro=[0.1, nan, 0.2]", entry["error"])
    self.assertEqual(report_lib.load_report(self.path), written)


class ReportTextAndPlotTest(absltest.TestCase):

  def test_markdown_table_and_plots(self):
    report = report_lib.json_ready(make_report())
    text = report_lib.markdown(report)
    self.assertIn("# Probe report: wukong `tiny`", text)
    self.assertIn("| `tower/dense_0` | act_weight |", text)
    self.assertIn("overhead 15.00%", text)
    # Details: both sources' medians and the median time of each entry.
    entry = report["sites"]["tower/fm"]["passes"]["grad_rhs"]["xla_fp8_rowwise"]
    entry["sources"] = {"gaussian": {"sqnr_db": [28.0, 29.2, 30.0]},
                        "reservoir": {"sqnr_db": [7.5, 12.8, 17.4]}}
    entry["time_us"] = [870.0, 879.3, 891.6]
    row = [line for line in report_lib.markdown(report).splitlines()
           if line.startswith("| xla_fp8_rowwise | wgrad |")][-1]
    self.assertIn("| 29.2 / 12.8 |", row)
    self.assertIn("| 879.3 |", row)
    self.assertIn("| - / - |", text)  # entries without per-source draws
    # A fused op's backward is timed once for both gradients: its speedup says so.
    entry["time_scope"] = "grad_lhs+grad_rhs"
    entry["speedup"] = [1.5, 1.6, 1.7]
    row = [line for line in report_lib.markdown(report).splitlines()
           if line.startswith("| xla_fp8_rowwise | wgrad |")][-1]
    self.assertIn("| 1.60 [1.50, 1.70] (whole bwd) |", row)
    table = report_lib.site_table(report)
    self.assertEqual(len(table.splitlines()), 2 + 2)
    self.assertIn("tower/fm", table)
    out = tempfile.mkdtemp(prefix="loka_plots_")
    paths = plots.write_plots(report, out)
    self.assertEqual(len(paths), 3 + 2)  # two heatmaps, the site speedups, two sites
    for path in paths:
      with open(path, "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
      self.assertGreater(os.path.getsize(path), 2000)


class SiteSpeedupTest(absltest.TestCase):

  def test_the_best_kernel_per_site_over_every_pass_at_the_low_ends(self):
    report = report_lib.json_ready(make_report())
    passes = report["sites"]["tower/fm"]["passes"]
    # xla_fp8_rowwise: each pass's baseline at the medians, the kernel at the CI's low end.
    times = {"fwd": (10.0, (1.8, 2.0, 2.2)), "grad_lhs": (20.0, (0.9, 1.0, 1.1)),
             "grad_rhs": (30.0, (0.4, 0.5, 0.6))}
    for p, (t, speed) in times.items():
      passes[p]["xla_fp8_rowwise"].update(time_us=[t - 1, t, t + 1], speedup=list(speed))
    base = 10.0 * 2.0 + 20.0 * 1.0 + 30.0 * 0.5
    kernel = 10.0 * 2.0 / 1.8 + 20.0 * 1.0 / 0.9 + 30.0 * 0.5 / 0.4
    best = plots.best_site_speedups(report)
    self.assertAlmostEqual(best["tower/fm"][0], base / kernel)
    self.assertEqual(best["tower/fm"][1], "xla_fp8_rowwise")
    # A site untimed in one pass has no whole-site speedup; with none timed there is no plot.
    passes["grad_rhs"]["xla_fp8_rowwise"]["speedup"] = None
    self.assertNotIn("tower/fm", plots.best_site_speedups(report))
    out = tempfile.mkdtemp(prefix="loka_plots_")
    self.assertTrue(plots.site_speedup_plot(report, os.path.join(out, "a.png")))
    for site in report["sites"].values():
      for entries in site["passes"].values():
        for entry in entries.values():
          entry["speedup"] = None
    self.assertEqual(plots.best_site_speedups(report), {})
    self.assertIsNone(plots.site_speedup_plot(report, os.path.join(out, "b.png")))


class TimingTableTest(parameterized.TestCase):

  def _entry(self, kernel, m, us, pass_name="fwd"):
    return {"kernel": kernel, "pass": pass_name, "spec": "mk,kn->mn", "lhs_shape": [m, 256],
            "rhs_shape": [256, 512], "dtype": "bfloat16", "median_us": us,
            "ci_us": [0.9 * us, 1.1 * us], "backend": "cublaslt_fp8", "repeats": 20,
            "jax": "0.11.2", "date": "2026-11-26"}

  def test_merge_keeps_each_speedup_within_one_run_and_lookup_falls_back_to_nearest(self):
    directory = tempfile.mkdtemp(prefix="loka_tables_")
    path = timing_table.table_path("NVIDIA H100 80GB HBM3", directory)
    timing_table.update_file(path, "NVIDIA H100 80GB HBM3",
                             [self._entry("xla_bf16", 1024, 20.0),
                              self._entry("xla_fp8_rowwise", 1024, 25.0),
                              self._entry("xla_bf16", 8192, 100.0),
                              self._entry("xla_fp8_rowwise", 8192, 80.0),
                              self._entry("xla_fp8_tensorwise", 8192, 40.0)])
    # A later run times two kernels at 8192, its bf16 slower than the first run's. The
    # tensorwise time of the first run stays, divided by its own run's bf16 (100 / 40), and
    # the new rowwise time by the new bf16 (120 / 50).
    table = timing_table.update_file(path, "NVIDIA H100 80GB HBM3",
                                     [self._entry("xla_bf16", 8192, 120.0),
                                      self._entry("xla_fp8_rowwise", 8192, 50.0)])
    self.assertEqual(len(table["entries"]), 5)
    self.assertEqual({kind: p for kind, (p, _) in timing_table.committed_tables(directory).items()},
                     {"NVIDIA H100 80GB HBM3": path})
    self.assertEqual(timing_table.load_table(path), table)   # `beside` saved and read back
    exact = timing_table.lookup(table, "xla_fp8_rowwise", "fwd", "mk,kn->mn", (8192, 256),
                                (256, 512))
    self.assertFalse(exact["estimated"])
    self.assertAlmostEqual(exact["speedup"], 2.4)
    kept = timing_table.lookup(table, "xla_fp8_tensorwise", "fwd", "mk,kn->mn", (8192, 256),
                               (256, 512))
    self.assertAlmostEqual(kept["speedup"], 2.5)
    self.assertAlmostEqual(kept["speedup_range"][0], 0.9 * 100 / (1.1 * 40))
    near = timing_table.lookup(table, "xla_fp8_rowwise", "fwd", "mk,kn->mn", (6000, 256),
                               (256, 512))
    self.assertTrue(near["estimated"])
    self.assertEqual(near["from"]["lhs_shape"], [8192, 256])
    self.assertAlmostEqual(near["time_us"], 50.0 * 6000 / 8192)
    # A third run at 8192 (bf16 and rowwise again) leaves tensorwise with its own run's bf16.
    table = timing_table.update_file(path, "NVIDIA H100 80GB HBM3",
                                     [self._entry("xla_bf16", 8192, 200.0),
                                      self._entry("xla_fp8_rowwise", 8192, 100.0)])
    kept = timing_table.lookup(table, "xla_fp8_tensorwise", "fwd", "mk,kn->mn", (8192, 256),
                               (256, 512))
    self.assertAlmostEqual(kept["speedup"], 2.5)
    # Measured again itself, it drops the times it carried.
    table = timing_table.update_file(path, "NVIDIA H100 80GB HBM3",
                                     [self._entry("xla_bf16", 8192, 200.0),
                                      self._entry("xla_fp8_tensorwise", 8192, 160.0)])
    again = next(e for e in table["entries"] if e["kernel"] == "xla_fp8_tensorwise")
    self.assertNotIn("beside", again)
    self.assertAlmostEqual(timing_table.lookup(table, "xla_fp8_tensorwise", "fwd", "mk,kn->mn",
                                               (8192, 256), (256, 512))["speedup"], 1.25)
    # A table merged into another keeps what its entries carry beside them.
    other = timing_table.merge_entries(timing_table.empty_table("NVIDIA H100 80GB HBM3"), [
        self._entry("xla_bf16", 4096, 30.0),
        dict(self._entry("xla_fp8_rowwise", 4096, 20.0),
             beside={"xla_bf16": {"median_us": 50.0, "ci_us": [49.0, 51.0]}})])
    merged = timing_table.merge_entries(table, other["entries"])
    self.assertAlmostEqual(timing_table.lookup(merged, "xla_fp8_rowwise", "fwd", "mk,kn->mn",
                                               (4096, 256), (256, 512))["speedup"], 2.5)
    bad = dict(table, entries=[dict(again, beside={"xla_bf16": {"median_us": -1}})])
    with self.assertRaisesRegex(timing_table.TimingTableError, "entry 0 .*malformed 'beside'"):
      timing_table.validate(bad, "t.json")
    with self.assertRaisesRegex(timing_table.TimingTableError, "holds timings of"):
      timing_table.update_file(path, "NVIDIA H200", [])

  def test_an_untimed_run_falls_back_on_the_widest_table_unless_told_which(self):
    directory = tempfile.mkdtemp(prefix="loka_tables_")
    narrow = timing_table.table_path("NVIDIA H100 80GB HBM3", directory)
    wide = timing_table.table_path("NVIDIA H200", directory)
    timing_table.update_file(narrow, "NVIDIA H100 80GB HBM3",
                             [self._entry("xla_bf16", 1024, 20.0)])
    timing_table.update_file(wide, "NVIDIA H200",
                             [self._entry("xla_bf16", 1024, 15.0),
                              self._entry("xla_fp8_rowwise", 1024, 10.0),
                              self._entry("xla_bf16", 4096, 50.0)])
    self.assertEqual(timing_table.choose_table(None, directory)[0], wide)
    self.assertEqual(timing_table.choose_table("NVIDIA H100 80GB HBM3", directory)[0], narrow)
    self.assertEqual(timing_table.choose_table("NVIDIA_H100_80GB_HBM3", directory)[0], narrow)
    self.assertIsNone(timing_table.choose_table(None, tempfile.mkdtemp()))

  def test_bad_tables_are_rejected_naming_the_file(self):
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    with open(path, "w") as f:
      f.write('{"schema": "loka.timings/1", "device_kind": "x", "entries": [')
    with self.assertRaisesRegex(timing_table.TimingTableError, f"{path}: not valid JSON"):
      timing_table.load_table(path)
    with open(path, "w") as f:
      json.dump({"schema": "loka.timings/1", "device_kind": "x",
                 "entries": [{**self._entry("a", 1, 1.0), "median_us": -1}]}, f)
    with self.assertRaisesRegex(timing_table.TimingTableError, "positive number"):
      timing_table.load_table(path)


class KernelTimingTest(absltest.TestCase):

  def test_measures_missing_entries_once_and_reports_speedups(self):
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (32, 48), (48, 16), CONFIG)
    kernels, _ = candidates.candidate_kernels(["xla_bf16", "xla_fp8_rowwise",
                                               "xla_fp8_rowwise_fastacc"], "cpu")
    path = os.path.join(tempfile.mkdtemp(), "cpu.json")
    cache = kernel_timing.TimingCache(path, "cpu")
    # Samples of at least 50 ms rather than 1: on a host loaded by 16 test workers, the best
    # of three single calls of this product read over 1 ms once, and it was timed one call a
    # sample (inner 1), so the check of how short products are timed below failed.
    long_samples = functools.partial(kernel_timing._time_interleaved, min_call_seconds=0.05)
    with mock.patch.object(kernel_timing, "_time_interleaved", long_samples):
      got = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache,
                                       unsupported={}, repeats=3)
    self.assertEqual(len(got), 9)  # 3 kernels x 3 passes (identical code measured once)
    fast = {e["pass"]: e for e in got if e["kernel"] == "xla_fp8_rowwise_fastacc"}
    base = {e["pass"]: e for e in got if e["kernel"] == "xla_fp8_rowwise"}
    self.assertEqual(fast["fwd"]["seconds"], base["fwd"]["seconds"])  # same code in fwd
    reloaded = kernel_timing.TimingCache(path, "cpu")
    self.assertEqual(kernel_timing.measure_site(site.layout, kernels, "bfloat16", reloaded,
                                                unsupported={}, repeats=3), [])
    timings = kernel_timing.site_timings(site.layout, kernels, "bfloat16", reloaded,
                                         unsupported={})
    entry = timings["grad_rhs"]["xla_fp8_rowwise"]
    lo, mid, hi = entry["time_us"]
    self.assertTrue(0 < lo <= mid <= hi)
    self.assertEqual(entry["backend"], "xla_cpu")
    self.assertEqual(len(entry["speedup"]), 3)
    rows = kernel_timing.table_entries(list(reloaded.entries.values()))
    self.assertNotIn("seconds", rows[0])
    table = timing_table.merge_entries(timing_table.empty_table("cpu"), rows)
    timing_table.validate(table, "merged")
    # Products this small are short: timed as several calls a sample (single calls back to
    # back on a CPU, one chain of UNROLL on a GPU), and the entries say how.
    self.assertTrue(all(e["unroll"] == timing_lib.loop_unroll() and e["inner"] > 1
                        for e in got))

  def test_compiling_ahead_on_threads_times_the_same_kernel_passes(self):
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (32, 48), (48, 16), CONFIG)
    kernels, _ = candidates.candidate_kernels(["xla_bf16", "xla_fp8_rowwise",
                                               "flax_fp8_delayed"], "cpu")
    threads = []
    real = timing_lib.compile_chain

    def recording(*args, **kw):
      threads.append(threading.current_thread().name)
      return real(*args, **kw)

    got, compiles = {}, {}
    for workers in (1, 3):
      cache = kernel_timing.TimingCache(os.path.join(tempfile.mkdtemp(), "cpu.json"), "cpu")
      threads.clear()
      with mock.patch.object(timing_lib, "compile_chain", side_effect=recording):
        entries = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache,
                                             unsupported={}, repeats=3,
                                             compile_workers=workers)
      # (`inner`, the calls a sample divides by, is sized from a timed call: not compared.)
      got[workers] = {(e["kernel"], e["pass"]): (e.get("time_scope"), e["repeats"], e["unroll"])
                      for e in entries}
      compiles[workers] = len(threads)
      on_pool = [t.startswith("loka-timing-compile") for t in threads]
      self.assertTrue(all(on_pool) if workers > 1 else not any(on_pool), threads)
      self.assertTrue(all(e["median_us"] > 0 and "error" not in e for e in entries))
    self.assertEqual(got[1], got[3])
    self.assertEqual(compiles[1], compiles[3])  # each program compiled once, ahead or not
    self.assertGreater(compiles[3], 3)

  def test_a_variant_that_fails_to_compile_ahead_is_reported_not_raised(self):
    x = jnp.ones((8, 8), jnp.float32)

    def broken(a):
      raise TypeError("no such product")

    out = kernel_timing._time_interleaved({"ok": (lambda a: a @ a, (x,)),
                                           "broken": (broken, (x,))},
                                          repeats=2, compile_workers=2)
    self.assertLen(out["ok"]["seconds"], 2)
    self.assertIn("TypeError: no such product", out["broken"]["error"])

  def test_two_caches_compared_entry_by_entry(self):
    def entry(kernel, pass_name, us, scope=None):
      e = {"kernel": kernel, "pass": pass_name, "spec": "mk,kn->mn", "lhs_shape": [64, 32],
           "rhs_shape": [32, 16], "dtype": "bfloat16", "median_us": us,
           "ci_us": [0.95 * us, 1.05 * us]}
      return {**e, "time_scope": scope} if scope else e

    def cache(bf16_us, fp8_us, fused_bwd_us):
      es = [entry("xla_bf16", "fwd", bf16_us), entry("xla_fp8_rowwise", "fwd", fp8_us),
            entry("xla_bf16", kernel_timing.FUSED_SCOPE, 30.0, kernel_timing.FUSED_SCOPE),
            entry("flax_fp8_delayed", "grad_lhs", fused_bwd_us, kernel_timing.FUSED_SCOPE),
            {**entry("pallas_fp8_rowwise", "fwd", 1.0), "error": "failed to compile"}]
      return {kernel_timing.cache_key(e["kernel"], e["pass"], e["spec"], e["lhs_shape"],
                                      e["rhs_shape"], e["dtype"]): e for e in es}

    got = timing_caches.compare_caches(cache(10.0, 8.0, 20.0), cache(10.0, 16.0, 20.0))
    rows = {(r["kernel"], r["pass"]): r for r in got["rows"]}
    self.assertLen(rows, 4)  # the failed entry is left out
    fp8 = rows[("xla_fp8_rowwise", "fwd")]
    self.assertEqual((fp8["ratio"], fp8["ci_overlap"]), (2.0, False))
    self.assertEqual((fp8["speedup_first"], fp8["speedup_second"]), (1.25, 0.625))
    fused = rows[("flax_fp8_delayed", "grad_lhs")]  # against the baseline's whole backward
    self.assertEqual((fused["speedup_first"], fused["ci_overlap"]), (1.5, True))
    self.assertNotIn("speedup_first", rows[("xla_bf16", "fwd")])
    summary = got["summary"]
    self.assertEqual((summary["entries"], summary["median_ratio"]), (4, 1.0))
    self.assertEqual((summary["ci_overlap_share"], summary["max_speedup_change"]), (0.75, 0.5))
    with self.assertRaisesRegex(ValueError, "share no measured kernel pass"):
      timing_caches.compare_caches(cache(10.0, 8.0, 20.0), {})

  def test_merged_caches_keep_each_problem_from_one_measurement(self):
    def entries(us, problems):
      out = {}
      for lhs in problems:
        for kernel in ("xla_bf16", "xla_fp8_rowwise"):
          e = {"kernel": kernel, "pass": "fwd", "spec": "mk,kn->mn", "lhs_shape": [64, lhs],
               "rhs_shape": [lhs, 16], "dtype": "bfloat16", "median_us": us}
          out[kernel_timing.cache_key(kernel, "fwd", e["spec"], e["lhs_shape"],
                                      e["rhs_shape"], e["dtype"])] = e
      return out

    own = entries(10.0, [32, 48])
    other = entries(20.0, [48, 96])
    del other[next(k for k, e in other.items()            # a problem the target timed in
                   if e["lhs_shape"] == [64, 48] and e["kernel"] == "xla_bf16")]  # part only
    merged, taken = timing_caches.merge_caches([own, other])
    self.assertEqual(taken, [2, 1])
    by_problem = {}
    for e in merged.values():
      by_problem.setdefault(e["lhs_shape"][1], set()).add(e["median_us"])
    # 32 and 48 wholly the target's own (never the other's kernel over its baseline), 96 the
    # other's: each problem from one measurement.
    self.assertEqual(by_problem, {32: {10.0}, 48: {10.0}, 96: {20.0}})
    self.assertLen(merged, 6)

  def test_speedups_no_timing_resolves_are_left_out(self):
    # One output column: grad_lhs sums over K = 1, an outer product XLA fuses: no speedup,
    # measured or from a table. fwd and grad_rhs are real products and keep theirs.
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (32, 48), (48, 1), CONFIG)
    self.assertEqual([kernel_timing.contraction_size(site.layout, p)
                      for p in ("fwd", "grad_lhs", "grad_rhs")], [48, 1, 32])
    kernels, _ = candidates.candidate_kernels(["xla_bf16", "xla_fp8_rowwise"], "cpu")
    cache = kernel_timing.TimingCache(os.path.join(tempfile.mkdtemp(), "cpu.json"), "cpu")
    kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache, unsupported={},
                               repeats=3)
    table = timing_table.merge_entries(timing_table.empty_table("cpu"),
                                       kernel_timing.table_entries(list(cache.entries.values())))
    for timings in (kernel_timing.site_timings(site.layout, kernels, "bfloat16", cache,
                                               unsupported={}),
                    kernel_timing.table_timings(site.layout, kernels, "bfloat16", table,
                                                unsupported={})):
      outer = timings["grad_lhs"]["xla_fp8_rowwise"]
      self.assertEqual((outer["speedup"], outer["timing"]), (None, "unresolved"))
      self.assertIn("outer product (K = 1)", outer["timing_note"])
      self.assertIsNotNone(outer["time_us"])                       # the time itself is kept
      for p in ("fwd", "grad_rhs"):
        self.assertLen(timings[p]["xla_fp8_rowwise"]["speedup"], 3)
    # A GPU chain's sample under a kernel's own cost a call: the product ran inside another.
    key = kernel_timing.cache_key("xla_fp8_rowwise", "fwd",
                                  *kernel_timing.pass_problem(site.layout, "fwd"), "bfloat16")
    for median_us, resolved in ((0.4, False), (2.0, True)):
      cache.entries[key] = {**cache.entries[key], "unroll": 8, "median_us": median_us}
      fwd = kernel_timing.site_timings(site.layout, kernels, "bfloat16", cache,
                                       unsupported={})["fwd"]["xla_fp8_rowwise"]
      self.assertEqual(fwd["speedup"] is not None, resolved, fwd)
      if not resolved:
        self.assertIn(f"the kernel timed {median_us:.2f} us a call", fwd["timing_note"])

  def test_short_products_run_as_chains_and_long_ones_as_single_calls(self):
    # As on a GPU (4 calls chained here): a product under SHORT_FLOPS is timed as one chain of
    # 4 calls a sample less its floor; a longer one as single calls dispatched back to back,
    # at least LONG_DISPATCHES a sample.
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (32, 48), (48, 16), CONFIG)
    kernels, _ = candidates.candidate_kernels(["xla_bf16"], "cpu")
    real_sampler = timing_lib.ChainSampler
    for short_flops, chain in ((kernel_timing.SHORT_FLOPS, 4), (1, 1)):
      chains = []

      def sampler(fn, args, calls, warmup=3, **kw):
        chains.append(calls)
        return real_sampler(fn, args, calls, warmup, **kw)
      cache = kernel_timing.TimingCache(os.path.join(tempfile.mkdtemp(), "cpu.json"), "cpu")
      with mock.patch.object(timing_lib, "loop_unroll", lambda: 4), \
           mock.patch.object(timing_lib, "ChainSampler", sampler), \
           mock.patch.object(kernel_timing, "SHORT_FLOPS", short_flops):
        got = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache,
                                         unsupported={}, repeats=3)
      self.assertEqual(chains, [chain] * 3)  # bf16's three passes, one compile each
      for e in got:
        self.assertEqual(e["unroll"], chain)
        self.assertEqual(e["inner"] % chain, 0)  # whole dispatches of the chain
        if chain == 1:  # long: at least LONG_DISPATCHES single calls back to back
          self.assertGreaterEqual(e["inner"], timing_lib.LONG_DISPATCHES)
        else:  # short: one chain a sample
          self.assertEqual(e["inner"], 4)
        self.assertEqual(e["loop"], kernel_timing.LOOP)
        if chain > 1:
          self.assertGreater(e["floor_us"], 0.0)  # the chain's own time, timed and subtracted
        else:
          self.assertIsNone(e["floor_us"])  # nothing chained: nothing to subtract

  def test_delayed_scaling_ops_share_one_timing_of_their_common_forward(self):
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (64, 48), (48, 32), CONFIG)
    kernels, _ = candidates.candidate_kernels(
        ["xla_bf16", "flax_fp8_delayed", "flax_fp8_delayed_grad_lhs"], "cpu")
    cache = kernel_timing.TimingCache(os.path.join(tempfile.mkdtemp(), "cpu.json"), "cpu")
    got = {(e["kernel"], e["pass"]): e for e in kernel_timing.measure_site(
        site.layout, kernels, "bfloat16", cache, unsupported={}, repeats=3)}
    flax, ours = "flax_fp8_delayed", "flax_fp8_delayed_grad_lhs"
    self.assertEqual(got[(flax, "fwd")]["seconds"], got[(ours, "fwd")]["seconds"])
    self.assertNotEqual(got[(flax, "grad_lhs")]["seconds"], got[(ours, "grad_lhs")]["seconds"])
    self.assertNotIn("error", got[(ours, "grad_rhs")])

  def test_a_fused_backward_is_compared_with_the_baselines_backward_timed_as_one_call(self):
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (64, 48), (48, 32), CONFIG)
    kernels, _ = candidates.candidate_kernels(["xla_bf16", "flax_fp8_delayed_fwd"], "cpu")
    path = os.path.join(tempfile.mkdtemp(), "cpu.json")
    cache = kernel_timing.TimingCache(path, "cpu")
    got = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache, unsupported={},
                                     repeats=3)
    bwd_key = kernel_timing.baseline_bwd_key(site.layout, "bfloat16")
    bwd = cache.get(bwd_key)
    self.assertEqual((bwd["kernel"], bwd["pass"], bwd["time_scope"]),
                     ("xla_bf16", "grad_lhs+grad_rhs", "grad_lhs+grad_rhs"))
    self.assertIn(bwd, got)
    timings = kernel_timing.site_timings(site.layout, kernels, "bfloat16", cache,
                                         unsupported={})
    for p in ("grad_lhs", "grad_rhs"):
      entry = timings[p]["flax_fp8_delayed_fwd"]
      self.assertEqual(entry["speedup_vs"], "baseline backward, one call")
      self.assertEqual(entry["baseline_us"][1], bwd["median_us"])
      # The speedup's middle is the ratio of the two medians (the bootstrap's point estimate).
      self.assertAlmostEqual(entry["speedup"][1], bwd["median_us"] / entry["time_us"][1],
                             delta=0.05 * entry["speedup"][1])
    # A cache from before the baseline's backward was timed: the fused op is timed again
    # beside it (not the per-pass baseline alone), and until then the two passes stand in.
    del cache.entries[bwd_key]
    timings = kernel_timing.site_timings(site.layout, kernels, "bfloat16", cache,
                                         unsupported={})
    self.assertEqual(timings["grad_lhs"]["flax_fp8_delayed_fwd"]["speedup_vs"],
                     "baseline grad_lhs + grad_rhs, timed apart")
    self.assertNotIn("baseline_us", timings["grad_lhs"]["flax_fp8_delayed_fwd"])
    again = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache, unsupported={},
                                       repeats=3)
    self.assertEqual({(e["kernel"], e["pass"]) for e in again},
                     {("xla_bf16", p) for p in ("fwd", "grad_lhs", "grad_rhs",
                                                "grad_lhs+grad_rhs")}
                     | {("flax_fp8_delayed_fwd", p) for p in ("fwd", "grad_lhs", "grad_rhs")})
    # The committed table keeps the one-call backward, and a CPU-made report compares with it.
    table = timing_table.merge_entries(timing_table.empty_table("cpu"),
                                       kernel_timing.table_entries(list(cache.entries.values())))
    from_table = kernel_timing.table_timings(site.layout, kernels, "bfloat16", table,
                                             unsupported={})
    entry = from_table["grad_rhs"]["flax_fp8_delayed_fwd"]
    self.assertEqual(entry["speedup_vs"], "baseline backward, one call")
    fused_us = cache.get(kernel_timing.cache_key(
        "flax_fp8_delayed_fwd", "grad_lhs",
        *kernel_timing.pass_problem(site.layout, "grad_lhs"), "bfloat16"))["median_us"]
    self.assertAlmostEqual(entry["speedup"][1], cache.get(bwd_key)["median_us"] / fused_us,
                           places=6)

  def test_entries_of_an_older_kernel_revision_are_measured_again(self):
    # xla_fp8_tensorwise is at revision 2 (its dot writes the output dtype): timings of the
    # revision before, in a cache or a committed table, are not reused.
    site = collector.make_site_probe("d", "mk,kn->mn", "act_weight", (32, 48), (48, 16), CONFIG)
    kernels, _ = candidates.candidate_kernels(["xla_bf16", "xla_fp8_tensorwise",
                                               "xla_fp8_rowwise"], "cpu")
    self.assertEqual(kernels_lib.get("xla_fp8_tensorwise").revision, 2)
    cache = kernel_timing.TimingCache(os.path.join(tempfile.mkdtemp(), "cpu.json"), "cpu")
    got = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache, unsupported={},
                                     repeats=3)
    self.assertEqual({e["kernel"]: e["revision"] for e in got},
                     {"xla_bf16": 1, "xla_fp8_tensorwise": 2, "xla_fp8_rowwise": 1})
    table = timing_table.merge_entries(timing_table.empty_table("cpu"),
                                       kernel_timing.table_entries(got))
    for e in list(cache.entries.values()) + table["entries"]:
      if e["kernel"] == "xla_fp8_tensorwise":
        e["revision"] = 1
    timings = kernel_timing.site_timings(site.layout, kernels, "bfloat16", cache,
                                         unsupported={})
    self.assertEqual(timings["fwd"]["xla_fp8_tensorwise"]["timing"], "missing")
    self.assertEqual(timings["fwd"]["xla_fp8_rowwise"]["timing"], "measured")
    from_table = kernel_timing.table_timings(site.layout, kernels, "bfloat16", table,
                                             unsupported={})
    self.assertEqual(from_table["fwd"]["xla_fp8_tensorwise"]["timing"], "missing")
    self.assertEqual(from_table["fwd"]["xla_fp8_rowwise"]["timing"], "table")
    again = kernel_timing.measure_site(site.layout, kernels, "bfloat16", cache,
                                       unsupported={}, repeats=3)
    self.assertEqual({e["kernel"] for e in again}, {"xla_bf16", "xla_fp8_tensorwise"})

  def test_entries_timed_through_a_loop_xla_could_collapse_are_measured_again(self):
    path = os.path.join(tempfile.mkdtemp(), "cpu.json")
    old = {"kernel": "xla_bf16", "pass": "fwd", "inner": 40, "seconds": [3e-5]}
    with open(path, "w") as f:
      json.dump({"schema": kernel_timing.CACHE_SCHEMA, "device_kind": "cpu",
                 "entries": {"short": old, "long": {**old, "inner": 1},
                             "barrier": {**old, "unroll": 16},
                             "new": {**old, "unroll": 16, "loop": kernel_timing.LOOP}}}, f)
    cache = kernel_timing.TimingCache(path, "cpu")
    self.assertIsNone(cache.get("short"))    # one call an iteration, through barriers
    self.assertIsNone(cache.get("barrier"))  # 16 an iteration, through barriers
    self.assertEqual(cache.get("long")["inner"], 1)  # one call per sample: no loop
    self.assertEqual(cache.get("new")["unroll"], 16)

  def test_new_loop_entries_record_how_the_loop_kept_its_calls(self):
    entry = kernel_timing._entry("xla_bf16", "fwd", "mk,kn->mn", (4, 3), (3, 2), "float32",
                                 [1e-5, 2e-5], "cpu", inner=5, unroll=1)
    self.assertEqual(entry["loop"], kernel_timing.LOOP)
    self.assertNotIn("loop", kernel_timing._entry("xla_bf16", "fwd", "mk,kn->mn", (4, 3),
                                                  (3, 2), "float32", [1e-3], "cpu", inner=1,
                                                  unroll=1))

if __name__ == "__main__":
  absltest.main()
