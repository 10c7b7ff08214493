"""The headline benchmark harness on the CPU: resumable rows, targets.only, tables, plots, target
checks and the quality protocol. Timings here are smoke numbers; the checks are structural,
and the target arithmetic is checked on hand-made rows with known answers."""
import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from unittest import mock

import chex
import numpy as np
from absl.testing import absltest, parameterized

from cli_helpers import REPO, run_module
from loka_jax import dispatch
from experiments.bench import (forget, mods_set, pace, planning, plots, quality, serving, speed,
                               suite, tables, targets, towers, variants)
from experiments.bench.results import ResultsFile
from loka_jax.kernels.choice import KernelChoice, KernelPlan
from loka_jax.models.presets import site_products
from loka_jax.models.site import SiteConfig
from loka_jax.train import read_metrics

TOWERS_CONFIG = os.path.join("experiments", "configs", "bench_towers.py")
QUALITY_CONFIG = os.path.join("experiments", "configs", "bench_quality.py")
# A bench CLI run's compilation cache: conftest's for this run (unset, the bench keeps one in
# its workdir, empty in every test), so the steps this file compiled are not compiled again.
COMPILE_CACHE = f"--config.compile_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}"


def _tempdir(test):
  path = tempfile.mkdtemp(prefix="loka_bench_")
  test.addCleanup(shutil.rmtree, path, ignore_errors=True)
  return path


def _speed(speedup, rng, base_us=100.0, n=20, jitter=0.01):
  """A hand-made timing summary whose variant runs `speedup` x faster than its bf16."""
  base = base_us * (1 + jitter * rng.standard_normal(n))
  var = base_us / speedup * (1 + jitter * rng.standard_normal(n))
  return {"median_us": float(np.median(var)), "speedup": float(np.median(base) / np.median(var)),
          "speedup_ci": [speedup * 0.99, speedup * 1.01], "examples_per_s": 4096 / np.median(var)
          * 1e6, "samples_us": var.tolist(), "baseline_samples_us": base.tolist()}


def _row(model, preset, variant, train, infer, rng, suite_name="models"):
  return {"suite": suite_name, "model": model, "preset": preset, "variant": variant,
          "device": "H100", "batch_size": 4096, "train": _speed(train, rng),
          "infer": _speed(infer, rng), "train_memory_bytes": 2 ** 31}


def _verdict(verdicts, target, subject, mode):
  found = [v for v in verdicts if v["target"] == target and v["subject"] == subject
           and v["mode"] == mode]
  assert len(found) == 1, (target, subject, mode, found)
  return found[0]


def _quality_row(model, preset, arm, seed, logloss, **fields):
  """A synthetic-data quality row as `quality.run_model` writes it."""
  return {"suite": "quality", "data": "synthetic", "model": model, "preset": preset, "arm": arm,
          "seed": seed, "device": "H100", "logloss": logloss, "ne": logloss / 0.5, "auc": 0.7,
          "eval_fingerprint": "abc", **fields}


class TargetCheckTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(7)
    # wukong/large: LoKA 1.6x train / 2.0x infer over bf16; bf16+Mods 1.2x / 1.25x; so over
    # bf16+Mods LoKA is 1.333x (met) and 1.6x (met). dlrm/small: LoKA slower than the peer.
    self.rows = [
        _row("wukong", "large", "bf16", 1.0, 1.0, rng),
        _row("wukong", "large", "bf16_mods", 1.2, 1.25, rng),
        _row("wukong", "large", "fp8_rowwise", 1.1, 1.3, rng),
        _row("wukong", "large", "loka", 1.6, 2.0, rng),
        _row("dlrm", "small", "bf16", 1.0, 1.0, rng),
        _row("dlrm", "small", "bf16_mods", 1.1, 1.1, rng),
        _row("dlrm", "small", "fp8_tensorwise", 0.9, 0.95, rng),
        _row("dlrm", "small", "loka", 0.8, 1.0, rng),
    ]
    self.verdicts = targets.check_speed(self.rows)

  def test_ratio_of_two_variants_matches_the_hand_numbers(self):
    r = targets.ratio(self.rows[3], self.rows[1], "train")
    self.assertAlmostEqual(r["ratio"], 1.6 / 1.2, delta=0.03)
    self.assertLess(r["ci"][0], r["ratio"])
    self.assertGreater(r["ci"][1], r["ratio"])

  def test_wukong_large_targets_met(self):
    train = _verdict(self.verdicts, "wukong_large_over_bf16_mods", "wukong/large", "train")
    infer = _verdict(self.verdicts, "wukong_large_over_bf16_mods", "wukong/large", "infer")
    self.assertTrue(train["met"])
    self.assertTrue(infer["met"])
    self.assertAlmostEqual(infer["value"], 2.0 / 1.25, delta=0.04)
    plain = _verdict(self.verdicts, "wukong_large_over_bf16", "wukong/large", "train")
    self.assertIsNone(plain["met"])  # reported beside the bar, not judged
    self.assertAlmostEqual(plain["value"], 1.6, delta=0.04)

  def test_slower_loka_is_missed_with_its_ci(self):
    v = _verdict(self.verdicts, "loka_not_slower_than_bf16_mods", "dlrm/small", "train")
    self.assertFalse(v["met"])
    self.assertAlmostEqual(v["value"], 0.8 / 1.1, delta=0.03)
    self.assertLess(v["ci"][1], 0.98)
    best = _verdict(self.verdicts, "loka_at_least_best_peer", "dlrm/small", "train")
    self.assertIn("fp8_tensorwise", best["note"])
    self.assertFalse(best["met"])

  def test_an_all_bf16_plan_is_judged_by_whether_its_ci_holds_one(self):
    rng = np.random.default_rng(3)
    mods = _row("dcnv2", "small", "bf16_mods", 1.10, 1.10, rng)
    noisy = dict(_row("dcnv2", "small", "loka", 1.08, 1.10, rng), kernels=["xla_bf16"])
    noisy["train"]["speedup_ci"] = [1.0, 1.2]
    # Wide timing jitter: the same program measured twice, CI around 1.0 reaching below 0.98.
    for row in (mods, noisy):
      row["train"] = _speed(row["train"]["speedup"], rng, jitter=0.08)
    v = _verdict(targets.check_speed([mods, noisy]), "loka_not_slower_than_bf16_mods",
                 "dcnv2/small", "train")
    self.assertLess(v["ci"][0], 0.98)
    self.assertLessEqual(v["ci"][0], 1.0)
    self.assertGreaterEqual(v["ci"][1], 1.0)
    self.assertTrue(v["met"])
    self.assertIn("timing noise", v["note"])
    # Clearly slower although the same program: reported as missed, flagged.
    slow = dict(_row("dcnv2", "small", "loka", 0.8, 1.1, rng), kernels=["xla_bf16"])
    v = _verdict(targets.check_speed([mods, slow]), "loka_not_slower_than_bf16_mods",
                 "dcnv2/small", "train")
    self.assertFalse(v["met"])
    self.assertIn("measurement problem", v["note"])
    # An FP8 plan gets no such reading.
    fp8 = dict(slow, kernels=["xla_bf16", "xla_fp8_rowwise"])
    v = _verdict(targets.check_speed([mods, fp8]), "loka_not_slower_than_bf16_mods",
                 "dcnv2/small", "train")
    self.assertFalse(v["met"])
    self.assertEqual(v["note"], "")

  def test_an_all_bf16_plan_serves_the_served_bf16_mods_model(self):
    # Its export stores every site "high": the same program as served bf16+Mods, so a gap
    # between the two rows is noise (CI holds 1.0) or a measurement problem, never a verdict
    # on FP8.
    rng = np.random.default_rng(7)
    served = _row("wukong", "small", "bf16_mods_served", 1.2, 1.30, rng)
    served["infer"] = _speed(1.30, rng, jitter=0.08)
    for loka_infer, met, note in ((1.27, True, "timing noise"),
                                  (1.0, False, "measurement problem")):
      loka = dict(_row("wukong", "small", "loka", 1.2, loka_infer, rng), kernels=["xla_bf16"])
      loka["infer"] = _speed(loka_infer, rng, jitter=0.08)
      v = _verdict(targets.check_speed([served, loka]),
                   "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
      self.assertEqual(v["met"], met)
      self.assertIn(note, v["note"])
      self.assertIn("exported model", v["note"])
    # A plan with FP8 sites is judged by the bar alone.
    fp8 = dict(loka, kernels=["xla_bf16", "flax_fp8_delayed"])
    v = _verdict(targets.check_speed([served, fp8]),
                 "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
    self.assertFalse(v["met"])
    self.assertEqual(v["note"], "both infer from exported weights")

  def test_served_bf16_mods_is_the_inference_bar_beside_the_others(self):
    rng = np.random.default_rng(5)
    served = _row("wukong", "large", "bf16_mods_served", 1.2, 1.6, rng)
    verdicts = targets.check_speed(self.rows + [served])
    v = _verdict(verdicts, "loka_not_slower_than_bf16_mods_served", "wukong/large", "infer")
    self.assertAlmostEqual(v["value"], 2.0 / 1.6, delta=0.04)
    self.assertTrue(v["met"])
    over = _verdict(verdicts, "wukong_large_over_bf16_mods_served", "wukong/large", "infer")
    self.assertIsNone(over["met"])                   # reported, not judged
    # Training is the same step as bf16+Mods': no served verdict for it.
    self.assertFalse([x for x in verdicts if "served" in x["target"] and x["mode"] == "train"])
    # A LoKA that only matches bf16+Mods by storing its weights once is caught here.
    slow = _row("wukong", "large", "bf16_mods_served", 1.2, 2.3, rng)
    v = _verdict(targets.check_speed(self.rows + [slow]),
                 "loka_not_slower_than_bf16_mods_served", "wukong/large", "infer")
    self.assertFalse(v["met"])

  def test_loka_is_judged_on_its_one_interleaving_timing_where_it_has_one(self):
    # Two rows of one program whose bf16 baselines drifted apart: the ratio of rows reads
    # 0.85x, the pair timed together 1.01x. The verdict takes the pair and says so.
    rng = np.random.default_rng(11)
    served = _row("wukong", "small", "bf16_mods_served", 1.2, 1.40, rng)
    loka = dict(_row("wukong", "small", "loka", 1.2, 1.19, rng), kernels=["xla_bf16"])
    by_rows = _verdict(targets.check_speed([served, loka]),
                       "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
    self.assertAlmostEqual(by_rows["value"], 1.19 / 1.40, delta=0.02)
    self.assertFalse(by_rows["met"])
    self.assertNotIn("interleaving", by_rows["note"])
    loka["head_to_head"] = {"bf16_mods_served": {"infer": {"ratio": 1.01, "ci": [0.99, 1.03]}}}
    v = _verdict(targets.check_speed([served, loka]),
                 "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
    self.assertEqual((v["value"], v["ci"], v["met"]), (1.01, [0.99, 1.03], True))
    self.assertIn("timed in one interleaving", v["note"])
    # A pair the row lacks (train, here) still comes from the rows.
    self.assertEqual(targets.over(loka, served, "train"),
                     targets.ratio(loka, served, "train"))

  def test_a_step_that_moved_more_than_the_ci_between_its_timings_is_noted(self):
    # LoKA's own step (median 50 us in its bf16 pair) read 52-56 us in its head-to-head
    # pairs: 12% apart over four timings, against pairs whose CIs are 2% wide. Each verdict
    # timed in one interleaving says so; with the pairs at 50-51 us it says nothing.
    rng = np.random.default_rng(3)
    mods = _row("dcnv2", "large", "bf16_mods", 1.0, 1.0, rng)
    peer = _row("dcnv2", "large", "pallas_delayed", 1.8, 1.8, rng)
    loka = _row("dcnv2", "large", "loka", 2.0, 2.0, rng)
    own = float(np.median(loka["train"]["samples_us"]))
    self.assertAlmostEqual(own, 50.0, delta=1.0)
    def pairs(medians):
      return {other: {"train": {"ratio": 1.1, "ci": [1.09, 1.112], "median_us": m,
                                "other_median_us": 60.0}}
              for other, m in zip(("bf16_mods", "pallas_delayed", "bf16"), medians)}
    loka["head_to_head"] = pairs([52.0, 56.0, 54.0])
    self.assertEqual(targets.timing_spread(loka, "train"), (own, 56.0, 4))
    self.assertIsNone(targets.timing_spread(loka, "infer"))   # no pairs there
    verdicts = targets.check_speed([mods, peer, loka])
    for target in ("loka_not_slower_than_bf16_mods", "loka_at_least_best_peer",
                   "loka_over_best_single_kernel"):
      note = _verdict(verdicts, target, "dcnv2/large", "train")["note"]
      self.assertIn(f"LoKA's own step read {own / 1e3:.3g}-0.056 ms over its 4 timings in "
                    f"this call ({56.0 / own - 1:.1%} apart), wider than this CI", note)
    self.assertNotIn("own step", _verdict(verdicts, "loka_not_slower_than_bf16_mods",
                                          "dcnv2/large", "infer")["note"])
    loka["head_to_head"] = pairs([own * 1.005, own * 1.01, own])
    quiet = _verdict(targets.check_speed([mods, peer, loka]), "loka_at_least_best_peer",
                     "dcnv2/large", "train")
    self.assertEqual(quiet["note"], "best peer: pallas_delayed; timed in one interleaving")

  def test_interleaved_references_are_the_variants_the_targets_compare_with(self):
    rng = np.random.default_rng(2)
    rows = {v: _row("wukong", "small", v, train, infer, rng)
            for v, train, infer in (("bf16_mods", 1.1, 1.0), ("fp8_rowwise", 1.3, 0.9),
                                    ("flax_fp8_delayed", 1.2, 1.4), ("loka", 2.0, 2.0))}
    self.assertEqual(targets.interleaved_references("loka", rows),
                     ["bf16_mods", "fp8_rowwise", "flax_fp8_delayed"])
    rows["bf16_mods_served"] = _row("wukong", "small", "bf16_mods_served", 1.1, 1.3, rng)
    rows["fp8_rowwise"] = _row("wukong", "small", "fp8_rowwise", 1.3, 1.5, rng)
    self.assertEqual(targets.interleaved_references("loka", rows),
                     ["bf16_mods", "bf16_mods_served", "fp8_rowwise"])

  def test_over_best_single_kernel(self):
    met = _verdict(self.verdicts, "loka_over_best_single_kernel", "wukong/large", "train")
    self.assertTrue(met["met"])  # 1.6 / 1.1 = 1.45x
    missed = _verdict(self.verdicts, "loka_over_best_single_kernel", "wukong/large", "infer")
    self.assertAlmostEqual(missed["value"], 2.0 / 1.3, delta=0.05)
    self.assertTrue(missed["met"])

  def test_quality_is_judged_paired_by_seed(self):
    # Every reference at 0.4; an arm's loss 0.4 * (1 + d_s) gives the paired change d_s.
    # Three changes m - e, m, m + e: sd e, half-width t(2) e / sqrt(3), t(2) = 4.303.
    def q(arm, changes, **fields):
      return [_quality_row("wukong", "small", arm, s, 0.4 * (1 + d), **fields)
              for s, d in enumerate(changes)]
    refs = q("bf16", (0, 0, 0)) + q("bf16_mods", (0, 0, 0))

    def loka(changes, **fields):
      return _verdict(targets.check_quality(refs + q("loka", changes, **fields)),
                      "loka_quality_vs_bf16", "synthetic:wukong/small", "quality")
    # 0, 0.005%, 0.01%: mean 5e-5, upper end 5e-5 + 4.303 * 5e-5 / sqrt(3) = 1.742169e-4.
    met = loka((0.0, 5e-5, 1e-4))
    self.assertEqual((met["verdict"], met["met"], met["n"]), ("met", True, 3))
    self.assertAlmostEqual(met["value"], 5e-5, places=12)
    self.assertAlmostEqual(met["ci"][1], 1.742169e-4, places=10)
    self.assertIsNone(met["seeds_needed"])
    # -0.01%, 0, +0.01%: upper end 2.484338e-4 > 2e-4 and lower end below it. With sd 1e-4,
    # gap 2e-4: n = 3 gives 4.303 / sqrt(3) = 2.48 > 2, n = 4 gives 3.182 / 2 = 1.59 < 2.
    open_ = loka((-1e-4, 0.0, 1e-4))
    self.assertEqual((open_["verdict"], open_["met"]), ("unresolved", None))
    self.assertAlmostEqual(open_["ci"][1], 2.484338e-4, places=10)
    self.assertEqual(open_["seeds_needed"], 4)
    self.assertIn("4 paired seeds would resolve it", open_["note"])
    # 0.1%, 0.11%, 0.12%: lower end 1.1e-3 - 2.484338e-4 = 8.515662e-4 > 2e-4.
    missed = loka((1e-3, 1.1e-3, 1.2e-3))
    self.assertEqual((missed["verdict"], missed["met"]), ("missed", False))
    self.assertAlmostEqual(missed["ci"][0], 8.515662e-4, places=10)
    self.assertIn("by seed +0.100%, +0.110%, +0.120%", missed["note"])
    # Far better than bf16 is met, never a miss (a two-sided bound would miss it).
    self.assertEqual(loka((-0.01, -0.011, -0.012))["verdict"], "met")
    # A seed scored on another held-out set is no pair: seeds 0 and 1 remain.
    rows = refs + q("loka", (0.0, 5e-5)) + [_quality_row("wukong", "small", "loka", 2, 0.4,
                                                         eval_fingerprint="other")]
    two = _verdict(targets.check_quality(rows), "loka_quality_vs_bf16",
                   "synthetic:wukong/small", "quality")
    self.assertEqual(two["seeds"], [0, 1])
    self.assertIn("not paired: seed 2 (eval fingerprints differ)", two["note"])
    # A plan with no FP8 kernel is not applicable; one with an FP8 kernel is judged.
    na = loka((0.0, 0.0, 0.0), plan_kernels=["xla_bf16"])
    self.assertEqual((na["verdict"], na["met"], na["judged"]), ("not applicable", None, True))
    self.assertEqual(loka((0.0, 0.0, 0.0), plan_kernels=["flax_fp8_delayed", "xla_bf16"])
                     ["verdict"], "met")
    # The peers are judged by the same rule beside LoKA, not as targets; one seed is
    # unresolved with no seed count.
    rows = refs + q("fp8_naive", (1e-3, 1.1e-3, 1.2e-3)) + q("fp8_delayed", (5e-5,))
    naive = _verdict(targets.check_quality(rows), "fp8_naive_quality_vs_bf16_mods",
                     "synthetic:wukong/small", "quality")
    self.assertEqual((naive["verdict"], naive["met"], naive["judged"]),
                     ("missed", None, False))
    one = _verdict(targets.check_quality(rows), "fp8_delayed_quality_vs_bf16",
                   "synthetic:wukong/small", "quality")
    self.assertEqual((one["verdict"], one["n"], one["ci"], one["seeds_needed"]),
                     ("unresolved", 1, None, None))
    self.assertIn("one paired seed measures no spread", one["note"])
    table = tables.quality_verdicts_table(targets.check_quality(rows))
    self.assertIn("| synthetic:wukong/small | naive FP8 | bf16 | 3 | +0.110% | "
                  "[+0.085%, +0.135%] | missed (peer) | - |", table)
    self.assertIn("| Flax delayed everywhere | bf16+Mods | 1 | +0.005% | - | unresolved "
                  "(peer) | >= 2 (no spread yet) |", table)

  def test_quality_compares_rows_of_one_recipe(self):
    def q(arm, seed, logloss, warmup=None):
      # LoKA's rows name their plan's FP8 kernel: scores equal to bf16+Mods' are a result.
      return _quality_row("dlrm", "large", arm, seed, logloss,
                          **({} if warmup is None else {"warmup_steps": warmup}),
                          **({"plan_kernels": ["xla_fp8_rowwise"]} if arm == "loka" else {}))
    # Plain recipe: LoKA 1% worse at both seeds (missed). Warm-up recipe: its own arms, LoKA
    # equal at both (met); mixing the two would pair LoKA-with-warm-up against plain bf16.
    rows = [q(a, s, 0.5) for a in ("bf16", "bf16_mods") for s in (0, 1)]
    rows += [q("loka", s, 0.505) for s in (0, 1)]
    rows += [q(a, s, 0.47, 50) for a in ("bf16", "bf16_mods", "loka") for s in (0, 1)]
    verdicts = targets.check_quality(rows)
    plain = _verdict(verdicts, "loka_quality_vs_bf16_mods", "synthetic:dlrm/large", "quality")
    self.assertEqual(plain["verdict"], "missed")
    self.assertAlmostEqual(plain["value"], 0.01, places=12)
    warm = _verdict(verdicts, "loka_quality_vs_bf16_mods", "synthetic:dlrm/large (warmup 50)",
                    "quality")
    self.assertEqual((warm["verdict"], warm["value"], warm["n"]), ("met", 0.0, 2))
    table = tables.quality_table(rows)
    self.assertIn("| synthetic | dlrm | large (warmup 50) | loka | 0,1 | 0.47000 |", table)
    self.assertIn("| synthetic | dlrm | large | loka | 0,1 | 0.50500 |", table)
    self.assertIn("dlrm/large (warmup 50)", tables.glance_table(verdicts))
    with self.assertRaisesRegex(ValueError, "warmup_steps must be in"):
      quality.QualitySettings(steps=10, warmup_steps=11)
    # A clipped recipe is a subject of its own too.
    clipped = [q(a, s, 0.471, 50) | {"clip_norm": 1.0} for a in ("bf16", "bf16_mods")
               for s in (0, 1)] + [q("loka", s, 0.4719, 50) | {"clip_norm": 1.0} for s in (0, 1)]
    clip = _verdict(targets.check_quality(rows + clipped), "loka_quality_vs_bf16_mods",
                    "synthetic:dlrm/large (warmup 50, clip 1)", "quality")
    self.assertEqual(clip["verdict"], "missed")
    self.assertAlmostEqual(clip["value"], 0.0009 / 0.471, places=12)
    with self.assertRaisesRegex(ValueError, "clip_norm must be > 0"):
      quality.QualitySettings(clip_norm=0.0)

  def test_a_quality_verdict_over_seeds_names_each_seed_and_its_worst_steps(self):
    # LoKA's mean change rests on seed 2, where its run spiked (as DCNv2 `large`'s did).
    def q(arm, seed, logloss, peak):
      return _quality_row("dcnv2", "large", arm, seed, logloss, warmup_steps=50,
                          peak_loss=peak, peak_step=100 + seed)
    rows = [q("bf16", s, 0.4770 + 0.0001 * s, 0.69) for s in range(3)]
    rows += [q("bf16_mods", 0, 0.4766, 0.70), q("bf16_mods", 1, 0.4776, 0.71),
             q("bf16_mods", 2, 0.4847, 5.65)]
    rows += [q("loka", 0, 0.4778, 0.72), q("loka", 1, 0.4766, 0.70), q("loka", 2, 0.5036, 6.91)]
    loka = _verdict(targets.check_quality(rows), "loka_quality_vs_bf16_mods",
                    "synthetic:dcnv2/large (warmup 50)", "quality")
    # 0.4778 / 0.4766 - 1 = +0.252%, 0.4766 / 0.4776 - 1 = -0.209%, 0.5036 / 0.4847 - 1 =
    # +3.899%
    self.assertIn("by seed +0.252%, -0.209%, +3.899%", loka["note"])
    self.assertIn("worst step's training loss by seed loka 0.72, 0.7, 6.91; "
                  "bf16_mods 0.7, 0.71, 5.65", loka["note"])
    self.assertIn("| synthetic | dcnv2 | large (warmup 50) | loka | 0,1,2 | 0.48600 | ",
                  tables.quality_table(rows))
    self.assertIn("| 6.91 (seed 2) |", tables.quality_table(rows))
    # Rows from before the worst step was kept: the seeds' changes only.
    old = [{k: v for k, v in r.items() if k not in ("peak_loss", "peak_step")} for r in rows]
    note = _verdict(targets.check_quality(old), "loka_quality_vs_bf16_mods",
                    "synthetic:dcnv2/large (warmup 50)", "quality")["note"]
    self.assertIn("by seed +0.252%", note)
    self.assertNotIn("worst step", note)
    self.assertNotIn("(seed 2)", tables.quality_table(old))


class RenderTest(absltest.TestCase):

  def test_tables_and_plots_from_hand_rows(self):
    rng = np.random.default_rng(3)
    rows = [_row("tower", "4096x256x8", v, s, s, rng, "towers")
            for v, s in (("bf16", 1.0), ("bf16_mods", 1.1), ("loka", 1.3))]
    rows.append({"suite": "towers", "model": "tower", "preset": "4096x256x8",
                 "variant": "pallas", "device": "H100", "error": "ValueError: boom"})
    rows += [{"suite": "quality", "data": "movielens", "model": "wukong", "preset": "tiny",
              "arm": a, "seed": s, "device": "H100", "logloss": 0.5 + 0.001 * s + d,
              "ne": 0.9, "auc": 0.75} for a, d in (("bf16", 0), ("loka", 0.0005)) for s in range(3)]
    verdicts = targets.check_all(rows)
    text = tables.report(rows, verdicts)
    self.assertIn("| tower | 4096x256x8 | LoKA | 4096 |", text)
    self.assertIn("1.30 [1.29, 1.31]", text)
    self.assertIn("error: ValueError: boom", text)
    self.assertIn("| movielens | wukong | tiny | loka | 0,1,2 | 0.50150 |", text)
    # d_s = 0.0005 / (0.5 + 0.001 s): 0.1%, 0.0998%, 0.0996%, mean +0.100%, all far above
    # +0.02%: missed.
    self.assertIn("| movielens:wukong/tiny | LoKA | bf16 | 3 | +0.100% |", text)
    self.assertIn("| missed | - |", text)
    out = _tempdir(self)
    paths = plots.write_plots(rows, out)
    self.assertEqual(sorted(os.path.basename(p) for p in paths),
                     ["quality_paired.png", "speedup_towers.png"])
    for p in paths:
      with open(p, "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


  def test_training_curves_are_drawn_from_the_runs_found(self):
    # Two comparisons: DCNv2 `large` with the warm-up, whose runs are on disk (seed 2's LoKA
    # run spikes), and DLRM `small`, whose runs are not.
    rows = [_quality_row("dcnv2", "large", a, s, 0.48, warmup_steps=50)
            for a in ("bf16", "bf16_mods", "loka") for s in range(3)]
    rows += [_quality_row("dlrm", "small", a, 0, 0.47) for a in ("bf16", "loka")]
    empty, root = _tempdir(self), _tempdir(self)
    for r in rows[:9]:
      run = quality.run_dir(root, r)
      os.makedirs(run)
      spike = r["arm"] == "loka" and r["seed"] == 2
      with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step in (50, 100, 150):
          loss = 6.9 if spike and step == 100 else 0.6 - 0.0004 * step
          f.write(json.dumps({"step": step, "loss": loss, "max_loss": loss + 0.05}) + "\n")
    curve = quality.read_curve(quality.run_dir(root, rows[8]))
    self.assertEqual(curve["loss"][1], 6.9)
    self.assertEqual(curve["max_loss"][1], 6.95)
    self.assertIsNone(quality.read_curve(quality.run_dir(empty, rows[8])))
    out = _tempdir(self)
    paths = plots.write_plots(rows, out, quality_runs=[empty, root])
    self.assertEqual(sorted(os.path.basename(p) for p in paths),
                     ["curves_synthetic_dcnv2_large_warmup_50.png", "quality_paired.png"])
    with open(os.path.join(out, "curves_synthetic_dcnv2_large_warmup_50.png"), "rb") as f:
      png = f.read()
    self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")
    # Three seeds, three panels: wider than one panel's figure would be.
    self.assertGreater(int.from_bytes(png[16:20], "big"), 3 * 4.2 * 110 * 0.9)
    self.assertEqual(set(plots.ARM_COLORS), set(quality.ARMS))


  def test_half_descent_step_interpolates_between_the_logged_windows(self):
    # Straight down: half-way between 0.6 and 0.4 is the middle window itself.
    self.assertEqual(quality.half_descent_step([50, 100, 150], [0.6, 0.5, 0.4]), 100.0)
    # A plateau, then the drop: half-way (0.6) is 3/7 of the way from step 20 to step 30.
    self.assertAlmostEqual(quality.half_descent_step([0, 10, 20, 30], [1.0, 0.9, 0.9, 0.2]),
                           20 + 30 / 7)
    # A spike above the start changes nothing before the descent.
    self.assertAlmostEqual(quality.half_descent_step([0, 10, 20, 30], [1.0, 3.0, 0.9, 0.2]),
                           20 + 30 / 7)
    for flat in ([1.0, 1.0], [0.5, 0.7], [0.5], [], [float("nan"), 0.4]):
      self.assertIsNone(quality.half_descent_step(list(range(len(flat))), flat), flat)

  def test_runs_are_timed_to_one_mark_whatever_their_first_window(self):
    # Two runs leave a shared plateau (0.56) at steps 200 and 300; one started higher, which
    # moved its own half-way mark up onto the plateau and made it read early.
    steps = [50, 100, 150, 200, 250, 300, 350, 500]
    high = [0.66, 0.56, 0.56, 0.56, 0.56, 0.56, 0.49, 0.48]
    low = [0.62, 0.56, 0.56, 0.56, 0.50, 0.49, 0.485, 0.48]
    self.assertLess(quality.half_descent_step(steps, high),
                    quality.half_descent_step(steps, low))
    mark = quality.descent_mark([{"loss": high}, {"loss": low}])
    self.assertAlmostEqual(mark, 0.48 + 0.25 * (0.64 - 0.48))
    self.assertGreater(quality.descent_step(steps, high, mark),
                       quality.descent_step(steps, low, mark))
    self.assertEqual(quality.descent_step(steps, low, 0.7), 50.0)   # starts below it
    self.assertIsNone(quality.descent_step(steps, low, 0.3))        # never gets there
    self.assertIsNone(quality.descent_step([0, 1], [float("nan"), 0.4], 0.5))
    self.assertIsNone(quality.descent_mark([{"loss": [0.5, 0.6]}, {"loss": [0.5]}]))

  def test_the_curves_table_orders_runs_by_held_out_loss_beside_when_they_came_down(self):
    # Wukong `large`-like: three runs on disk, the one that leaves the plateau late holds the
    # worst held-out loss; a fourth run is not on disk and is left out.
    rows = [_quality_row("wukong", "large", "bf16", 0, 0.4779, warmup_steps=50),
            _quality_row("wukong", "large", "bf16_mods", 0, 0.4812, warmup_steps=50),
            _quality_row("wukong", "large", "loka", 0, 0.4772, warmup_steps=50),
            _quality_row("wukong", "large", "bf16", 1, 0.4807, warmup_steps=50)]
    root = _tempdir(self)
    losses = {"bf16": [0.63, 0.56, 0.54, 0.48], "bf16_mods": [0.64, 0.57, 0.58, 0.48],
              "loka": [0.63, 0.53, 0.50, 0.48]}
    for r in rows[:3]:
      run = quality.run_dir(root, r)
      os.makedirs(run)
      with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step, loss in zip((50, 100, 150, 500), losses[r["arm"]]):
          f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    table = tables.curves_table(rows, [_tempdir(self), root])
    lines = table.splitlines()[2:]
    self.assertEqual([l.split(" | ")[1] for l in lines], ["loka", "bf16", "bf16_mods"])
    # One mark for all three: a quarter of their mean descent (0.6333 -> 0.48) left.
    mark = 0.48 + 0.25 * ((0.63 + 0.64 + 0.63) / 3 - 0.48)
    self.assertEqual({l.split(" | ")[5] for l in lines}, {f"{mark:.4f}"})
    steps = [float(l.split(" | ")[4]) for l in lines]
    self.assertEqual(steps, sorted(steps))
    # bf16_mods reaches the mark only past its step-150 bump, between steps 150 and 500.
    self.assertEqual(lines[2].split(" | ")[4], f"{150 + 350 * (0.58 - mark) / 0.10:.0f}")
    # loka between steps 100 (0.53) and 150 (0.50).
    self.assertEqual(lines[0].split(" | ")[4], f"{100 + 50 * (0.53 - mark) / 0.03:.0f}")
    self.assertIn("| 0.6400 (50) |", lines[2])
    self.assertIn("| 0.4800 (500) | 0.48120 |", lines[2])
    self.assertEqual(tables.curves_table(rows, [_tempdir(self)]), "")
    verdicts = targets.check_all(rows)
    self.assertIn("### Training curves", tables.report(rows, verdicts, [root]))
    self.assertNotIn("### Training curves", tables.report(rows, verdicts))


class BaselineDriftTest(absltest.TestCase):

  def _rows(self, rng):
    return [_row("dlrm", "large", v, s, s, rng)
            for v, s in (("bf16", 1.0), ("bf16_mods", 1.0), ("fp8_tensorwise", 0.98),
                         ("flax_fp8_delayed", 0.97))]

  def test_a_pair_whose_bf16_ran_fast_is_marked_and_explained(self):
    rows = self._rows(np.random.default_rng(5))
    drifted = rows[3]["train"]
    drifted["baseline_samples_us"] = [0.8 * us for us in drifted["baseline_samples_us"]]
    drift = tables.baseline_drift(rows)
    self.assertAlmostEqual(drift[(3, "train")], -0.2, delta=0.02)
    self.assertLess(abs(drift[(3, "infer")]), 0.05)
    self.assertLess(max(abs(drift[(i, "train")]) for i in range(3)), 0.05)
    text = tables.speed_table(rows, "models")
    marked = [line for line in text.splitlines() if tables.DRIFT_MARK in line]
    self.assertLen(marked, 2)   # the ratio cell and its note
    self.assertIn("| Flax FP8 (delayed) |", marked[0])
    self.assertRegex(marked[1], r"dlrm/large Flax FP8 \(delayed\), train: bf16 ran 2\d% faster")

  def test_too_few_pairs_or_different_timing_are_not_compared(self):
    rows = self._rows(np.random.default_rng(6))[:2]
    rows[1]["train"]["baseline_samples_us"] = [0.5 * us for us in
                                               rows[1]["train"]["baseline_samples_us"]]
    self.assertEqual(tables.baseline_drift(rows), {})
    rows = self._rows(np.random.default_rng(7))
    for r in rows[:2]:
      r["min_call_s"] = 0.02   # timed with longer calls: a group of two
    rows[0]["train"]["baseline_samples_us"] = [0.5 * us for us in
                                               rows[0]["train"]["baseline_samples_us"]]
    self.assertNotIn(tables.DRIFT_MARK, tables.speed_table(rows, "models"))


class VariantColourTest(absltest.TestCase):

  def test_every_variant_has_its_own_colour(self):
    from matplotlib.colors import to_rgba
    colours = [to_rgba(plots.variant_color(v)) for v in variants.VARIANTS]
    self.assertLen(set(colours), len(variants.VARIANTS))

  def test_the_plot_draws_each_variant_in_its_colour(self):
    rows = [{"suite": "towers", "model": "tower", "preset": "4096x256x8", "variant": v,
             "device": "H100", **{m: {"speedup": 1.0 + 0.1 * i, "speedup_ci": [0.9, 2.5]}
                                   for m in ("train", "infer")}}
            for i, v in enumerate(variants.VARIANTS)]
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba
    saved = {}
    real_savefig = plt.Figure.savefig

    def keep_figure(fig, *args, **kwargs):
      saved["fig"] = fig
      return real_savefig(fig, *args, **kwargs)

    with mock.patch.object(plt.Figure, "savefig", keep_figure):
      plots.speedup_plot(rows, "towers", os.path.join(_tempdir(self), "s.png"))
    handles, labels = saved["fig"].axes[0].get_legend_handles_labels()
    face = {label: to_rgba(h.patches[0].get_facecolor()) for h, label in zip(handles, labels)}
    self.assertLen(set(face.values()), len(variants.VARIANTS))
    self.assertEqual(face[variants.LABELS["loka"]], to_rgba("k"))


class TickLabelTest(absltest.TestCase):

  def test_a_long_subject_breaks_after_a_plus_or_space_and_keeps_every_character(self):
    subject = ("synthetic:dcnv2/large (warmup 50) "
               "(Mods no_bias+blocknorm+hard_swish+keep_bias:top_mlp/dense_2)")
    label = plots.tick_label(subject, width=36)
    lines = label.split("\n")
    self.assertGreater(len(lines), 1)
    self.assertEqual("".join(lines).replace(" ", ""), subject.replace(" ", ""))
    for line in lines[:-1]:
      self.assertRegex(line, r"[+)0-9]$")  # broken after a '+' or a space, never in a word
    self.assertTrue(all(len(line) <= 36 for line in lines), lines)

  def test_a_short_subject_stays_on_one_line(self):
    self.assertEqual(plots.tick_label("dlrm/large (Mods no_bias+blocknorm)", width=36),
                     "dlrm/large (Mods no_bias+blocknorm)")


class GemmCallsTest(absltest.TestCase):

  def test_every_gemm_backend_of_a_gpu_hlo_is_counted(self):
    from experiments.bench.speed import gemm_calls
    # Lines in the form of an H100 step's optimized HLO (custom-call targets, fusion kinds).
    hlo = "\n".join([
        '%a = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul"',
        '%b = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul$f8"',
        '%c = bf16[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}',
        '%d = bf16[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        '%e = f32[64,32]{1,0} custom-call(%x, %w), custom_call_target="__gpu$xla.gpu.triton"',
    ])
    self.assertEqual(gemm_calls(hlo), {"cublaslt": 1, "cublaslt_fp8": 1, "xla_triton_gemm": 2,
                                       "pallas_triton": 1})


class SelectionTest(absltest.TestCase):

  def test_plans_are_validated_on_up_to_16_batches_of_held_out_examples(self):
    (wukong,) = suite.model_targets(["wukong"], ["large"])
    self.assertEqual(wukong.batch(), 4096)
    self.assertEqual(wukong.run_spec().num_eval, 65536)
    (big, small) = suite.tower_targets(["16384x4096x4", "32x16x2"])
    self.assertEqual(big.plan_eval_examples(), 65536)       # 4 batches
    self.assertEqual(small.plan_eval_examples(), 16 * 32)   # 16 batches
    _, source, _ = small.probe_build()(small.run_spec())
    self.assertEqual(source.num_eval_examples(), 512)

  def test_only_filters_targets(self):
    ts = suite.tower_targets(["64x32x2", "128x64x2"]) + suite.model_targets(
        ["dlrm", "wukong"], ["small", "large"])
    self.assertEqual([t.name for t in suite.selected(ts, ["wukong/large", "128x64x2"])],
                     ["tower/128x64x2", "wukong/large"])
    self.assertEqual([t.name for t in suite.selected(ts, ["dlrm"])],
                     ["dlrm/small", "dlrm/large"])
    self.assertLen(suite.selected(ts, []), 6)

  def test_variants_parse_puts_bf16_first_and_rejects_unknown(self):
    self.assertEqual([v.name for v in variants.parse_variants(["loka", "bf16_mods"])],
                     ["bf16", "loka", "bf16_mods"])
    with self.assertRaisesRegex(ValueError, "fp9"):
      variants.parse_variants(["fp9"])

  def test_tower_shape_parse(self):
    s = towers.TowerShape.parse("16384x4096x4")
    self.assertEqual((s.batch, s.width, s.depth), (16384, 4096, 4))
    self.assertEqual(s.flops_per_example(), 2 * 4096 * 4096 * 4 + 2 * 4096)
    with self.assertRaisesRegex(ValueError, "BxWIDTHxDEPTH"):
      towers.TowerShape.parse("4096x256")

  def test_quality_eval_size_and_runs(self):
    self.assertEqual(quality.num_eval_for(200_000, 4096), 200_704)  # 49 x 4096
    settings = quality.QualitySettings(arms=("bf16", "loka"), noise_seeds=(1, 2))
    self.assertEqual([(a.name, s) for a, s in quality.runs(settings)],
                     [("bf16", 0), ("loka", 0), ("bf16", 1), ("bf16", 2)])
    ml = quality.QualitySettings(data="movielens", arms=("bf16",), seeds=tuple(range(5)))
    self.assertLen(quality.runs(ml), 5)


class ValidationFromInitTest(absltest.TestCase):

  def test_a_target_probed_for_its_plan_is_validated_from_init_as_asked(self):
    # `--validation_from_init_steps`, its warm-up, clipping and seeds reach the validation of the
    # plan the suite makes.
    (target,) = suite.tower_targets(["64x32x2"])
    plans = tempfile.mkdtemp(prefix="loka_bench_from_init_")
    for steps, warmup, clip, seeds, on in ((0, None, None, 1, False),
                                           (7, 3, 0.5, 2, True)):
      settings = suite.SpeedSettings(plans_dir=plans, validation_from_init_steps=steps,
                                     validation_from_init_warmup_steps=warmup,
                                     validation_from_init_clip_norm=clip,
                                     validation_from_init_seeds=seeds,
                                     validation_from_init_quality_bound=on,
                                     validation_held_out_one_program=on,
                                     validation_gradient_one_program=on,
                                     validation_shadow_windows=seeds + 1,
                                     validation_shadow_noise_floor=on,
                                     validation_promotion_per_sort=seeds + 2,
                                     validation_stalled_fraction=0.05 * seeds,
                                     validation_shadow_warmup_steps=warmup,
                                     validation_shadow_steps=steps)
      with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
        suite._probe_for_plan(target, settings,
                              deadline=time.time() + 600, log=lambda line: None)
      validation = probe_and_plan.call_args.kwargs["validation"]
      self.assertEqual((validation.from_init_steps, validation.from_init_warmup_steps,
                        validation.from_init_clip_norm, validation.from_init_seeds,
                        validation.from_init_quality_bound, validation.held_out_one_program,
                        validation.gradient_one_program, validation.shadow_windows,
                        validation.shadow_noise_floor, validation.promotion_per_sort,
                        validation.stalled_fraction, validation.shadow_warmup_steps,
                        validation.shadow_steps),
                       (steps, warmup, clip, seeds, on, on, on, seeds + 1,
                        on, seeds + 2, 0.05 * seeds, warmup, steps))

  def test_the_suites_validation_defaults_are_the_configs(self):
    # A setting not given on the command line leaves the check as `ValidationConfig` has it
    # (the shadow check's 200 steps among them).
    from loka_jax.dispatch.validate import ValidationConfig
    self.assertEqual(suite.SpeedSettings().validation(), ValidationConfig())

  def test_the_probes_timing_floor_compile_threads_and_wgrad_bar_reach_its_options(self):
    (target,) = suite.tower_targets(["64x32x2"])
    plans = tempfile.mkdtemp(prefix="loka_bench_floor_")
    for floor, workers, wgrad in ((0.0, None, None), (2.5, 0, -3.0)):
      settings = suite.SpeedSettings(plans_dir=plans, probe_min_timing_gflops=floor,
                                     probe_compile_workers=workers,
                                     select_min_sqnr_wgrad_db=wgrad)
      with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
        suite._probe_for_plan(target, settings,
                              deadline=time.time() + 600, log=lambda line: None)
      options = probe_and_plan.call_args.kwargs["probe_options"]
      self.assertEqual((options.min_timing_gflops, options.compile_workers), (floor, workers))
      self.assertEqual(probe_and_plan.call_args.kwargs["criteria_changes"],
                       None if wgrad is None else {"min_sqnr_wgrad_db": wgrad})


class QualityPlanMakerTest(absltest.TestCase):

  def test_every_quality_seed_probes_one_run_with_the_suites_probe_options(self):
    # The quality suite makes a missing plan with the speed suite's probe options (the
    # carried timing cache above all: without it every site is timed again) and at the
    # probe seed, whatever the quality seed: each seed's invocation resumes the same probe.
    out = _tempdir(self)
    settings = suite.SpeedSettings(plans_dir=os.path.join(out, "plans"), probe_steps=7,
                                   probe_samples=5, probe_kernels=("xla_bf16", "xla_fp8_rowwise"),
                                   probe_timing_cache=os.path.join(out, "tc"),
                                   probe_compile_workers=3, probe_timing_compile_workers=2,
                                   probe_min_timing_gflops=1.5, validation_from_init_steps=9,
                                   probe_seed=4)
    calls = []
    for seed in (0, 2):
      qs = quality.QualitySettings(preset="tiny", seed=seed, batch_size=64,
                                   plans_dir=os.path.join(out, "plans"),
                                   mods=("no_bias", "blocknorm"))
      with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
        suite.quality_plan_maker(qs, settings, deadline=time.time() + 600)("dlrm")
      calls.append(probe_and_plan.call_args)
    for call in calls:
      spec, workdir = call.args
      options, config = call.kwargs["probe_options"], call.kwargs["train_config"]
      self.assertEqual((spec.model, spec.preset, spec.mods, spec.seed, config.seed),
                       ("dlrm", "tiny", ("no_bias", "blocknorm"), 4, 4))
      self.assertEqual((config.steps, config.batch_size), (7, 64))
      self.assertEqual((options.samples, options.kernels, options.timing_cache,
                        options.compile_workers, options.timing_compile_workers,
                        options.min_timing_gflops),
                       (5, ("xla_bf16", "xla_fp8_rowwise"), os.path.join(out, "tc"), 3, 2, 1.5))
      self.assertEqual(call.kwargs["validation"].from_init_steps, 9)
      self.assertEqual(workdir, planning.plan_dir(qs.plans_root, "dlrm", "tiny"))
    self.assertNotIn("default", calls[0].args[1])  # the set's own folder
    self.assertIn("mods_", calls[0].args[1])

  def test_a_loka_arm_waiting_for_its_plan_leaves_the_model_unfinished(self):
    # A probe that ran out of budget returns no plan: the model's rows are not done (the
    # bench must not print "all selected rows are done", nor a queue move on); the next run
    # with the plan made records the LoKA row.
    out = _tempdir(self)
    settings = quality.QualitySettings(preset="tiny", steps=2, batch_size=64, min_eval=64,
                                       noise_seeds=(), arms=("bf16_mods", "loka"),
                                       plans_dir=os.path.join(out, "plans"))
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    logs = []
    self.assertFalse(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                       device="cpu", log=logs.append,
                                       plan_maker=lambda model: None))
    self.assertEqual([r["arm"] for r in results.rows()], ["bf16_mods"])
    self.assertTrue(any("loka seed 0: left for a later run, no plan at" in line
                        for line in logs), logs)

    def plan_made(model):
      path = planning.plan_path(settings.plans_root, model, settings.preset)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      dispatch.save_plan({"schema": "loka.plan/1", "sites": {},
                          "default": {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}},
                         path)
      return path
    self.assertTrue(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                      device="cpu", log=logs.append, plan_maker=plan_made))
    self.assertEqual([r["arm"] for r in results.rows()], ["bf16_mods", "loka"])

  def test_a_run_folder_with_other_settings_is_not_recorded_and_forget_rows_clears_it(self):
    # A row forgotten without its run folder leaves a run the next settings cannot resume:
    # the arm is refused, left unrecorded and the model unfinished (recorded as an error row
    # it would read as done). `forget` moves the folder with the row, and the arm runs.
    out = _tempdir(self)
    path = os.path.join(out, "quality.jsonl")
    root = os.path.join(out, quality.RUNS_FOLDER)

    def settings(batch):
      return quality.QualitySettings(preset="tiny", steps=2, batch_size=batch, min_eval=64,
                                     noise_seeds=(), arms=("bf16",),
                                     plans_dir=os.path.join(out, "plans"))

    def run(batch, logs):
      results = ResultsFile(path, quality.KEY_FIELDS)
      done = quality.run_model("dlrm", settings(batch), results, root, deadline=float("inf"),
                               device="cpu", log=logs.append)
      return done, [(r["arm"], r.get("batch_size"), "error" in r)
                    for r in ResultsFile(path, quality.KEY_FIELDS).rows()]

    self.assertEqual(run(64, []), (True, [("bf16", 64, False)]))
    with open(path, "w"):  # the row forgotten by hand, its folder left
      pass
    logs = []
    self.assertEqual(run(32, logs), (False, []))
    self.assertTrue(any("not run: run directory" in line and "forget_rows" in line
                        for line in logs), logs)
    self.assertEqual(run(64, []), (True, [("bf16", 64, False)]))   # its own settings resume
    forget.forget(out, suite="quality", model="dlrm", preset="tiny", names=["bf16"])
    self.assertEqual(run(32, []), (True, [("bf16", 32, False)]))

  def test_the_speed_suites_probe_runs_at_the_probe_seed_too(self):
    (target,) = suite.tower_targets(["64x32x2"])
    spec, config = suite.probe_run(target, suite.SpeedSettings(seed=3, probe_seed=5))
    self.assertEqual((spec.seed, config.seed), (5, 5))

  def test_no_probe_starts_too_close_to_the_deadline(self):
    qs = quality.QualitySettings(preset="tiny")
    with mock.patch("loka_jax.dispatch.pipeline.probe_and_plan") as probe_and_plan:
      got = suite.quality_plan_maker(qs, suite.SpeedSettings(),
                                     deadline=time.time() + suite.MIN_PROBE_BUDGET_S - 5)("dlrm")
    self.assertIsNone(got)
    probe_and_plan.assert_not_called()


class TowerSourceTest(chex.TestCase):
  """The towers' data: pure in (task_seed, seed, step), heavy-tailed inputs with the
  per-channel scales, labels that follow the hidden teacher."""

  def test_batches_are_a_pure_function_of_seed_and_step(self):
    # `a` and `other` hold 4 held-out batches, `b` the default: the train batches depend on the
    # seed and the step alone, not on the held-out size.
    a = towers.TowerSource(32, seed=1, num_eval=256)
    b = towers.TowerSource(32, seed=1)
    np.testing.assert_array_equal(a.train_batch(3, 64)["dense"], b.train_batch(3, 64)["dense"])
    self.assertFalse(np.array_equal(a.train_batch(3, 64)["dense"],
                                    a.train_batch(4, 64)["dense"]))
    other = towers.TowerSource(32, seed=2, num_eval=256)
    self.assertFalse(np.array_equal(a.train_batch(3, 64)["dense"],
                                    other.train_batch(3, 64)["dense"]))
    # The held-out set is the task's, the same for every seed.
    for x, y in zip(a.eval_batches(64), other.eval_batches(64)):
      np.testing.assert_array_equal(x["dense"], y["dense"])

  def test_inputs_are_heavy_tailed_and_labels_follow_the_teacher(self):
    source = towers.TowerSource(64, num_eval=8192)
    batch = source.train_batch(0, 8192)
    chex.assert_shape(batch["dense"], (8192, 64))
    self.assertEqual(batch["dense"].dtype, np.float32)
    z = (batch["dense"] / source._scale).astype(np.float64)
    self.assertAlmostEqual(z.std(), np.sqrt(5 / 3), delta=0.05)  # t(5): variance 5/3
    self.assertGreater(np.mean(z ** 4) / np.mean(z ** 2) ** 2, 4.0)  # a normal gives 3
    # The teacher's logit, recomputed here in NumPy, predicts the labels.
    logit = np.tanh(z @ source._w1) @ source._w2 * 0.5
    labels = batch["label"]
    self.assertTrue(set(np.unique(labels)) <= {0.0, 1.0})
    self.assertGreater(labels[logit > 1].mean() - labels[logit < -1].mean(), 0.3)


class SharedStateTest(chex.TestCase):

  def test_variants_thread_one_state_and_keep_their_fp8_meta(self):
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0)
    base = bench.set_baseline(towers.build_tower(shape, SiteConfig.for_precision("bf16")))
    mods = bench.add("bf16_mods", towers.build_tower(
        shape, SiteConfig.for_precision("bf16"), ("all",)))
    flax_arm = bench.add("flax", towers.build_tower(
        shape, SiteConfig.for_precision("fp8_all", kernel="flax_fp8_delayed")))
    self.assertTrue(mods.info["shared_state"])
    self.assertTrue(flax_arm.info["shared_state"])
    before = int(bench.holder["shared"].step)
    for arm in (base, mods, flax_arm, flax_arm):
      arm.train()
    self.assertEqual(int(bench.holder["shared"].step), before + 4)
    self.assertEqual(bench.holder["shared"].fp8_meta, bench.holder["empty_meta"])
    chex.assert_shape(np.asarray(flax_arm.infer()), (32,))


class InnerStepsTest(chex.TestCase):

  def test_steps_per_timed_call_are_chosen_per_mode(self):
    # A train step above min_call_s runs once a call; an inference step 50x shorter runs
    # often enough to reach it. The single-call times are fixed here (the numerics are not).
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    bench = suite.speed.TargetBench(batch, min_call_s=1e-3)
    one_call = {"train_call": 5e-3, "infer_call": 1e-4}
    with mock.patch.object(suite.speed.timing, "call_seconds",
                           lambda call: one_call[call.__name__]):
      base = bench.set_baseline(towers.build_tower(shape, SiteConfig.for_precision("bf16")))
    self.assertEqual(bench.inner, {"train": 1, "infer": 10})
    self.assertEqual(base.info["inner"], {"train": 1, "infer": 10})
    mods = bench.add("bf16_mods", towers.build_tower(
        shape, SiteConfig.for_precision("bf16"), ("all",)))
    before = int(bench.holder["shared"].step)
    mods.train()
    self.assertEqual(int(bench.holder["shared"].step), before + 1)
    chex.assert_shape(np.asarray(mods.infer()), (32,))
    before = int(bench.holder["shared"].step)
    timed = bench.time_pair(mods, repeats=3)
    # Steps per timed sample: 4 train calls back to back; one inference call of 10 steps.
    self.assertEqual((timed["train"]["inner"], timed["infer"]["inner"]), (4, 10))
    self.assertEqual(mods.info["calls_per_sample"], {"train": 4, "infer": 1})
    # bf16 and bf16+Mods thread one state: 3 warm-up calls each, then 3 samples of 4 calls.
    self.assertEqual(int(bench.holder["shared"].step), before + 2 * (3 + 3 * 4))

  def test_one_train_call_a_sample_when_asked_and_none_refused(self):
    shape = towers.TowerShape(32, 16, 2)
    batch = towers.TowerSource(16).train_batch(0, 32)
    with self.assertRaisesRegex(ValueError, "train_calls must be >= 1"):
      suite.speed.TargetBench(batch, train_calls=0)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0, train_calls=1)
    base = bench.set_baseline(towers.build_tower(shape, SiteConfig.for_precision("bf16")))
    before = int(bench.holder["shared"].step)
    timed = bench.time_pair(base, repeats=2)
    self.assertEqual(timed["train"]["inner"], 1)
    self.assertEqual(int(bench.holder["shared"].step), before + 3 + 2)


class AllBf16PlanTest(absltest.TestCase):
  """A LoKA plan of bf16 at every site trains with bf16+Mods' own program, so a gap between
  the two arms' train steps is the timing's, not the plan's (Wukong `small`, H200: 0.986)."""

  def test_its_train_step_compiles_to_the_bf16_mods_program(self):
    target = suite.model_targets(["wukong"], ["tiny"], 64)[0]
    batch = target.source(0).train_batch(0, 64)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0)
    bench.set_baseline(target.build(SiteConfig.for_precision("bf16")))
    sites = site_products(target.build(SiteConfig.for_precision("bf16"), ("all",)), None, batch)
    plan = KernelPlan(sites=tuple((name, KernelChoice()) for name in sites))  # as a plan file
    arms = {v.name: bench.add(v.name, target.build(
                suite.speed.site_config(v, plan if v.name == "loka" else None), v.mods))
            for v in variants.parse_variants(["bf16_mods", "loka"])}

    def program(arm):  # without source locations (metadata and the tables they index)
      text = re.sub(r", metadata=\{[^}]*\}", "", arm.hlo["train"])
      return [line for line in text.splitlines() if not re.match(r"\d+ [\"{]", line)]

    self.assertGreater(len(program(arms["loka"])), 100)
    self.assertEqual(program(arms["bf16_mods"]), program(arms["loka"]))


