"""The GEMM headroom of a plan (experiments/bench/headroom.py, experiments/tools/plan_headroom.py):
savings summed from hand-made kernel timings and checked against hand arithmetic."""
import gzip
import json
import os
import tempfile

import chex
from absl.testing import absltest

import report_builders as hm
from cli_helpers import run_module
from experiments.bench import headroom
from loka_jax.dispatch import pipeline, selection
from loka_jax.plan.file import save_plan
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.report import ProbeReportError, load_report, save_report

FUSED = {"time_scope": "grad_lhs+grad_rhs"}


def two_site_report():
  """Site `a`: Flax's delayed op (forward 2x: 50 us of bf16's 100; backward timed once at
  1.6x: 125 us of bf16's 2 x 100) and XLA rowwise per pass at 1.25x (80 us). Site `b`: the
  same rowwise speed, and Flax's op 4x in every pass but at 5 dB, outside any budget."""
  a = {"fwd": {"flax_fp8_delayed": hm.entry(speedup=(1.9, 2.0, 2.1)),
               "xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.25, 1.3))}}
  b = {"fwd": {"flax_fp8_delayed": hm.entry(sqnr=5.0, speedup=(3.9, 4.0, 4.1)),
               "xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.25, 1.3))}}
  for p in ("grad_lhs", "grad_rhs"):
    a[p] = {"flax_fp8_delayed": hm.entry(speedup=(1.5, 1.6, 1.7), base_us=200.0, **FUSED),
            "xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.25, 1.3))}
    b[p] = {"flax_fp8_delayed": hm.entry(sqnr=5.0, speedup=(3.9, 4.0, 4.1), base_us=200.0,
                                         **FUSED),
            "xla_fp8_rowwise": hm.entry(speedup=(1.2, 1.25, 1.3))}
  return hm.report({"a": hm.site(a), "b": hm.site(b)},
                   kernels={k: {} for k in ("xla_bf16", "flax_fp8_delayed",
                                            "xla_fp8_rowwise")})


class HeadroomTest(chex.TestCase):

  def test_savings_by_hand(self):
    rep = two_site_report()
    flax_a = (100 - 50) + (200 - 125)       # forward, then the backward counted once
    flax_b = (100 - 25) + (200 - 50)
    rowwise = 3 * (100 - 80)
    got = {l.plan: l for l in headroom.lines(rep, {}, "train",
                                             ["flax_fp8_delayed", "xla_fp8_rowwise"],
                                             step_ms=2.0, measured={"fp8_rowwise": 0.9})}
    self.assertEqual(got["xla_fp8_rowwise"].measured, 0.9)  # its bench peer's row
    self.assertIsNone(got["flax_fp8_delayed"].measured)
    self.assertIsNone(headroom.peer_variant("pallas_fp8_delayed"))  # it falls back per site
    self.assertAlmostEqual(got["flax_fp8_delayed"].saved_ms, (flax_a + flax_b) / 1e3)
    self.assertAlmostEqual(got["xla_fp8_rowwise"].saved_ms, 2 * rowwise / 1e3)
    self.assertEqual(got["xla_fp8_rowwise"].fp8_sites, 2)
    # the speed-only plan takes the 5 dB op at b too: the fastest choice at both sites
    best = got[headroom.SPEED_ONLY_NAME]
    self.assertAlmostEqual(best.saved_ms, (flax_a + flax_b) / 1e3)
    self.assertAlmostEqual(best.projected, 2.0 / (2.0 - (flax_a + flax_b) / 1e3))
    # inference counts the forwards only
    infer = {l.plan: l for l in headroom.lines(rep, {}, "infer", ["xla_fp8_rowwise"])}
    self.assertAlmostEqual(infer["xla_fp8_rowwise"].saved_ms, 2 * 20 / 1e3)
    self.assertAlmostEqual(infer[headroom.SPEED_ONLY_NAME].saved_ms, (50 + 75) / 1e3)
    self.assertIsNone(infer[headroom.SPEED_ONLY_NAME].projected)

  def test_the_budgeted_plan_forgoes_the_inaccurate_site_and_says_why(self):
    rep = two_site_report()
    plan = selection.select(rep, Criteria())
    self.assertEqual(plan.choice_for("b").fwd, "xla_fp8_rowwise")  # 5 dB is out of budget
    line = headroom.line(rep, "loka", plan, "train", step_ms=2.0, measured=1.1)
    self.assertAlmostEqual(line.saved_ms, ((50 + 75) + 3 * 20) / 1e3)
    self.assertEqual(line.measured, 1.1)
    rows = headroom.forgone(rep, plan, "train")
    self.assertEqual([r["site"] for r in rows], ["b"])
    self.assertAlmostEqual(rows[0]["forgone_ms"], ((75 + 150) - 3 * 20) / 1e3)
    self.assertEqual((rows[0]["plan"], rows[0]["speed_only"]),
                     ("xla_fp8_rowwise", "flax_fp8_delayed"))
    self.assertEqual(rows[0]["reason"], plan["sites"]["b"]["fwd"]["reason"])
    text = headroom.markdown([line], {"train": rows}, {"train": 1.25}, {"train": "bf16_mods"})
    self.assertIn(f"needs {headroom.needed_saving_ms(2.0, 1.25):.2f} ms", text)
    self.assertIn("| b | xla_fp8_rowwise | flax_fp8_delayed |", text)

  def test_an_untimed_fp8_site_is_counted_apart(self):
    rep = two_site_report()
    for p in rep["sites"]["b"]["passes"].values():
      p["xla_fp8_rowwise"].update(speedup=None, time_us=None, timing="missing")
    line = headroom.line(rep, "rowwise", headroom.everywhere("xla_fp8_rowwise"), "train")
    self.assertEqual((line.fp8_sites, line.untimed_fp8_sites), (2, 1))
    self.assertAlmostEqual(line.saved_ms, 3 * 20 / 1e3)

  def test_bad_input_is_named(self):
    rep = two_site_report()
    with self.assertRaisesRegex(ValueError, "unknown kernel 'no_such_op'"):
      headroom.everywhere("no_such_op")
    with self.assertRaisesRegex(ValueError, "mode 'serve'"):
      headroom.speed_only(rep, "serve")
    with self.assertRaisesRegex(ValueError, "cannot hold"):  # a step shorter than the saving
      headroom.line(rep, "x", headroom.everywhere("flax_fp8_delayed"), "train", step_ms=0.1)
    # A kernel everywhere that loses more than the step takes still projects (slower).
    slow = {p: {"xla_fp8_rowwise": hm.entry(speedup=(0.09, 0.1, 0.11))} for p in hm.PASSES}
    lost = headroom.line(hm.report({"s": hm.site(slow)}), "slow",
                         headroom.everywhere("xla_fp8_rowwise"), "train", step_ms=1.0)
    self.assertAlmostEqual(lost.saved_ms, 3 * (100 - 1000) / 1e3)
    self.assertAlmostEqual(lost.projected, 1.0 / (1.0 + 2.7))
    foreign = {"schema": "loka.plan/1", "sites": {"c": {p: "xla_bf16" for p in hm.PASSES}}}
    with self.assertRaisesRegex(ValueError, r"names 1 site\(s\) the probe report does not "
                                r"have \(c\)"):
      headroom.line(rep, "other", foreign, "train")
    with self.assertRaisesRegex(ValueError, "give one or more of"):
      pipeline.plan_speedup_estimate(headroom.everywhere("xla_fp8_rowwise"), rep, ("bwd",))

  def test_the_estimate_of_the_forwards_alone(self):
    rep = two_site_report()
    got = pipeline.plan_speedup_estimate(headroom.everywhere("flax_fp8_delayed"), rep,
                                         ("fwd",))
    self.assertAlmostEqual(got["bf16_us"], 200.0)
    self.assertAlmostEqual(got["plan_us"], 50.0 + 25.0)

  def test_measured_speedups_from_rows(self):
    def row(variant, train_us, infer_us, **extra):
      return {"suite": "models", "model": "toy", "preset": "tiny", "variant": variant,
              "train": {"median_us": train_us}, "infer": {"median_us": infer_us}, **extra}
    pair = {"bf16_mods": {"train": {"ratio": 1.3}, "infer": {"ratio": 1.6}}}
    rows = [row("bf16_mods", 2000.0, 800.0), row("loka", 1500.0, 500.0, head_to_head=pair),
            row("flax_fp8_delayed", 1600.0, 640.0),
            row("bf16_mods", 1.0, 1.0, mods_set="no_bias")]  # another subject: ignored
    got = headroom.measured_speedups(rows, "toy/tiny", {"train": "bf16_mods",
                                                        "infer": "bf16_mods"})
    self.assertAlmostEqual(got["train"]["step_ms"], 2.0)
    self.assertEqual(got["train"]["speedups"]["loka"], 1.3)   # its interleaved pair
    self.assertEqual(got["infer"]["speedups"]["loka"], 1.6)
    self.assertAlmostEqual(got["train"]["speedups"]["flax_fp8_delayed"], 2000.0 / 1600.0)
    with self.assertRaisesRegex(ValueError, "no 'bf16' row of toy/tiny.*'flax_fp8_delayed'"):
      headroom.measured_speedups(rows, "toy/tiny", {"train": "bf16"})
    towers = [{**r, "suite": "towers", "model": "tower", "preset": "64x8x2"} for r in rows[:3]]
    got = headroom.measured_speedups(towers, "tower/64x8x2", {"infer": "bf16_mods"})
    self.assertEqual(sorted(got), ["infer"])
    self.assertAlmostEqual(got["infer"]["speedups"]["flax_fp8_delayed"], 800.0 / 640.0)


class GzipReportTest(chex.TestCase):

  def test_a_gzipped_report_loads_and_a_truncated_one_is_named(self):
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "report.json")
    save_report(two_site_report(), path)
    with open(path, "rb") as f:
      packed = gzip.compress(f.read())
    good, cut = os.path.join(tmp, "good.json.gz"), os.path.join(tmp, "cut.json.gz")
    with open(good, "wb") as f:
      f.write(packed)
    with open(cut, "wb") as f:
      f.write(packed[:len(packed) // 2])
    self.assertEqual(load_report(good)["sites"].keys(), {"a", "b"})
    with self.assertRaisesRegex(ProbeReportError, "cut.json.gz: a damaged gzip file"):
      load_report(cut)


class CliTest(chex.TestCase):

  def test_writes_the_table_json_and_plot(self):
    tmp = tempfile.mkdtemp()
    rep = two_site_report()
    save_report(rep, os.path.join(tmp, "report.json"))
    save_plan(selection.select(rep, Criteria()), os.path.join(tmp, "plan.json"))
    out = os.path.join(tmp, "out")
    args = ["plan_headroom", f"--report={tmp}/report.json", f"--plans=loka={tmp}/plan.json",
            "--train_step_ms=2", "--infer_step_ms=1", "--train_target=1.25", f"--out={out}"]
    done = run_module("experiments.report", *args)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("| b | xla_fp8_rowwise | flax_fp8_delayed |", done.stdout)
    with open(os.path.join(out, "headroom.json")) as f:
      lines = json.load(f)["lines"]
    loka = next(l for l in lines if l["plan"] == "loka" and l["mode"] == "train")
    self.assertAlmostEqual(loka["projected"], 2.0 / (2.0 - (125 + 60) / 1e3), places=6)
    with open(os.path.join(out, "headroom.png"), "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    bad = run_module("experiments.report", *args[:2], "--plans=loka")
    self.assertNotEqual(bad.returncode, 0)
    self.assertIn("give name=PLAN.json", bad.stderr)


if __name__ == "__main__":
  absltest.main()
