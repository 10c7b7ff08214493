"""docs/RESULTS.md and the README's headline table are exactly what `python3 -m
experiments.report results` makes from the rows docs/results/manifest.json lists; every miss
has its reason; a broken manifest is a one-line error."""
import json
import os
import re
import tempfile

from absl import app
from absl.testing import absltest

from cli_helpers import REPO, run_module
from experiments.tools import results
from experiments.tools import results_sections as sections

MANIFEST = os.path.join(REPO, "docs", "results", "manifest.json")


class ResultsPageTest(absltest.TestCase):

  def test_the_committed_page_is_what_the_manifest_makes(self):
    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
      committed = f.read()
    self.assertEqual(results.page(MANIFEST), committed,
                     "docs/RESULTS.md is stale: run `python3 -m experiments.report results`")

  def test_the_page_reads_every_listed_row_file_and_counts_the_targets(self):
    with open(MANIFEST) as f:
      manifest = json.load(f)
    text = results.page(MANIFEST)
    self.assertIn(manifest["device"], text)
    for name in manifest["rows"]:
      self.assertIn(name, text)
    self.assertRegex(text, r"\d+ targets met, \d+ missed")
    self.assertIn("## Targets at a glance", text)

  def test_the_readme_carries_the_pages_headline(self):
    with open(os.path.join(REPO, "README.md")) as f:
      readme = f.read()
    table = results.headline_table(results.load_manifest(MANIFEST))
    self.assertIn(sections.README_BEGIN + "\n" + table + "\n" + sections.README_END, readme)
    self.assertIn("## Headline\n\n" + table, results.page(MANIFEST))
    # At most ten subjects, each stamped with card, jax, date and commit.
    body = [line for line in table.splitlines() if line.startswith("| ")][1:]
    self.assertLessEqual(len(body), 10)
    for line in body:
      self.assertRegex(line, r"\| NVIDIA [^|]+, jax [\d.]+ \| 20\d\d-\d\d-\d\d \| [0-9a-f]{7}")

  def test_every_miss_has_a_reason_and_the_findings_it_cites_exist(self):
    text = results.page(MANIFEST)
    section = text[text.index("## Missed targets"):text.index("## Targets at a glance")]
    self.assertEqual(section.count("\n- **"), len(re.findall(r"\| MISSED \|", text)))
    with open(os.path.join(REPO, "docs", "FINDINGS.md")) as f:
      entries = set(re.findall(r"^### (\d+)\. ", f.read(), flags=re.M))
    cited = set(re.findall(r"FINDINGS (\d+)", section))
    self.assertTrue(cited)
    self.assertLessEqual(cited, entries)

  def test_a_miss_without_a_reason_or_a_headline_without_a_row_is_refused(self):
    manifest = results.load_manifest(MANIFEST)
    rows, verdicts = results._evaluate(manifest)
    missed = [v for v in verdicts if v["met"] is False]
    why = dict(manifest.why)
    del why[sections.miss_key(missed[0])]
    with self.assertRaisesRegex(sections.ManifestError, "'why' lacks 1 missed target"):
      sections.misses(verdicts, why)
    with self.assertRaisesRegex(sections.ManifestError, "'nosuch/large' has no LoKA row"):
      sections.headline(rows, verdicts, {}, ["nosuch/large"], manifest.row_commits)

  def test_a_readme_without_the_markers_is_refused(self):
    with self.assertRaisesRegex(sections.ManifestError, "lacks the headline markers"):
      sections.readme_with_headline("# README\n", "| table |")
    readme = f"a\n{sections.README_BEGIN}\nold\n{sections.README_END}\nb\n"
    self.assertEqual(sections.readme_with_headline(readme, "new"),
                     f"a\n{sections.README_BEGIN}\nnew\n{sections.README_END}\nb\n")

  def test_a_manifest_naming_a_missing_file_is_one_line_naming_it(self):
    folder = tempfile.mkdtemp(prefix="loka_manifest_")
    path = os.path.join(folder, "manifest.json")
    with open(path, "w") as f:
      json.dump({"device": "NVIDIA H200", "rows": ["gone.jsonl"], "served_quality": []}, f)
    with self.assertRaisesRegex(app.UsageError, r"names 1 missing file\(s\): gone.jsonl"):
      results.load_manifest(path)
    with open(path, "w") as f:
      json.dump({"rows": []}, f)
    with self.assertRaisesRegex(app.UsageError, "needs 'device'"):
      results.load_manifest(path)

  def test_check_fails_on_a_stale_page(self):
    stale = os.path.join(tempfile.mkdtemp(prefix="loka_results_"), "RESULTS.md")
    with open(stale, "w") as f:
      f.write("# Results\n")
    done = run_module("experiments.report", "results", "--check", f"--out={stale}",
                      "--readme=", timeout=300)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    self.assertIn("is not what", done.stderr)


  def test_kernel_rows_against_the_cards_peak_by_hand(self):
    """1000 x 1000 x 1000 is 2 GFLOP. bf16 in 10 us: 200 TFLOP/s, 20% of 989; FP8 in 4 us:
    500 TFLOP/s, 25% of 1979, and 5 / 4 = 1.25x cuBLASLt's tensorwise dot (5 us: 20%, 1.00x).
    xla_fp8_rowwise on XLA's Triton in 3 us (667 TFLOP/s, 34%, 1.67x) is no cuBLASLt
    reference. A batched 1000 x 10x100x10
    product (20 MFLOP) in 0.01 us would be 2000 TFLOP/s, 202% of the bf16 peak: marked."""
    def row(shape, variant, us, backend="xla_triton", **dims):
      return {"schema": "loka.bench_kernels/1", "shape": shape, "variant": variant,
              "device": "NVIDIA H200", "jax": "0.11.2", "backend": backend, "median_us": us,
              "speedup_vs_baseline": [1.0, 1.0, 1.0], "time": "2026-11-26T00:00:00Z", **dims}
    dims = dict(m=1000, k=1000, n=1000)
    rows = [row("gemm", "xla_bf16", 10.0, **dims),
            row("gemm", "xla_fp8_rowwise", 3.0, **dims),
            row("gemm", "xla_fp8_tensorwise", 5.0, "cublasLt_fp8", **dims),
            row("gemm", "pallas_fp8_rowwise", 4.0, "pallas_triton", **dims),
            row("fmb_b1000_10x100x10", "xla_bf16", 0.01)]
    path = os.path.join(tempfile.mkdtemp(prefix="loka_kernels_"), "bench_kernels_x.jsonl")
    with open(path, "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in rows))
    table = sections.kernels_peak_table([path]).splitlines()
    self.assertEqual(table[0], "| shape | GFLOP | cuBLASLt FP8 dot | xla_bf16 | xla_fp8_rowwise "
                               "| xla_fp8_tensorwise | pallas_fp8_rowwise |")
    self.assertEqual(table[2], "| gemm | 2 | xla_fp8_tensorwise | 20% \u00b7 0.50x | 34% \u00b7 "
                               "1.67x | 20% \u00b7 1.00x | 25% \u00b7 1.25x |")
    self.assertEqual(table[3], "| fmb_b1000_10x100x10 | 0.02 | - | 202%! | - | - | - |")
    self.assertIn("fmb_b1000_10x100x10 xla_bf16 is too short", table[-1])
    self.assertIsNone(sections.dense_peak_tflops("NVIDIA H100 PCIe", fp8=True))
    self.assertEqual(sections.dense_peak_tflops("NVIDIA H100 80GB HBM3", fp8=False), 989.0)
    self.assertIn("| gemm | 1.00 [1.00, 1.00] |", sections.kernels_table([path]))
    # A later run with a kernel and cuBLASLt's rowwise dot (4 us): the kernel (2 us) is held
    # to its own run's dot, 4 / 2 = 2.00x, not to the earlier run's tensorwise one (5 / 2).
    later = os.path.join(os.path.dirname(path), "bench_kernels_y.jsonl")
    with open(later, "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in [
          row("gemm", "xla_fp8_rowwise", 4.0, "cublasLt_fp8", **dims),
          row("gemm", "pallas_mosaic_fp8_rowwise", 2.0, "pallas_mosaic_gpu", **dims)]))
    table = sections.kernels_peak_table([path, later]).splitlines()
    self.assertEqual(table[2], "| gemm | 2 | xla_fp8_tensorwise | 20% \u00b7 0.50x | 25% \u00b7 "
                               "1.00x | 20% \u00b7 1.00x | 25% \u00b7 1.25x | 51% \u00b7 2.00x |")

if __name__ == "__main__":
  absltest.main()