class ExportedInferenceTest(chex.TestCase):
  """The LoKA arm's inference runs the exported model (e4m3 weights, static scales) on the
  parameters the arms train, and the row says how its sites were exported."""

  def test_loka_infers_with_the_exported_model(self):
    import jax
    from plan_builders import make_plan, probe_stats
    from loka_jax import dispatch
    from loka_jax.dispatch import export as export_lib
    target = suite.model_targets(["dlrm"], ["tiny"], 64)[0]
    source = target.source(3)
    batch = source.train_batch(0, 64)
    bench = suite.speed.TargetBench(batch, min_call_s=0.0)
    bf16 = target.build(SiteConfig.for_precision("bf16"))
    bench.set_baseline(bf16)
    report = probe_stats(bf16, {"params": bench.holder["shared"].params}, source)
    plan = make_plan(report["sites"])
    planned = target.build(SiteConfig.for_precision("loka", plan=plan.kernel_plan()))
    arm = bench.add("loka", planned)
    arm.train()  # the exported weights are the ones the arms have trained
    served, fields = serving.serve_exported(bench, arm, planned, plan, report)
    self.assertTrue(fields["export"])
    self.assertEqual(fields["export_modes"], {"fp8": len(report["sites"]) - 1, "high": 1})
    self.assertGreater(fields["export_saved_fraction"], 0.0)
    expected = export_lib.export(planned, bench.holder["shared"].params, plan, report,
                                 batch=batch).apply(batch)
    np.testing.assert_allclose(np.asarray(served.infer()), np.asarray(expected), rtol=1e-5,
                               atol=1e-5)
    # The plan's model as it trains, compiled (run op by op it takes seconds).
    unexported_model = dispatch.apply(target.config(), plan)
    unexported = np.asarray(jax.jit(lambda params: unexported_model.apply(
        {"params": params}, batch, train=False))(bench.holder["shared"].params), np.float32)
    self.assertFalse(np.allclose(np.asarray(served.infer()), unexported, atol=0.0))


  def test_served_bf16_mods_infers_from_bf16_weights_stored_once(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    done = suite.run_target(target, variants.parse_variants(["bf16_mods_served"]), results,
                            settings=suite.SpeedSettings(repeats=3, probe=False),
                            deadline=float("inf"), device="cpu", log=lambda _: None)
    self.assertTrue(done)
    rows = {r["variant"]: r for r in map(json.loads, open(os.path.join(out, "bench.jsonl")))}
    served = rows["bf16_mods_served"]
    self.assertNotIn("error", served, served.get("traceback"))
    self.assertTrue(served["export"])
    sites = len(site_products(target.build(SiteConfig.for_precision("bf16"), ("all",)), None,
                              target.source(0).train_batch(0, 32)))
    self.assertEqual(served["export_modes"], {"high": sites})
    # float32 parameters stored as bf16: about half of the site weights' bytes are saved.
    self.assertGreater(served["export_saved_fraction"], 0.3)
    self.assertEqual(served["mods"], ["all"])


class ServingPlanBenchTest(chex.TestCase):
  """`serving.plan`: LoKA trains with its training plan and serves the export of a serving
  plan selected from the same report; the row names both, and its export modes (not the
  training kernels) decide whether it is the served bf16+Mods program."""

  # Per target: the probe's statistics of its bf16 model with LoKA's Mods at initialization,
  # which every test's report holds; a statistics pass compiles per site, so it runs once.
  _site_stats = {}

  def _stats(self, target):
    import jax
    from plan_builders import probe_stats
    if target.name not in self._site_stats:
      source = target.source(0)
      bf16 = target.build(SiteConfig.for_precision("bf16"), variants.VARIANTS["loka"].mods)
      batch = source.train_batch(0, target.batch())
      variables = jax.jit(lambda b: bf16.init(jax.random.PRNGKey(0), b, train=False))(batch)
      type(self)._site_stats[target.name] = probe_stats(bf16, variables, source)["sites"]
    return copy.deepcopy(self._site_stats[target.name])

  def _plans(self, target, fwd_speed=(1.06, 1.08, 1.13)):
    import report_builders as hm
    from loka_jax import dispatch
    from experiments.bench import planning
    from loka_jax.probe.eligibility import Criteria
    from loka_jax.probe.report import save_report
    stats = self._stats(target)
    # Per site: the delayed-scaling forward pays alone (1.08x), not over a training step
    # (its backward at 0.92x), and per-pass FP8 is slow everywhere.
    scope = {"time_scope": "grad_lhs+grad_rhs"}
    bwd = dict(speedup=(0.9, 0.92, 0.94), base_us=200.0, **scope)
    fused = {"fwd": hm.entry(sqnr=37.6, speedup=fwd_speed),
             "grad_lhs": hm.entry(sqnr=55.0, **bwd), "grad_rhs": hm.entry(sqnr=55.0, **bwd)}
    slow = hm.entry(speedup=(0.8, 0.85, 0.9))
    report = hm.report({n: {**hm.site({p: {"xla_fp8_tensorwise": slow,
                                           "flax_fp8_delayed_fwd": fused[p]}
                                       for p in hm.PASSES}), "stats": st["stats"]}
                        for n, st in stats.items()}, model=target.model, preset=target.preset)
    plans = os.path.join(_tempdir(self), "plans")
    os.makedirs(planning.plan_dir(plans, target.model, target.preset))
    save_report(report, planning.report_path(plans, target.model, target.preset))
    dispatch.save_plan(dispatch.select(report, Criteria()),
                       planning.plan_path(plans, target.model, target.preset))
    return plans, len(stats)

  def _loka_row(self, target, plans, serve_plan, serve_promotion=None, gate=False,
                budget=2e-4):
    # The gate is off where a test times the serving decision: on a 512-example eval set
    # e4m3 serving moves log loss by more than the 0.02% budget (+-0.09% standard error).
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    settings = suite.SpeedSettings(repeats=3, probe=False, plans_dir=plans, head_to_head=(),
                                   serve_plan=serve_plan, serve_promotion=serve_promotion,
                                   serve_quality_gate=gate, serve_quality_budget=budget,
                                   probe_steps=10)
    self.assertTrue(suite.run_target(target, variants.parse_variants(["loka"]), results,
                                     settings=settings, deadline=float("inf"), device="cpu",
                                     log=lambda _: None))
    row = {r["variant"]: r for r in results.rows()}["loka"]
    self.assertNotIn("error", row, row.get("traceback"))
    return row

  def test_loka_serves_the_serving_plans_export(self):
    from loka_jax import dispatch
    from experiments.bench import planning
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target)
    trained_only = self._loka_row(target, plans, serve_plan=False)
    self.assertEqual(trained_only["kernels"], ["xla_bf16"])
    self.assertEqual(trained_only["export_modes"], {"high": sites})
    self.assertTrue(targets.exports_every_site_high(trained_only))
    row = self._loka_row(target, plans, serve_plan=True)
    self.assertEqual(row["kernels"], ["xla_bf16"])          # it still trains in bf16
    self.assertEqual(row["serve_kernels"], ["flax_fp8_delayed_fwd"])
    self.assertEqual(row["export_modes"], {"fp8": sites})
    self.assertFalse(targets.exports_every_site_high(row))
    self.assertTrue(targets.same_program_as_bf16_mods(row))
    serving = dispatch.read_plan(row["serve_plan"])
    self.assertEqual(serving["provenance"]["objective"], "serve")
    self.assertEqual(row["serve_plan"], os.path.join(
        planning.plan_dir(plans, target.model, target.preset), "plan_serve.json"))
    # every forward is FP8 already: nothing to propose
    self.assertEqual(row["serve_promotion"]["sites"], 0)
    self.assertIn("no site served in xla_bf16", row["serve_promotion"]["skipped"])

  def test_a_forward_held_out_validation_backed_off_is_not_served_in_fp8(self):
    from loka_jax import dispatch
    from experiments.bench import planning
    target = suite.tower_targets(["32x16x2"])[0]
    for fwd_speed, where in (((1.06, 1.08, 1.13), "selected"), ((0.98, 1.03, 1.07), "proposal")):
      plans, _ = self._plans(target, fwd_speed=fwd_speed)
      path = planning.plan_path(plans, target.model, target.preset)
      trained = dispatch.read_plan(path)
      held, other = sorted(trained["sites"])[:2]
      dispatch.save_plan(dispatch.back_off(trained, held, None, "held-out +0.05%",
                                           step="quality_held_out"), path)
      selected, proposal, promoted = planning.select_serving(plans, target.model,
                                                             target.preset)
      served = {"selected": selected, "proposal": proposal}[where]
      self.assertEqual(served["sites"][other]["fwd"]["kernel"], "flax_fp8_delayed_fwd", where)
      for plan in (selected, proposal):
        self.assertEqual({p: e["kernel"] for p, e in plan["sites"][held].items()},
                         {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}, where)
      self.assertNotIn(held, promoted)
      self.assertEqual(bool(promoted), where == "proposal")
      record = [r for r in selected["validation"] if r.get("step") == "serve_selection"]
      if where == "selected":
        self.assertEqual([r["site"] for r in record], [held])
        self.assertIn("held-out +0.05%", record[0]["reason"])

  def _clip_scales(self, plans, target):
    """The report's activation amax 1000x too small: every FP8 export saturates."""
    from experiments.bench import planning
    from loka_jax.probe.report import save_report
    report = planning.load_report(plans, target.model, target.preset)
    for site in report["sites"].values():
      for operand in site["stats"].values():
        if isinstance(operand, dict) and "max" in (operand.get("amax") or {}):
          operand["amax"]["max"] = float(operand["amax"]["max"]) / 1000.0
    save_report(report, planning.report_path(plans, target.model, target.preset))

  def test_the_quality_gate_serves_no_export_outside_the_budget(self):
    from experiments.bench import served_check, serving_gate
    target = suite.tower_targets(["32x16x2"])[0]
    # The selected serving plan is FP8 everywhere, its scales clipped: outside the budget.
    # The training plan (bf16 everywhere) is served instead, which the gate scored within.
    plans, sites = self._plans(target)
    self._clip_scales(plans, target)
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True, gate=True)
    scores = serving_gate.load(plans, target.model, target.preset)
    self.assertEqual(sorted(scores), ["bf16_mods_served", "selected", "training"])
    self.assertFalse(scores["selected"]["within_budget"])
    self.assertTrue(scores["training"]["within_budget"])
    self.assertEqual(row["export_modes"], {"high": sites})
    record = self._promotion_record(row)
    self.assertIn("the selected serving plan is not served", record["quality_fallback"])
    self.assertIn("training plan", record["quality_fallback"])
    self.assertFalse(record["quality"]["selected"]["within_budget"])
    # The row carries the score of what it served, the training plan's export: the report
    # judges its inference verdicts by it (`served_check`).
    self.assertEqual(record["served"], "training")
    self.assertEqual(row["serve_promotion"]["quality"], record["quality"]["training"])
    self.assertEqual(row["serve_promotion"]["quality"]["rel_logloss_change"],
                     scores["training"]["vs_served_bf16_mods"]["rel_logloss_change"])
    self.assertTrue(served_check.for_row(row, {})["within_budget"])
    # The proposal (FP8 at every site the selected bf16 plan leaves) is outside it too: it
    # is neither timed nor served.
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    self._clip_scales(plans, target)
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True, gate=True)
    record = self._promotion_record(row)
    self.assertTrue(record["skipped"])
    self.assertIn("the proposal is not served", record["reason"])
    self.assertNotIn("infer", record)
    self.assertEqual(row["export_modes"], {"high": sites})
    # A later run reads the saved scores: the probe's state is not restored again.
    with mock.patch("loka_jax.dispatch.pipeline.context_for_run",
                    side_effect=AssertionError("scored again")):
      self.assertEqual(serving_gate.score(plans, target.model, target.preset, None),
                       serving_gate.load(plans, target.model, target.preset))

  def test_a_proposal_outside_the_budget_is_trimmed_to_its_most_accurate_forwards(self):
    from loka_jax import dispatch
    from experiments.bench import planning, serving_gate
    from loka_jax.probe.report import save_report
    target = suite.tower_targets(["32x16x2"])[0]
    # Selection serves bf16 everywhere; the proposal adds the delayed forward at every site.
    # One site reads least accurate in the report, and its export saturates (its activation
    # amax 1000x too small): the whole proposal is outside the budget, the rest within.
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    report = planning.load_report(plans, target.model, target.preset)
    bad = sorted(report["sites"])[0]
    for kernel, entry in report["sites"][bad]["passes"]["fwd"].items():
      if kernel != "xla_bf16":
        entry["sqnr_db"] = [26.0, 26.5, 27.0]
    for operand in report["sites"][bad]["stats"].values():
      if isinstance(operand, dict) and "max" in (operand.get("amax") or {}):
        operand["amax"]["max"] = float(operand["amax"]["max"]) / 1000.0
    save_report(report, planning.report_path(plans, target.model, target.preset))
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True, gate=True,
                         budget=0.02)
    scores = serving_gate.load(plans, target.model, target.preset)
    self.assertFalse(scores["proposal"]["within_budget"])
    self.assertTrue(scores["selected"]["within_budget"])
    trimmed = scores[serving_gate.TRIMMED]
    self.assertTrue(trimmed["within_budget"])
    self.assertEqual(sorted(trimmed["sites"]), sorted(set(report["sites"]) - {bad}))
    self.assertEqual(trimmed["export_modes"], {"fp8": sites - 1, "high": 1})
    saved = json.load(open(serving_gate.quality_path(plans, target.model, target.preset)))
    self.assertEqual(saved["trim"]["ranked"][-1], bad)          # least accurate last
    self.assertLessEqual(len(saved["trim"]["tried"]), serving_gate.TRIM_SCORINGS)
    # The bench timed the trimmed proposal in the whole one's place, and serves whichever
    # of it and the selected plan the timing kept, never the whole proposal.
    record = self._promotion_record(row)
    self.assertEqual(record["trimmed"]["kept"], trimmed["sites"])
    self.assertIn("the whole proposal is not served", record["trimmed"]["why"])
    self.assertIn("infer", record)
    served = dispatch.read_plan(row["serve_plan"])
    self.assertEqual(served["sites"][bad]["fwd"]["kernel"], "xla_bf16")
    self.assertEqual(record["served"], serving_gate.TRIMMED if record["promoted"] else "selected")
    self.assertEqual(row["serve_promotion"]["quality"], record["quality"][record["served"]])

  def test_with_every_candidate_outside_the_budget_every_forward_is_served_bf16(self):
    from experiments.bench import planning, serving_gate
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target)
    selected, _, _ = planning.select_serving(plans, target.model, target.preset)
    change = {"rel_logloss_change": 0.01, "se": 0.001}
    outside = {"within_budget": False, "budget": 2e-4, "vs_served_bf16_mods": change}
    served, candidate, why = serving.within_quality(
        selected, {"selected": outside, "training": outside},
        planning.plan_path(plans, target.model, target.preset))
    self.assertIn("every forward in bf16", why)
    self.assertEqual(candidate, serving_gate.ALL_BF16)
    self.assertEqual({c["fwd"]["kernel"] for c in served["sites"].values()}, {"xla_bf16"})
    self.assertLen([r for r in served["validation"] if r["step"] == "serve_quality"], sites)
    kept, candidate, why = serving.within_quality(
        selected, {"selected": {**outside, "within_budget": True}}, "unused")
    self.assertIs(kept, selected)
    self.assertEqual(candidate, "selected")
    self.assertIsNone(why)

  def test_a_corrupt_scores_file_is_refused_by_name(self):
    from experiments.bench import serving_gate
    plans = _tempdir(self)
    path = serving_gate.quality_path(plans, "tower", "32x16x2")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
      f.write('{"served": {"selected": {"logloss": 0.5}}}')
    with self.assertRaisesRegex(ValueError, "serve_quality.json: no served-quality scores"):
      serving_gate.load(plans, "tower", "32x16x2")
    with open(path, "w") as f:
      f.write('{"served": ')
    with self.assertRaisesRegex(ValueError, "truncated or corrupt"):
      serving_gate.load(plans, "tower", "32x16x2")

  def _promotion_record(self, row):
    from loka_jax import dispatch
    records = [r for r in dispatch.read_plan(row["serve_plan"])["validation"]
               if r["step"] == "serve_promotion"]
    self.assertLen(records, 1)
    return records[0]

  def test_the_serving_proposal_is_timed_against_the_selected_plan_and_the_faster_kept(self):
    # The delayed forward reads 1.03x alone (under the 1.05x bar): selection serves bf16,
    # the proposal serves every site in FP8, and the two exports are timed (forced on: a
    # CPU's timing decides nothing about a GPU, only that the decision is carried out).
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True)
    record = self._promotion_record(row)
    self.assertLen(record["sites"], sites)
    lo, hi = record["infer"]["speedup_ci"]
    self.assertLessEqual(lo, record["infer"]["speedup"])
    self.assertLessEqual(record["infer"]["speedup"], hi)
    self.assertEqual(record["promoted"], lo > 1.0)
    self.assertEqual(row["serve_promotion"], {"sites": sites, "promoted": record["promoted"],
                                              "speedup": record["infer"]["speedup"],
                                              "speedup_ci": record["infer"]["speedup_ci"]})
    # the row serves what was kept, and a later run reads the decision instead of timing again
    self.assertEqual(row["export_modes"],
                     {"fp8": sites} if record["promoted"] else {"high": sites})
    again = self._loka_row(target, plans, serve_plan=True, serve_promotion=True)
    self.assertEqual(self._promotion_record(again), record)
    self.assertEqual(again["export_modes"], row["export_modes"])

  def test_a_proposal_that_fails_to_export_leaves_the_selected_plan_served(self):
    from loka_jax.dispatch import export as export_lib
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    real_export = export_lib.export

    def export_or_fail(model, params, plan, report, **kw):
      if any(plan["sites"][n]["fwd"]["kernel"] != "xla_bf16" for n in plan["sites"]):
        raise export_lib.ExportError("site mlp/dense_0: cannot store its weight")
      return real_export(model, params, plan, report, **kw)

    with mock.patch.object(export_lib, "export", side_effect=export_or_fail):
      row = self._loka_row(target, plans, serve_plan=True, serve_promotion=True)
    record = self._promotion_record(row)
    self.assertTrue(record["skipped"])
    self.assertIn("the proposal failed: ExportError: site mlp/dense_0", record["reason"])
    self.assertEqual(row["export_modes"], {"high": sites})
    self.assertEqual(row["serve_promotion"]["sites"], sites)

  def test_off_a_gpu_the_serving_promotion_is_skipped_unless_forced(self):
    target = suite.tower_targets(["32x16x2"])[0]
    plans, sites = self._plans(target, fwd_speed=(0.98, 1.03, 1.07))
    row = self._loka_row(target, plans, serve_plan=True)
    record = self._promotion_record(row)
    self.assertTrue(record["skipped"])
    self.assertIn("not on a GPU", record["reason"])
    self.assertEqual(row["export_modes"], {"high": sites})
    self.assertEqual(row["serve_kernels"], ["xla_bf16"])


