"""The bench's targets on hand-made rows with known answers: each speed and paired quality
verdict (met, missed, unresolved, not applicable), and a bf16 baseline that drifted between
timings."""

import numpy as np
from absl.testing import absltest, parameterized

from bench_rows import find_verdict, model_row, quality_row, speed
from experiments.bench import quality, tables, targets


class TargetCheckTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(7)
    # wukong/large: LoKA 1.6x train / 2.0x infer over bf16; bf16+Mods 1.2x / 1.25x; so over
    # bf16+Mods LoKA is 1.333x (met) and 1.6x (met). dlrm/small: LoKA slower than the peer.
    self.rows = [
        model_row("wukong", "large", "bf16", 1.0, 1.0, rng),
        model_row("wukong", "large", "bf16_mods", 1.2, 1.25, rng),
        model_row("wukong", "large", "fp8_rowwise", 1.1, 1.3, rng),
        model_row("wukong", "large", "loka", 1.6, 2.0, rng),
        model_row("dlrm", "small", "bf16", 1.0, 1.0, rng),
        model_row("dlrm", "small", "bf16_mods", 1.1, 1.1, rng),
        model_row("dlrm", "small", "fp8_tensorwise", 0.9, 0.95, rng),
        model_row("dlrm", "small", "loka", 0.8, 1.0, rng),
    ]
    self.verdicts = targets.check_speed(self.rows)

  def test_ratio_of_two_variants_matches_the_hand_numbers(self):
    r = targets.ratio(self.rows[3], self.rows[1], "train")
    self.assertAlmostEqual(r["ratio"], 1.6 / 1.2, delta=0.03)
    self.assertLess(r["ci"][0], r["ratio"])
    self.assertGreater(r["ci"][1], r["ratio"])

  def test_wukong_large_targets_met(self):
    train = find_verdict(self.verdicts, "wukong_large_over_bf16_mods", "wukong/large", "train")
    infer = find_verdict(self.verdicts, "wukong_large_over_bf16_mods", "wukong/large", "infer")
    self.assertTrue(train["met"])
    self.assertTrue(infer["met"])
    self.assertAlmostEqual(infer["value"], 2.0 / 1.25, delta=0.04)
    plain = find_verdict(self.verdicts, "wukong_large_over_bf16", "wukong/large", "train")
    self.assertIsNone(plain["met"])  # reported beside the bar, not judged
    self.assertAlmostEqual(plain["value"], 1.6, delta=0.04)

  def test_slower_loka_is_missed_with_its_ci(self):
    v = find_verdict(self.verdicts, "loka_not_slower_than_bf16_mods", "dlrm/small", "train")
    self.assertFalse(v["met"])
    self.assertAlmostEqual(v["value"], 0.8 / 1.1, delta=0.03)
    self.assertLess(v["ci"][1], 0.98)
    best = find_verdict(self.verdicts, "loka_at_least_best_peer", "dlrm/small", "train")
    self.assertIn("fp8_tensorwise", best["note"])
    self.assertFalse(best["met"])

  def test_an_all_bf16_plan_is_judged_by_whether_its_ci_holds_one(self):
    rng = np.random.default_rng(3)
    mods = model_row("dcnv2", "small", "bf16_mods", 1.10, 1.10, rng)
    noisy = dict(model_row("dcnv2", "small", "loka", 1.08, 1.10, rng), kernels=["xla_bf16"])
    noisy["train"]["speedup_ci"] = [1.0, 1.2]
    # Wide timing jitter: the same program measured twice, CI around 1.0 reaching below 0.98.
    for row in (mods, noisy):
      row["train"] = speed(row["train"]["speedup"], rng, jitter=0.08)
    v = find_verdict(targets.check_speed([mods, noisy]), "loka_not_slower_than_bf16_mods",
                 "dcnv2/small", "train")
    self.assertLess(v["ci"][0], 0.98)
    self.assertLessEqual(v["ci"][0], 1.0)
    self.assertGreaterEqual(v["ci"][1], 1.0)
    self.assertTrue(v["met"])
    self.assertIn("timing noise", v["note"])
    # Clearly slower although the same program: reported as missed, flagged.
    slow = dict(model_row("dcnv2", "small", "loka", 0.8, 1.1, rng), kernels=["xla_bf16"])
    v = find_verdict(targets.check_speed([mods, slow]), "loka_not_slower_than_bf16_mods",
                 "dcnv2/small", "train")
    self.assertFalse(v["met"])
    self.assertIn("measurement problem", v["note"])
    # An FP8 plan gets no such reading.
    fp8 = dict(slow, kernels=["xla_bf16", "xla_fp8_rowwise"])
    v = find_verdict(targets.check_speed([mods, fp8]), "loka_not_slower_than_bf16_mods",
                 "dcnv2/small", "train")
    self.assertFalse(v["met"])
    self.assertEqual(v["note"], "")

  def test_an_all_bf16_plan_serves_the_served_bf16_mods_model(self):
    # Its export stores every site "high": the same program as served bf16+Mods, so a gap
    # between the two rows is noise (CI holds 1.0) or a measurement problem, never a verdict
    # on FP8.
    rng = np.random.default_rng(7)
    served = model_row("wukong", "small", "bf16_mods_served", 1.2, 1.30, rng)
    served["infer"] = speed(1.30, rng, jitter=0.08)
    for loka_infer, met, note in ((1.27, True, "timing noise"),
                                  (1.0, False, "measurement problem")):
      loka = dict(model_row("wukong", "small", "loka", 1.2, loka_infer, rng), kernels=["xla_bf16"])
      loka["infer"] = speed(loka_infer, rng, jitter=0.08)
      v = find_verdict(targets.check_speed([served, loka]),
                   "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
      self.assertEqual(v["met"], met)
      self.assertIn(note, v["note"])
      self.assertIn("exported model", v["note"])
    # A plan with FP8 sites is judged by the bar alone.
    fp8 = dict(loka, kernels=["xla_bf16", "flax_fp8_delayed"])
    v = find_verdict(targets.check_speed([served, fp8]),
                 "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
    self.assertFalse(v["met"])
    self.assertEqual(v["note"], "both infer from exported weights")

  def test_served_bf16_mods_is_the_inference_bar_beside_the_others(self):
    rng = np.random.default_rng(5)
    served = model_row("wukong", "large", "bf16_mods_served", 1.2, 1.6, rng)
    verdicts = targets.check_speed(self.rows + [served])
    v = find_verdict(verdicts, "loka_not_slower_than_bf16_mods_served", "wukong/large", "infer")
    self.assertAlmostEqual(v["value"], 2.0 / 1.6, delta=0.04)
    self.assertTrue(v["met"])
    over = find_verdict(verdicts, "wukong_large_over_bf16_mods_served", "wukong/large", "infer")
    self.assertIsNone(over["met"])                   # reported, not judged
    # Training is the same step as bf16+Mods': no served verdict for it.
    self.assertFalse([x for x in verdicts if "served" in x["target"] and x["mode"] == "train"])
    # A LoKA that only matches bf16+Mods by storing its weights once is caught here.
    slow = model_row("wukong", "large", "bf16_mods_served", 1.2, 2.3, rng)
    v = find_verdict(targets.check_speed(self.rows + [slow]),
                 "loka_not_slower_than_bf16_mods_served", "wukong/large", "infer")
    self.assertFalse(v["met"])

  def test_loka_is_judged_on_its_one_interleaving_timing_where_it_has_one(self):
    # Two rows of one program whose bf16 baselines drifted apart: the ratio of rows reads
    # 0.85x, the pair timed together 1.01x. The verdict takes the pair and says so.
    rng = np.random.default_rng(11)
    served = model_row("wukong", "small", "bf16_mods_served", 1.2, 1.40, rng)
    loka = dict(model_row("wukong", "small", "loka", 1.2, 1.19, rng), kernels=["xla_bf16"])
    by_rows = find_verdict(targets.check_speed([served, loka]),
                       "loka_not_slower_than_bf16_mods_served", "wukong/small", "infer")
    self.assertAlmostEqual(by_rows["value"], 1.19 / 1.40, delta=0.02)
    self.assertFalse(by_rows["met"])
    self.assertNotIn("interleaving", by_rows["note"])
    loka["head_to_head"] = {"bf16_mods_served": {"infer": {"ratio": 1.01, "ci": [0.99, 1.03]}}}
    v = find_verdict(targets.check_speed([served, loka]),
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
    mods = model_row("dcnv2", "large", "bf16_mods", 1.0, 1.0, rng)
    peer = model_row("dcnv2", "large", "pallas_delayed", 1.8, 1.8, rng)
    loka = model_row("dcnv2", "large", "loka", 2.0, 2.0, rng)
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
      note = find_verdict(verdicts, target, "dcnv2/large", "train")["note"]
      self.assertIn(f"LoKA's own step read {own / 1e3:.3g}-0.056 ms over its 4 timings in "
                    f"this call ({56.0 / own - 1:.1%} apart), wider than this CI", note)
    self.assertNotIn("own step", find_verdict(verdicts, "loka_not_slower_than_bf16_mods",
                                          "dcnv2/large", "infer")["note"])
    loka["head_to_head"] = pairs([own * 1.005, own * 1.01, own])
    quiet = find_verdict(targets.check_speed([mods, peer, loka]), "loka_at_least_best_peer",
                     "dcnv2/large", "train")
    self.assertEqual(quiet["note"], "best peer: pallas_delayed; timed in one interleaving")

  def test_interleaved_references_are_the_variants_the_targets_compare_with(self):
    rng = np.random.default_rng(2)
    rows = {v: model_row("wukong", "small", v, train, infer, rng)
            for v, train, infer in (("bf16_mods", 1.1, 1.0), ("fp8_rowwise", 1.3, 0.9),
                                    ("flax_fp8_delayed", 1.2, 1.4), ("loka", 2.0, 2.0))}
    self.assertEqual(targets.interleaved_references("loka", rows),
                     ["bf16_mods", "fp8_rowwise", "flax_fp8_delayed"])
    rows["bf16_mods_served"] = model_row("wukong", "small", "bf16_mods_served", 1.1, 1.3, rng)
    rows["fp8_rowwise"] = model_row("wukong", "small", "fp8_rowwise", 1.3, 1.5, rng)
    self.assertEqual(targets.interleaved_references("loka", rows),
                     ["bf16_mods", "bf16_mods_served", "fp8_rowwise"])

  def test_over_best_single_kernel(self):
    met = find_verdict(self.verdicts, "loka_over_best_single_kernel", "wukong/large", "train")
    self.assertTrue(met["met"])  # 1.6 / 1.1 = 1.45x
    missed = find_verdict(self.verdicts, "loka_over_best_single_kernel", "wukong/large", "infer")
    self.assertAlmostEqual(missed["value"], 2.0 / 1.3, delta=0.05)
    self.assertTrue(missed["met"])

  def test_quality_is_judged_paired_by_seed(self):
    # Every reference at 0.4; an arm's loss 0.4 * (1 + d_s) gives the paired change d_s.
    # Three changes m - e, m, m + e: sd e, half-width t(2) e / sqrt(3), t(2) = 4.303.
    def q(arm, changes, **fields):
      return [quality_row("wukong", "small", arm, s, 0.4 * (1 + d), **fields)
              for s, d in enumerate(changes)]
    refs = q("bf16", (0, 0, 0)) + q("bf16_mods", (0, 0, 0))

    def loka(changes, **fields):
      return find_verdict(targets.check_quality(refs + q("loka", changes, **fields)),
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
    rows = refs + q("loka", (0.0, 5e-5)) + [quality_row("wukong", "small", "loka", 2, 0.4,
                                                         eval_fingerprint="other")]
    two = find_verdict(targets.check_quality(rows), "loka_quality_vs_bf16",
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
    naive = find_verdict(targets.check_quality(rows), "fp8_naive_quality_vs_bf16_mods",
                     "synthetic:wukong/small", "quality")
    self.assertEqual((naive["verdict"], naive["met"], naive["judged"]),
                     ("missed", None, False))
    one = find_verdict(targets.check_quality(rows), "fp8_delayed_quality_vs_bf16",
                   "synthetic:wukong/small", "quality")
    self.assertEqual((one["verdict"], one["n"], one["ci"], one["seeds_needed"]),
                     ("unresolved", 1, None, None))
    self.assertIn("one paired seed measures no spread", one["note"])
    table = tables.quality_verdicts_table(targets.check_quality(rows))
    self.assertIn("| synthetic:wukong/small | naive FP8 | bf16 | 3 | +0.110% | "
                  "[+0.085%, +0.135%] | missed (peer) | - |", table)
    self.assertIn("| Flax delayed everywhere | bf16+Mods | 1 | +0.005% | - | unresolved "
                  "(peer) | >= 2 (no spread yet) |", table)

  def test_an_unresolved_verdict_says_what_its_seeds_still_to_run_would_take(self):
    # Naive FP8 at 0%, +0.1%, +0.2% of bf16: unresolved at three seeds. Its runs take
    # 30, 90 and 60 s (median 60), bf16's 20, 10 and 40 s (median 20): 80 s a paired seed.
    rows = [quality_row("wukong", "small", "bf16", s, 0.5, train_s=t)
            for s, t in enumerate((20.0, 10.0, 40.0))]
    rows += [quality_row("wukong", "small", "fp8_naive", s, 0.5 * (1 + d), train_s=t)
             for s, (d, t) in enumerate(((0.0, 30.0), (1e-3, 90.0), (2e-3, 60.0)))]
    v = find_verdict(targets.check_quality(rows), "fp8_naive_quality_vs_bf16",
                     "synthetic:wukong/small", "quality")
    self.assertEqual((v["verdict"], v["n"], v["seed_s"]), ("unresolved", 3, 80.0))
    more = v["seeds_needed"] - 3
    self.assertGreater(more, 0)
    self.assertIn(f"| unresolved (peer) | {v['seeds_needed']} ({more} more, "
                  f"~{more * 80 / 60:.0f} min) |",
                  tables.quality_verdicts_table([v]))
    # Under a minute in all, in seconds: 10 more seeds at 4 s each.
    self.assertIn("| unresolved (peer) | 13 (10 more, ~40 s) |",
                  tables.quality_verdicts_table([dict(v, seeds_needed=13, seed_s=4.0)]))
    # A run without its training time leaves the count alone.
    rows[0] = {k: x for k, x in rows[0].items() if k != "train_s"}
    v = find_verdict(targets.check_quality(rows), "fp8_naive_quality_vs_bf16",
                     "synthetic:wukong/small", "quality")
    self.assertIsNone(v["seed_s"])
    self.assertIn(f"| unresolved (peer) | {v['seeds_needed']} |",
                  tables.quality_verdicts_table([v]))

  def test_quality_compares_rows_of_one_recipe(self):
    def q(arm, seed, logloss, warmup=None):
      # LoKA's rows name their plan's FP8 kernel: scores equal to bf16+Mods' are a result.
      return quality_row("dlrm", "large", arm, seed, logloss,
                          **({} if warmup is None else {"warmup_steps": warmup}),
                          **({"plan_kernels": ["xla_fp8_rowwise"]} if arm == "loka" else {}))
    # Plain recipe: LoKA 1% worse at both seeds (missed). Warm-up recipe: its own arms, LoKA
    # equal at both (met); mixing the two would pair LoKA-with-warm-up against plain bf16.
    rows = [q(a, s, 0.5) for a in ("bf16", "bf16_mods") for s in (0, 1)]
    rows += [q("loka", s, 0.505) for s in (0, 1)]
    rows += [q(a, s, 0.47, 50) for a in ("bf16", "bf16_mods", "loka") for s in (0, 1)]
    verdicts = targets.check_quality(rows)
    plain = find_verdict(verdicts, "loka_quality_vs_bf16_mods", "synthetic:dlrm/large", "quality")
    self.assertEqual(plain["verdict"], "missed")
    self.assertAlmostEqual(plain["value"], 0.01, places=12)
    warm = find_verdict(verdicts, "loka_quality_vs_bf16_mods", "synthetic:dlrm/large (warmup 50)",
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
    clip = find_verdict(targets.check_quality(rows + clipped), "loka_quality_vs_bf16_mods",
                    "synthetic:dlrm/large (warmup 50, clip 1)", "quality")
    self.assertEqual(clip["verdict"], "missed")
    self.assertAlmostEqual(clip["value"], 0.0009 / 0.471, places=12)
    with self.assertRaisesRegex(ValueError, "clip_norm must be > 0"):
      quality.QualitySettings(clip_norm=0.0)

  def test_a_mods_set_is_judged_where_its_mods_change_an_arm_and_where_seeds_pair(self):
    # bf16 and naive FP8 (no Mods, so no set on their rows) at seeds 0-2. Set A: bf16+Mods
    # and LoKA at seeds 1, 2 and 5. Set B: bf16+Mods alone at seeds 5 and 6.
    rows = [quality_row("dlrm", "large", a, s, 0.5) for a in ("bf16", "fp8_naive")
            for s in (0, 1, 2)]
    rows += [quality_row("dlrm", "large", a, s, 0.5, mods_set="no_bias",
                         **({"plan_kernels": ["xla_fp8_rowwise"]} if a == "loka" else {}))
             for a in ("bf16_mods", "loka") for s in (1, 2, 5)]
    rows += [quality_row("dlrm", "large", "bf16_mods", s, 0.5, mods_set="hard_swish")
             for s in (5, 6)]
    verdicts = targets.check_quality(rows)

    def judged(subject):
      return sorted((v["target"], v["n"]) for v in verdicts if v["subject"] == subject)
    # Naive FP8 against bf16 is one verdict, the default set's: another set holds the same
    # rows and would only repeat it.
    self.assertEqual(judged("synthetic:dlrm/large"), [("fp8_naive_quality_vs_bf16", 3)])
    # Set A: every comparison with an arm of its Mods, at the seeds both arms ran.
    self.assertEqual(judged("synthetic:dlrm/large (Mods no_bias)"),
                     [("fp8_naive_quality_vs_bf16_mods", 2), ("loka_quality_vs_bf16", 2),
                      ("loka_quality_vs_bf16_mods", 3)])
    # Set B: its bf16+Mods shares no seed with naive FP8, so nothing pairs and no verdict is
    # made ("0 paired seeds, unresolved" would read as a measurement).
    self.assertEqual(judged("synthetic:dlrm/large (Mods hard_swish)"), [])
    table = tables.quality_verdicts_table(verdicts)
    self.assertNotIn("| 0 |", table)
    self.assertEqual(table.count("| naive FP8 | bf16 |"), 1)

  def test_a_quality_verdict_over_seeds_names_each_seed_and_its_worst_steps(self):
    # LoKA's mean change rests on seed 2, where its run spiked (as DCNv2 `large`'s did).
    def q(arm, seed, logloss, peak):
      return quality_row("dcnv2", "large", arm, seed, logloss, warmup_steps=50,
                          peak_loss=peak, peak_step=100 + seed)
    rows = [q("bf16", s, 0.4770 + 0.0001 * s, 0.69) for s in range(3)]
    rows += [q("bf16_mods", 0, 0.4766, 0.70), q("bf16_mods", 1, 0.4776, 0.71),
             q("bf16_mods", 2, 0.4847, 5.65)]
    rows += [q("loka", 0, 0.4778, 0.72), q("loka", 1, 0.4766, 0.70), q("loka", 2, 0.5036, 6.91)]
    loka = find_verdict(targets.check_quality(rows), "loka_quality_vs_bf16_mods",
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
    note = find_verdict(targets.check_quality(old), "loka_quality_vs_bf16_mods",
                    "synthetic:dcnv2/large (warmup 50)", "quality")["note"]
    self.assertIn("by seed +0.252%", note)
    self.assertNotIn("worst step", note)
    self.assertNotIn("(seed 2)", tables.quality_table(old))


class BaselineDriftTest(absltest.TestCase):

  def _rows(self, rng):
    return [model_row("dlrm", "large", v, s, s, rng)
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


if __name__ == "__main__":
  absltest.main()