class SameProgramTest(absltest.TestCase):
  """The rule `targets.same_program_as_bf16_mods` rests on: a LoKA plan with every site on
  xla_bf16 compiles to bf16+Mods' own train and inference programs (so validation's
  all-bf16 baseline and the bench's bf16+Mods arm time one program)."""

  def _programs(self, target, site):
    from loka_jax.train import loop
    from loka_jax.train.optim import OptimConfig, make_optimizer
    from loka_jax.train.state import create_train_state
    model = target.build(site, variants.VARIANTS["bf16_mods"].mods)
    batch = target.source(0).train_batch(0, 64)
    optim = OptimConfig()
    state = create_train_state(model, make_optimizer(optim), batch, 0)
    train_step, eval_step = loop.compiled_steps(model, optim, "stop")

    def text(fn):  # instruction numbering and source metadata differ between two builds
      hlo = fn.lower(state, batch).compile().as_text()
      return re.sub(r"\.\d+", "", re.sub(r"metadata=\{[^}]*\}", "", hlo))
    return text(train_step), text(eval_step)

  def test_an_all_bf16_plan_compiles_to_the_bf16_mods_program(self):
    target = suite.tower_targets(["64x32x3"])[0]
    bf16_mods = self._programs(target, SiteConfig.for_precision("bf16"))
    all_bf16 = self._programs(target, speed.site_config(variants.VARIANTS["loka"],
                                                        KernelPlan.uniform("xla_bf16")))
    self.assertEqual(all_bf16, bf16_mods)
    # and the comparison can tell two programs apart: one FP8 site changes it
    fp8 = KernelPlan(sites=(("mlp/dense_1", KernelChoice.uniform("xla_fp8_tensorwise")),),
                     default=KernelChoice.uniform("xla_bf16"))
    self.assertNotEqual(self._programs(target, speed.site_config(variants.VARIANTS["loka"],
                                                                 fp8))[0], bf16_mods[0])


class DeadlineTest(absltest.TestCase):

  def test_past_the_deadline_nothing_is_built_and_a_rerun_finishes(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, probe=False)
    logs = []
    with mock.patch.object(speed.TargetBench, "set_baseline",
                           side_effect=AssertionError("baseline built past the deadline")):
      done = suite.run_target(target, variants.parse_variants(["bf16_mods"]), results,
                              settings=settings, deadline=time.time() - 1, device="cpu",
                              log=logs.append)
    self.assertFalse(done)
    self.assertIn(f"  deadline: {target.name} left for the next run, its baseline not built",
                  logs)
    self.assertEqual(list(results.rows()), [])
    self.assertTrue(suite.run_target(target, variants.parse_variants(["bf16_mods"]), results,
                                     settings=settings, deadline=float("inf"), device="cpu",
                                     log=lambda _: None))
    self.assertEqual([r["variant"] for r in results.rows()], ["bf16", "bf16_mods"])


  def test_rows_start_by_their_expected_length_when_the_hard_end_is_known(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    key = ("towers", target.model, target.preset, "cpu", None)
    logs = []

    def run(names, deadline, end_by, head_to_head=()):
      settings = suite.SpeedSettings(repeats=3, probe=False, head_to_head=head_to_head)
      return suite.run_target(target, variants.parse_variants(names), results,
                              settings=settings, deadline=deadline, device="cpu",
                              log=logs.append, end_by=end_by)

    # Past pacing.max_minutes with no row recorded, pacing.max_minutes rules: nothing is built.
    self.assertFalse(run(["bf16_mods"], time.time() - 1, time.time() + 3600))
    self.assertEqual(list(results.rows()), [])
    self.assertTrue(run(["bf16_mods"], float("inf"), None))
    rows = {r["variant"]: r for r in results.rows()}
    self.assertEqual(sorted(rows), ["bf16", "bf16_mods"])
    self.assertTrue(all(r["row_s"] > 0 for r in rows.values()))
    longest = max(r["row_s"] for r in rows.values())
    self.assertAlmostEqual(suite.expected_row_s(results, key, "fp8_tensorwise"),
                           pace.MARGIN * longest)
    self.assertAlmostEqual(suite.expected_row_s(results, key, "bf16"),
                           pace.MARGIN * rows["bf16"]["row_s"])
    # The bf16 row's length counts the baseline's build, the bf16 arm itself: a slow build
    # (here 1 s more) shows in it, so the rows paced by it expect a compile.
    set_baseline = speed.TargetBench.set_baseline
    def set_baseline_slowly(bench, model):
      time.sleep(1.0)
      return set_baseline(bench, model)
    scratch = ResultsFile(os.path.join(out, "scratch.jsonl"), suite.KEY_FIELDS)
    with mock.patch.object(speed.TargetBench, "set_baseline", set_baseline_slowly):
      self.assertTrue(suite.run_target(
          target, variants.parse_variants(["bf16"]), scratch,
          settings=suite.SpeedSettings(repeats=3, probe=False), deadline=float("inf"),
          device="cpu", log=logs.append))
    (bf16_row,) = list(scratch.rows())
    self.assertGreaterEqual(bf16_row["row_s"], 1.0)
    # Past pacing.max_minutes, a row starts when the longest recorded one would end in time ...
    self.assertTrue(run(["fp8_tensorwise"], time.time() - 1, time.time() + 3600))
    self.assertIn("fp8_tensorwise", {r["variant"] for r in results.rows()})
    # ... and, before it, none starts that would not: not the baseline ...
    logs.clear()
    self.assertFalse(run(["fp8_rowwise"], float("inf"), time.time() + 0.5 * longest))
    self.assertIn("its baseline not built", logs[-1])
    # ... nor a row after another.
    logs.clear()
    expected = {"fp8_rowwise": 1e-3, "flax_fp8_delayed": 1e6}
    with mock.patch.object(suite, "expected_row_s",
                           side_effect=lambda results, key, name: expected[name]):
      self.assertFalse(run(["fp8_rowwise", "flax_fp8_delayed"], float("inf"),
                           time.time() + 3600))
    self.assertIn("fp8_rowwise", {r["variant"] for r in results.rows()})
    self.assertIn("flax_fp8_delayed left for the next run (it may take 1000000 s", logs[-1])
    # A head-to-head row does not start past pacing.max_minutes, where its rebuilds stop.
    logs.clear()
    self.assertFalse(run(["flax_fp8_delayed"], time.time() - 1, time.time() + 3600,
                         head_to_head=("flax_fp8_delayed",)))
    self.assertIn("head-to-head", logs[-1])
    self.assertNotIn("flax_fp8_delayed", {r["variant"] for r in results.rows()})


class ProbeThenRowsTest(absltest.TestCase):

  def test_a_probe_that_leaves_no_plan_builds_no_baseline(self):
    # The probe has the run's time (its budget is the time to the deadline) and stops short
    # of a plan when its next step would not fit: the target waits for the next run, its
    # peers too, instead of compiling a baseline the deadline throws away.
    from loka_jax import dispatch
    from experiments.bench import planning
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, plans_dir=os.path.join(out, "plans"),
                                   head_to_head=())
    pending = variants.parse_variants(["bf16_mods", "loka"])
    logs = []
    with mock.patch.object(planning, "make_plan", return_value=None) as make_plan, \
        mock.patch.object(speed.TargetBench, "set_baseline",
                          side_effect=AssertionError("baseline built after the probe")):
      done = suite.run_target(target, pending, results, settings=settings,
                              deadline=time.time() + 600, device="cpu", log=logs.append)
    self.assertFalse(done)
    make_plan.assert_called_once()
    self.assertIn(f"  planning (probe or validation) ran to its budget and the LoKA plan is "
                  f"not ready: {target.name} left for the next run, its baseline not built",
                  logs)
    self.assertEqual(list(results.rows()), [])

    # A probe that writes its plan: the baseline and the other rows follow in the same run.
    def plan_made(spec, plans_root, *args, **kwargs):
      path = planning.plan_path(plans_root, spec.model, spec.preset)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      dispatch.save_plan({"schema": "loka.plan/1", "sites": {},
                          "default": {p: "xla_bf16" for p in ("fwd", "grad_lhs", "grad_rhs")}},
                         path)
      return path
    logs = []
    with mock.patch.object(planning, "make_plan", side_effect=plan_made):
      suite.run_target(target, variants.parse_variants(["bf16_mods"]) + pending[1:], results,
                       settings=settings, deadline=time.time() + 600, device="cpu",
                       log=logs.append)
    self.assertTrue(any("bf16 compiled" in line for line in logs), logs)
    self.assertContainsSubset({"bf16", "bf16_mods"}, {r["variant"] for r in results.rows()})


class HeadToHeadTest(absltest.TestCase):

  def test_the_subject_runs_last_and_is_timed_against_each_reference(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, probe=False, head_to_head=("fp8_rowwise",))

    def run(names):
      logs = []
      done = suite.run_target(target, variants.parse_variants(names), results,
                              settings=settings, deadline=float("inf"), device="cpu",
                              log=logs.append)
      self.assertTrue(done)
      return logs
    run(["bf16_mods"])  # an earlier run timed bf16+Mods: its arm is gone
    logs = run(["fp8_rowwise", "bf16_mods", "fp8_tensorwise"])
    rows = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual([r["variant"] for r in rows],
                     ["bf16", "bf16_mods", "fp8_tensorwise", "fp8_rowwise"])
    for r in rows[:3]:
      self.assertNotIn("head_to_head", r)
    self.assertIn("  fp8_rowwise vs bf16_mods: building bf16_mods again for the pair", logs)
    self.assertFalse(any("building fp8_tensorwise" in line for line in logs), logs)
    pairs = rows[-1]["head_to_head"]
    # bf16+Mods, and the best (only) other peer; no served arm ran.
    self.assertEqual(sorted(pairs), ["bf16_mods", "fp8_tensorwise"])
    for modes in pairs.values():
      for mode in ("train", "infer"):
        pair = modes[mode]
        self.assertLen(pair["samples_us"], 3)
        self.assertLen(pair["other_samples_us"], 3)
        # The ratio is the other's median step over the subject's, from the pair's samples.
        self.assertAlmostEqual(pair["ratio"], np.median(pair["other_samples_us"])
                               / np.median(pair["samples_us"]), delta=1e-3 * pair["ratio"])
        self.assertLessEqual(pair["ci"][0], pair["ratio"])
        self.assertGreaterEqual(pair["ci"][1], pair["ratio"])
    self.assertTrue(any("fp8_rowwise vs fp8_tensorwise, one interleaving" in l for l in logs),
                    logs)

  def test_a_reference_is_not_rebuilt_when_its_build_would_end_past_the_deadline(self):
    # LoKA's row is written only after its pairs: a rebuild the call's hard limit cuts short
    # would lose the row itself, so a rebuild starts only when the longest build of the run
    # would still end by the deadline.
    subject = speed.Arm("loka", None, None, {}, {})
    rows = {"bf16_mods": {"variant": "bf16_mods"}, "loka": {"variant": "loka"}}

    class PairsOf:  # records which arms LoKA was paired with
      def head_to_head(self, arm, others, repeats, seed):
        self.paired = sorted(others)
        return {}
    settings = suite.SpeedSettings(repeats=3, probe=False)
    for build_s, rebuilt in ((120.0, []), (5.0, ["bf16_mods"])):
      built, logs, bench = [], [], PairsOf()
      fields = suite._head_to_head(
          bench, subject, {}, rows, lambda name: built.append(name) or subject,
          time.time() + 60.0, settings, logs.append, build_s)
      self.assertEqual(built, rebuilt, logs)
      self.assertEqual(bench.paired, rebuilt)
      self.assertEqual(fields, {})
      if not rebuilt:
        self.assertIn("  loka vs bf16_mods: not built again, since a build (120 s at most so "
                      "far) would end past the deadline (the ratio of rows stands)", logs)

  def test_a_rebuild_longer_than_the_runs_builds_paces_the_next(self):
    # The first rebuild takes 0.35 s where the run's builds had taken 0.05 s: the second
    # would then end past a deadline 0.6 s away, so it is not started.
    subject = speed.Arm("loka", None, None, {}, {})
    rows = {n: {"variant": n} for n in ("bf16_mods", targets.SERVED, "loka")}

    class PairsOf:
      def head_to_head(self, arm, others, repeats, seed):
        return {}
    built, logs = [], []

    def slow_build(name):
      time.sleep(0.35)
      built.append(name)
      return subject
    suite._head_to_head(PairsOf(), subject, {}, rows, slow_build, time.time() + 0.6,
                        suite.SpeedSettings(repeats=3, probe=False), logs.append, 0.05)
    self.assertEqual(built, ["bf16_mods"], logs)
    self.assertTrue(any(f"loka vs {targets.SERVED}: not built again" in l for l in logs), logs)


class CliTest(absltest.TestCase):

  def test_runs_filters_and_resumes(self):
    out = _tempdir(self)
    first = run_module("experiments.bench", f"--config={TOWERS_CONFIG}",
                       "--config.targets.towers=32x16x2,48x16x2", "--config.targets.only=32x16x2",
                       "--config.speed.variants=bf16,fp8_rowwise", "--config.speed.repeats=3",
                       "--config.pacing.max_minutes=3", "--config.pacing.end_by_minutes=2.5",
                       f"--workdir={out}", "--config.probe.enabled=false",
                       "--config.speed.min_call_ms=0.5", COMPILE_CACHE, timeout=240)
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    # A hard end before pacing.max_minutes caps it, said, and costs the call nothing.
    self.assertIn("pacing.max_minutes=3.0 is past pacing.end_by_minutes=2.5", first.stdout)
    rows = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual(sorted((r["preset"], r["variant"]) for r in rows),
                     [("32x16x2", "bf16"), ("32x16x2", "fp8_rowwise")])
    for r in rows:
      self.assertLen(r["train"]["samples_us"], 3)
      self.assertGreater(r["infer"]["median_us"], 0)
      self.assertEqual(r["min_call_s"], 5e-4)  # the field reaches the timing and the row
    # A rerun skips finished rows: nothing is compiled or measured again.
    logs = []
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    done = suite.run_target(target, variants.parse_variants(["bf16", "fp8_rowwise"]), results,
                            settings=suite.SpeedSettings(repeats=3, probe=False),
                            deadline=float("inf"), device=rows[0]["device"], log=logs.append)
    self.assertTrue(done)
    self.assertEqual(logs, [])
    self.assertLen(open(os.path.join(out, "bench.jsonl")).read().splitlines(), 2)
    self.assertIn("all selected rows are done", first.stdout)
    for name in ("report.md", "targets.json", os.path.join("plots", "speedup_towers.png")):
      self.assertTrue(os.path.exists(os.path.join(out, name)), name)


  def test_deterministic_ops_run_the_quality_suite_and_no_timed_one(self):
    out = _tempdir(self)
    base = ["experiments.bench", f"--workdir={out}"]
    deterministic = "--config.quality.xla_deterministic=true"
    timed = run_module(*base, f"--config={TOWERS_CONFIG}", deterministic, timeout=120)
    self.assertNotEqual(timed.returncode, 0)
    self.assertIn("--config.quality.xla_deterministic=True: for suite quality only",
                  timed.stderr)
    # quality.seeds: the arm at each of its seeds, and no bf16 noise seed beside them.
    quality_run = run_module(
        *base, f"--config={QUALITY_CONFIG}", COMPILE_CACHE, deterministic,
        "--config.quality.data=synthetic", "--config.quality.preset=tiny",
        "--config.targets.models=dlrm", "--config.quality.arms=bf16",
        "--config.quality.seeds=2,1", "--config.quality.steps=3", "--config.quality.eval=100",
        "--config.targets.batch_size=64", timeout=240)
    self.assertEqual(quality_run.returncode, 0, quality_run.stderr[-3000:])
    rows = [json.loads(l) for l in open(os.path.join(out, "quality.jsonl"))]
    self.assertEqual([(r["arm"], r["seed"]) for r in rows], [("bf16", 2), ("bf16", 1)])
    for row in rows:
      self.assertTrue(row["xla_deterministic"])
      self.assertIsNotNone(row["logloss"])
    # Different seeds train different runs.
    self.assertNotEqual(rows[0]["logloss"], rows[1]["logloss"])

  def test_bad_quality_seeds_fail_before_any_run(self):
    out = _tempdir(self)
    for flag in ("--config.quality.seeds=1,x", "--config.quality.noise_seeds=1,1"):
      run = run_module("experiments.bench", f"--workdir={out}", f"--config={QUALITY_CONFIG}",
                       "--config.quality.data=synthetic", flag, timeout=120)
      self.assertNotEqual(run.returncode, 0, flag)
      self.assertIn(f"{flag}: must list distinct non-negative integers", run.stderr)
      self.assertFalse(os.path.exists(os.path.join(out, "quality.jsonl")), flag)

  def test_the_variants_field_names_every_variant(self):
    # The comment above `speed.variants` in the config file is the field's help.
    lines = open(os.path.join(REPO, "experiments", "configs", "bench.py")).read().splitlines()
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("speed.variants"))
    start = max(i for i in range(end) if not lines[i].strip().startswith("#")) + 1
    field_help = " ".join(line.strip("# ") for line in lines[start:end])
    for name in variants.VARIANTS:
      self.assertRegex(field_help, rf"\b{name}\b", name)

  def test_a_missing_plan_alone_builds_no_baseline(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    settings = suite.SpeedSettings(repeats=3, probe=False, plans_dir=os.path.join(out, "plans"))

    def run():
      logs = []
      done = suite.run_target(target, variants.parse_variants(["loka"]), results,
                              settings=settings, deadline=float("inf"), device="cpu",
                              log=logs.append)
      return done, logs
    done, logs = run()                       # the bf16 row is measured, LoKA waits
    self.assertFalse(done)
    self.assertTrue(any("bf16 compiled" in line for line in logs), logs)
    done, logs = run()                       # only LoKA is left: no baseline is built
    self.assertFalse(done)
    self.assertTrue(any("plan is not ready" in line for line in logs), logs)
    self.assertFalse(any("compiled" in line for line in logs), logs)
    rows = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual([r["variant"] for r in rows], ["bf16"])


class QualityProtocolTest(absltest.TestCase):

  def test_every_arm_scores_the_same_eval_set(self):
    out = _tempdir(self)
    settings = quality.QualitySettings(preset="tiny", steps=3, batch_size=64, min_eval=100,
                                       arms=("bf16", "fp8_naive"), noise_seeds=(1,))
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    logs = []
    done = quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                             device="cpu", log=logs.append)
    self.assertTrue(done)
    rows = list(results.rows())
    self.assertEqual(sorted((r["arm"], r["seed"]) for r in rows),
                     [("bf16", 0), ("bf16", 1), ("fp8_naive", 0)])
    self.assertLen({r["eval_fingerprint"] for r in rows}, 1)
    # The arms of seed 0 share the data order and the initial weights; seed 1 has its own.
    by = {(r["arm"], r["seed"]): r for r in rows}
    for field in ("train_fingerprint", "init_fingerprint"):
      self.assertEqual(by["bf16", 0][field], by["fp8_naive", 0][field], field)
      self.assertNotEqual(by["bf16", 0][field], by["bf16", 1][field], field)
    self.assertTrue(all(r["num_eval_examples"] == 128 for r in rows))  # 2 x 64 >= 100
    self.assertNotEqual(rows[0]["logloss"], rows[2]["logloss"])
    again = quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                              device="cpu", log=logs.append)
    self.assertTrue(again)
    self.assertLen(open(os.path.join(out, "quality.jsonl")).read().splitlines(), 3)

  def test_a_large_state_is_checkpointed_only_at_the_end_or_not_at_all(self):
    # The same 8-step run three times: under the size bar every quarter is saved (three
    # kept); over it (the bar lowered below the toy state's size, which the run's own
    # abstract state gives) only the final state when runs are kept, else none at all.
    import jax
    from loka_jax.train import checkpoint, experiment, make_optimizer, state as state_lib
    spec = experiment.RunSpec(model="dlrm", preset="tiny", num_eval=64)
    model, source, _ = experiment.build_run(spec)
    nbytes = state_lib.state_bytes(model, make_optimizer(quality.OptimConfig()),
                                   source.train_batch(0, 64), 0)
    leaves = jax.tree.leaves(state_lib.create_train_state(
        model, make_optimizer(quality.OptimConfig()), source.train_batch(0, 64), 0))
    self.assertEqual(nbytes, sum(x.nbytes for x in leaves))
    saved, scores = {}, {}
    for bar, keep_runs in ((nbytes + 1, True), (nbytes, True), (nbytes, False)):
      out = _tempdir(self)
      settings = quality.QualitySettings(preset="tiny", steps=8, batch_size=64, min_eval=64,
                                         arms=("bf16",), noise_seeds=(), keep_runs=keep_runs)
      results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
      with mock.patch.object(checkpoint.Checkpointer, "save", autospec=True,
                             side_effect=checkpoint.Checkpointer.save) as save, \
          mock.patch.object(quality, "LARGE_STATE_BYTES", bar):
        self.assertTrue(quality.run_model("dlrm", settings, results, out,
                                          deadline=float("inf"), device="cpu"))
      row, = results.rows()
      run = quality.run_dir(out, row)
      saved[bar, keep_runs] = (save.call_count, checkpoint.Checkpointer(
          os.path.join(run, "checkpoints")).steps() if keep_runs else [])
      scores[bar, keep_runs] = row["logloss"]
      with open(os.path.join(run, "config.json")) as f:
        train_config = json.load(f)["train"]
      self.assertEqual((train_config["checkpoint_every"], train_config["keep_checkpoints"]),
                       {(nbytes + 1, True): (2, 3), (nbytes, True): (0, 1),
                        (nbytes, False): (0, 0)}[bar, keep_runs])
    # (Saves asked for: the final state is asked twice, at its step and at the loop's end,
    # and written once.)
    self.assertEqual(saved, {(nbytes + 1, True): (5, [4, 6, 8]), (nbytes, True): (2, [8]),
                             (nbytes, False): (0, [])})
    self.assertLen(set(scores.values()), 1)  # the same run, however it is saved

  def _save_uniform_plan(self, settings, kernel):
    path = planning.plan_path(settings.plans_root, "dlrm", "tiny")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    dispatch.save_plan({"schema": dispatch.SCHEMA, "model": "dlrm", "sites": {}, "rules": [],
                        "default": KernelChoice.uniform(kernel).to_dict()}, path)
    return path

  def test_a_plan_without_fp8_hands_loka_the_bf16_mods_run(self):
    out = _tempdir(self)
    settings = quality.QualitySettings(preset="tiny", steps=3, batch_size=64, min_eval=100,
                                       arms=("bf16_mods", "loka"), noise_seeds=(),
                                       plans_dir=os.path.join(out, "plans"))
    plan = self._save_uniform_plan(settings, "xla_bf16")
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    logs = []
    self.assertTrue(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                      device="cpu", log=logs.append))
    rows = {r["arm"]: r for r in results.rows()}
    twin, loka = rows["bf16_mods"], rows["loka"]
    self.assertEqual(loka["same_run_as"], "bf16_mods")
    for field in ("logloss", "ne", "auc", "eval_fingerprint", "train_fingerprint",
                  "init_fingerprint", "peak_loss", "peak_step"):
      self.assertEqual(loka[field], twin[field], field)
    self.assertEqual(loka["plan_kernels"], ["xla_bf16"])
    self.assertNotIn("train_s", loka)  # no second run's time
    self.assertFalse(os.path.exists(quality.run_dir(out, loka)))
    self.assertTrue(any("no FP8 kernel" in line for line in logs), logs)
    # What makes the hand-over sound: trained for real, the LoKA arm on that plan is the
    # bf16+Mods run, to the bit.
    trained = quality.run_arm("dlrm", mods_set.apply(quality.ARMS["loka"], settings.mods), 0,
                              settings, os.path.join(out, "loka_trained"), plan)
    self.assertEqual(trained["logloss"], twin["logloss"])
    self.assertEqual(trained["peak_loss"], twin["peak_loss"])
    # A corrupt plan is no hand-over: the LoKA run fails on it by name, in its row.
    with open(plan, "w") as f:
      f.write('{"schema": "loka.plan/1", "sites": ')
    broken = ResultsFile(os.path.join(out, "broken.jsonl"), quality.KEY_FIELDS)
    broken.append(twin)
    self.assertTrue(quality.run_model("dlrm", settings, broken, os.path.join(out, "broken"),
                                      deadline=float("inf"), device="cpu", log=logs.append))
    failed = {r["arm"]: r for r in broken.rows()}["loka"]
    self.assertIn(plan, failed["error"])
    self.assertNotIn("same_run_as", failed)
    # Only the bf16+Mods arm's kernels make its program: fp32 is no FP8 and still another.
    self.assertTrue(quality.runs_bf16_mods_kernels(self._save_uniform_plan(settings,
                                                                           "xla_bf16")))
    self.assertFalse(quality.runs_bf16_mods_kernels(self._save_uniform_plan(settings,
                                                                            "xla_fp32")))
    # A plan with an FP8 kernel trains its own run, twin or not.
    self._save_uniform_plan(settings, "xla_fp8_tensorwise")
    fresh = ResultsFile(os.path.join(out, "fp8.jsonl"), quality.KEY_FIELDS)
    fresh.append(twin)
    self.assertTrue(quality.run_model("dlrm", settings, fresh, os.path.join(out, "fp8"),
                                      deadline=float("inf"), device="cpu", log=logs.append))
    loka = {r["arm"]: r for r in fresh.rows()}["loka"]
    self.assertNotIn("same_run_as", loka)
    self.assertEqual(loka["plan_kernels"], ["xla_fp8_tensorwise"])
    self.assertEqual(loka["init_fingerprint"], twin["init_fingerprint"])
    self.assertIn("train_s", loka)
    self.assertNotEqual(loka["logloss"], twin["logloss"])

  def test_a_handed_over_loka_row_says_so_in_the_table_and_verdict(self):
    rows = [_quality_row("dlrm", "large", "bf16", s, 0.47 + 0.001 * s) for s in range(3)]
    rows += [_quality_row("dlrm", "large", "bf16_mods", 0, 0.4705),
             _quality_row("dlrm", "large", "loka", 0, 0.4705, same_run_as="bf16_mods")]
    table = tables.quality_table(rows)
    self.assertIn("| loka (bf16_mods' runs at seeds [0]: no FP8 site) |", table)
    self.assertNotIn("| bf16_mods (", table)
    verdict = _verdict(targets.check_quality(rows), "loka_quality_vs_bf16_mods",
                       "synthetic:dlrm/large", "quality")
    self.assertEqual((verdict["verdict"], verdict["met"]), ("not applicable", None))
    self.assertIn("the plan runs no FP8 kernel", verdict["note"])
    self.assertIn("at seeds [0] its rows are the bf16+Mods runs", verdict["note"])
    self.assertNotIn("no FP8 kernel", _verdict(targets.check_quality(rows[:3] + rows[3:4] + [
        _quality_row("dlrm", "large", "loka", 0, 0.4705, plan_kernels=["xla_fp8_rowwise"])]),
        "loka_quality_vs_bf16_mods", "synthetic:dlrm/large", "quality")["note"])

  def test_a_warm_up_recipe_trains_its_own_runs(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    common = dict(preset="tiny", steps=4, batch_size=64, min_eval=100, arms=("bf16",),
                  noise_seeds=())
    for warmup in (0, 2):
      self.assertTrue(quality.run_model(
          "dlrm", quality.QualitySettings(warmup_steps=warmup, **common), results, out,
          deadline=float("inf"), device="cpu", log=lambda _: None))
    rows = list(results.rows())
    self.assertEqual(sorted(quality.row_warmup(r) for r in rows), [0, 2])
    self.assertNotIn("warmup_steps", rows[0])  # plain rows keep the keys they always had
    # Step 1 of a warm-up from 0 applies no update, so the two runs must differ.
    self.assertNotEqual(rows[0]["logloss"], rows[1]["logloss"])
    run_dir = os.path.join(out, "synthetic", "dlrm_tiny", "bf16_seed0_warmup2")
    config = json.load(open(os.path.join(run_dir, "config.json")))
    self.assertEqual(config["train"]["optim"]["warmup_steps"], 2)

  def test_a_clipped_recipe_trains_its_own_runs_and_rows_keep_the_worst_step(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    common = dict(preset="tiny", steps=4, batch_size=64, min_eval=100, arms=("bf16",),
                  noise_seeds=())
    logs = []
    for clip in (None, 1e-9):
      self.assertTrue(quality.run_model(
          "dlrm", quality.QualitySettings(clip_norm=clip, **common), results, out,
          deadline=float("inf"), device="cpu", log=logs.append))
    plain, clipped = sorted(results.rows(), key=quality.row_clip)
    self.assertIn("  quality synthetic dlrm/tiny bf16 seed 0 clip 1e-09", logs)
    self.assertNotIn("clip_norm", plain)  # plain rows keep the keys they always had
    self.assertEqual(clipped["clip_norm"], 1e-9)
    # Clipped to 1e-9, the dense towers' Adam steps are left to its epsilon: the run differs.
    self.assertNotEqual(plain["logloss"], clipped["logloss"])
    run_dir = os.path.join(out, "synthetic", "dlrm_tiny", "bf16_seed0_clip1e-09")
    self.assertEqual(quality.run_dir(out, clipped), run_dir)  # found again from its row
    config = json.load(open(os.path.join(run_dir, "config.json")))
    self.assertEqual(config["train"]["optim"]["clip_norm"], 1e-9)
    # The row's worst step is the worst of the run's own per-step losses: each metrics line
    # is a one-step window here (log_every is steps // 10, at least 1).
    lines = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    self.assertEqual([r["step"] for r in lines], [1, 2, 3, 4])
    worst = max(lines, key=lambda r: r["loss"])
    self.assertEqual((clipped["peak_loss"], clipped["peak_step"]), (worst["loss"], worst["step"]))
    # Each finished run's log line names its held-out log loss and its worst step.
    self.assertIn(f"    held-out log loss {clipped['logloss']:.5f} after "
                  f"{clipped['train_s']:.0f} s; worst step {worst['step']}: training loss "
                  f"{worst['loss']:.3g}", logs)


class ParseTargetTest(absltest.TestCase):

  def test_model_and_tower_targets_and_a_clear_error(self):
    self.assertEqual(suite.parse_target("dhen/large"), suite.Target("models", "dhen", "large"))
    tower = suite.parse_target("tower/4096x256x8", 512)
    self.assertEqual((tower.suite, tower.preset, tower.batch_size), ("towers", "4096x256x8", 512))
    for bad in ("dhen", "/large", "dhen/", ""):
      with self.assertRaisesRegex(ValueError, "expected model/preset or tower/BxWxD"):
        suite.parse_target(bad)


class QualityPacingTest(absltest.TestCase):
  """With the call's hard end known, quality runs start by their expected length."""

  def test_a_run_starts_past_max_minutes_only_when_it_fits_before_the_hard_end(self):
    now, deadline = 1000.0, 900.0                       # pacing.max_minutes has passed
    self.assertEqual(pace.may_start(now, deadline, None, 50.0)[0], False)
    self.assertEqual(pace.may_start(now, deadline, 1100.0, None)[0], False)
    self.assertTrue(pace.may_start(now, deadline, 1100.0, 100.0)[0])
    fits, why = pace.may_start(now, deadline, 1100.0, 100.5)
    self.assertFalse(fits)
    self.assertIn("100 s are left", why)
    # Before pacing.max_minutes, a run that would outlast the hard end does not start either.
    self.assertFalse(pace.may_start(now, 2000.0, 1100.0, 150.0)[0])
    self.assertTrue(pace.may_start(now, 2000.0, None, 150.0)[0])

  def test_the_expected_time_is_the_longest_recorded_run_of_the_model_and_preset(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    settings = quality.QualitySettings(preset="large")
    self.assertIsNone(quality.expected_run_s(results, "dhen", settings))
    for arm, model, preset, seconds in (("bf16", "dhen", "large", 162.7),
                                        ("fp8_naive", "dhen", "large", 227.0),
                                        ("loka", "dhen", "large", "n/a"),
                                        ("bf16", "dhen", "small", 900.0),
                                        ("bf16", "dcnv2", "large", 900.0)):
      results.append({"suite": "quality", "data": "synthetic", "model": model,
                      "preset": preset, "arm": arm, "seed": 0, "device": "x",
                      "train_s": seconds})
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings),
                           pace.MARGIN * 227.0)
    # An arm with a recorded run expects its own longest; one without, the model's.
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings, "bf16"),
                           pace.MARGIN * 162.7)
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings, "bf16_mods"),
                           pace.MARGIN * 227.0)
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings, "loka"),
                           pace.MARGIN * 227.0)
    self.assertIsNone(quality.expected_run_s(
        results, "dhen", dataclasses.replace(settings, data="movielens")))

  def test_run_model_stops_before_a_run_that_would_outlast_the_hard_end(self):
    out = _tempdir(self)
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    settings = quality.QualitySettings(preset="tiny", steps=2, batch_size=64, min_eval=100,
                                       arms=("bf16", "fp8_naive"), noise_seeds=())
    logs = []
    # Past pacing.max_minutes with no run recorded: nothing starts.
    self.assertFalse(quality.run_model("dlrm", settings, results, out, deadline=0.0,
                                       device="cpu", log=logs.append,
                                       end_by=time.time() + 3600.0))
    self.assertEqual(list(results.rows()), [])
    self.assertTrue(quality.run_model("dlrm", dataclasses.replace(settings, arms=("bf16",)),
                                      results, out, deadline=float("inf"), device="cpu",
                                      log=logs.append))
    (first,) = results.rows()
    # Past pacing.max_minutes, the next run starts when the recorded run's time fits ...
    self.assertTrue(quality.run_model("dlrm", settings, results, out, deadline=0.0,
                                      device="cpu", log=logs.append,
                                      end_by=time.time() + 3600.0))
    self.assertEqual(sorted(r["arm"] for r in results.rows()), ["bf16", "fp8_naive"])
    # ... and not when it does not.
    more = dataclasses.replace(settings, noise_seeds=(1,))
    self.assertFalse(quality.run_model(
        "dlrm", more, results, out, deadline=0.0, device="cpu", log=logs.append,
        end_by=time.time() + 0.5 * first["train_s"]))
    self.assertLen(list(results.rows()), 2)
    self.assertIn("left for the next run (it may take", logs[-1])


if __name__ == "__main__":
  absltest.main()
