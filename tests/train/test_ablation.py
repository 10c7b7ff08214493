"""The Mods ablation: combinations, paired verdicts on per-seed losses worked out by hand, the
report files, and `python -m experiments.ablate_mods` end to end on 2 of the 8 combinations
(one seed, then a second added and resumed)."""
import json
import os
import re
import tempfile

import chex
import numpy as np
from absl.testing import absltest

from cli_helpers import PNG_MAGIC, REPO, run_module
from loka_jax.train import ablation

ALL = ("no_bias", "blocknorm", "hard_swish")


def final(ne, logloss, auc=0.7):
  return {"ne": ne, "logloss": logloss, "auc": auc, "steps": 60}


class CombinationsTest(chex.TestCase):

  def test_all_eight_in_order(self):
    combos = ablation.all_combinations()
    self.assertLen(combos, 8)
    self.assertEqual(combos[0], ())
    self.assertEqual(combos[-1], ALL)
    self.assertLen(set(combos), 8)
    self.assertEqual([ablation.combination_label(c) for c in combos],
                     ["baseline", "NB", "BN", "HS", "NB+BN", "NB+HS", "BN+HS", "NB+BN+HS"])
    self.assertEqual(ablation.parse_combinations([]), combos)

  def test_parse(self):
    self.assertEqual(ablation.parse_combinations("none,all"), ((), ALL))
    self.assertEqual(ablation.parse_combinations(["hard_swish+no_bias", "no_bias+hard_swish"]),
                     (("no_bias", "hard_swish"),))                   # canonical, deduplicated
    with self.assertRaisesRegex(ValueError, "unknown mod.*'layernorm'.*no_bias, blocknorm"):
      ablation.parse_combinations("blocknorm+layernorm")

  def test_deterministic_ops_are_a_shared_setting_and_never_timed(self):
    plain = ablation.AblationConfig(timing="off")
    self.assertNotIn("xla_deterministic", plain.shared_settings())  # old workdirs resume
    self.assertTrue(ablation.AblationConfig(timing="off", xla_deterministic=True)
                    .shared_settings()["xla_deterministic"])
    with self.assertRaisesRegex(ValueError, "timing='off'"):
      ablation.AblationConfig(xla_deterministic=True)

  def test_arms_and_config_errors(self):
    config = ablation.AblationConfig(combinations=((), ALL), seeds=(0, 3))
    self.assertEqual([a.name for a in ablation.arms(config)],          # seed by seed
                     ["bf16__none__seed0", "fp8_all__none__seed0",
                      "bf16__no_bias+blocknorm+hard_swish__seed0",
                      "fp8_all__no_bias+blocknorm+hard_swish__seed0",
                      "bf16__none__seed3", "fp8_all__none__seed3",
                      "bf16__no_bias+blocknorm+hard_swish__seed3",
                      "fp8_all__no_bias+blocknorm+hard_swish__seed3"])
    with self.assertRaisesRegex(ValueError, "unknown precision 'fp16'"):
      ablation.AblationConfig(precisions=("fp16",))
    for seeds in ((), (1, 1), (-1,)):
      with self.assertRaisesRegex(ValueError, r"seeds .*distinct non-negative integers"):
        ablation.AblationConfig(seeds=seeds)
    with self.assertRaisesRegex(ValueError, "timing"):
      ablation.AblationConfig(timing="sometimes")
    with self.assertRaisesRegex(ValueError, r"warmup_steps must be in \[0, steps=60\], got 61"):
      ablation.AblationConfig(warmup_steps=61)

  def test_a_workdir_naming_one_seed_resumes_at_any_seeds(self):
    # settings.json of a workdir whose config had one `seed` (its arms are named by it).
    workdir = tempfile.mkdtemp(prefix="loka_ablation_seed_")
    old = dict(json.loads(json.dumps(ablation.AblationConfig().shared_settings())), seed=0)
    with open(os.path.join(workdir, "settings.json"), "w") as f:
      json.dump(old, f)
    ablation.check_settings(ablation.AblationConfig(seeds=(0, 1, 2)), workdir)
    with open(os.path.join(workdir, "settings.json")) as f:
      self.assertNotIn("seed", json.load(f))
    with self.assertRaisesRegex(ablation.SettingsError, r"steps: 60 -> 90"):
      ablation.check_settings(ablation.AblationConfig(steps=90), workdir)

  def test_warmup_reaches_every_arm_and_keeps_old_workdirs(self):
    warm = ablation.AblationConfig(steps=60, warmup_steps=20)
    self.assertEqual(ablation.train_config(warm, seed=3).optim.warmup_steps, 20)
    self.assertEqual(ablation.train_config(ablation.AblationConfig(), 0).optim.warmup_steps, 0)
    self.assertEqual(warm.shared_settings()["warmup_steps"], 20)
    # Without a warm-up the settings are those a workdir written before it existed holds,
    # so such a workdir resumes; one with a warm-up is refused there, and vice versa.
    self.assertNotIn("warmup_steps", ablation.AblationConfig().shared_settings())
    old = tempfile.mkdtemp(prefix="loka_ablation_warmup_")
    ablation.check_settings(ablation.AblationConfig(), old)
    ablation.check_settings(ablation.AblationConfig(), old)
    with self.assertRaisesRegex(ablation.SettingsError, r"warmup_steps: None -> 20"):
      ablation.check_settings(warm, old)
    new = tempfile.mkdtemp(prefix="loka_ablation_warmup_")
    ablation.check_settings(warm, new)
    with self.assertRaisesRegex(ablation.SettingsError, r"warmup_steps: 20 -> None"):
      ablation.check_settings(ablation.AblationConfig(), new)
    # The table's header names the recipe only where it has a warm-up.
    warm_result = ablation.summarize(warm, {}, [], "cpu")
    self.assertIn("60 steps x batch 256 (learning-rate warm-up 20 steps), 2048 held-out",
                  ablation.markdown_table(warm_result))
    self.assertNotIn("warm-up", ablation.markdown_table(
        ablation.summarize(ablation.AblationConfig(), {}, [], "cpu")))


# Held-out log loss by seed (0, 1, 2), each arm from its reference's times (1 + change):
BASE = (0.500, 0.400, 0.250)                       # bf16, no Mods
FP8_BASE = (0.49985, 0.39992, 0.249975)            # changes -0.03%, -0.02%, -0.01% vs BASE
ALL_BF16 = (0.5015, 0.4016, 0.25125)               # +0.3%, +0.4%, +0.5% vs BASE
ALL_FP8 = (0.5015, 0.4020016, 0.2517525)           # +0%, +0.1%, +0.2% vs ALL_BF16


class SummaryTest(chex.TestCase):
  """Paired verdicts on made-up per-seed losses whose intervals are worked out by hand here
  (three changes m - d, m, m + d: half-width t(2) d / sqrt(3), t(2) = 4.303)."""

  def setUp(self):
    super().setUp()
    self.config = ablation.AblationConfig(combinations=((), ALL), seeds=(0, 1, 2))
    self.finals = {}
    for mods, precision, losses, ne in (((), "bf16", BASE, 0.90), ((), "fp8_all", FP8_BASE, 0.905),
                                        (ALL, "bf16", ALL_BF16, 0.89),
                                        (ALL, "fp8_all", ALL_FP8, 0.91)):
      for seed, loss in enumerate(losses):  # NE seed s: ne + 0.01 s (mean ne + 0.01)
        self.finals[ablation.Arm(mods, precision, seed).name] = final(ne + 0.01 * seed, loss)
    speed = lambda s: {"median_us": 1000.0 / s, "speedup": s, "speedup_ci": [s - 0.1, s + 0.1]}
    self.rows = [
        {"combination": "none", "device": "cpu", "gpu": True, "fp8_vs_bf16": {
            "train": [0.8, 0.7, 0.9], "infer": [0.7, 0.6, 0.8]},
         "variants": {"bf16__none": {"train": speed(1.0), "infer": speed(1.0)},
                      "fp8_all__none": {"train": speed(0.8), "infer": speed(0.7)}}},
        {"combination": "no_bias+blocknorm+hard_swish", "device": "cpu", "gpu": True,
         "fp8_vs_bf16": {"train": [1.2, 1.1, 1.3], "infer": [1.25, 1.2, 1.3]},
         "variants": {"bf16__none": {"train": speed(1.0), "infer": speed(1.0)},
                      "bf16__no_bias+blocknorm+hard_swish": {"train": speed(1.5),
                                                             "infer": speed(1.6)},
                      "fp8_all__no_bias+blocknorm+hard_swish": {"train": speed(1.8),
                                                                "infer": speed(2.0)}}},
    ]

  def test_met_missed_and_unresolved(self):
    result = ablation.summarize(self.config, self.finals, self.rows, "cpu")
    self.assertEqual(result["schema"], "loka.ablation/2")
    self.assertTrue(result["complete"])
    self.assertNotIn("noise", result)
    self.assertEqual(result["quality"]["seeds"], [0, 1, 2])
    self.assertEqual(result["quality"]["bound"], 2e-4)
    self.assertIn("paired_quality", result["quality"]["rule"])
    self.assertEqual(result["settings"]["seeds"], [0, 1, 2])
    base, every = result["rows"]
    self.assertEqual((base["label"], every["label"]), ("baseline", "NB+BN+HS"))
    # FP8 vs bf16, no Mods: -0.03%, -0.02%, -0.01%: upper end -0.02% + 0.0248% = +0.0048%
    fp8 = base["fp8_vs_bf16"]
    self.assertEqual(fp8["verdict"], "met")
    self.assertEqual((fp8["n"], fp8["seeds"]), (3, [0, 1, 2]))
    self.assertAlmostEqual(fp8["mean"], -2e-4, places=12)
    self.assertAlmostEqual(fp8["ci"][1], -2e-4 + 4.303 * 1e-4 / 3 ** 0.5, places=9)
    self.assertAlmostEqual(fp8["delta_logloss"], -(0.00015 + 0.00008 + 0.000025) / 3, places=12)
    self.assertIsNone(base["mods_vs_baseline"])
    # The Mods in bf16: +0.3%, +0.4%, +0.5%: lower end 0.4% - 0.248% = +0.152% > +0.02%
    mods = every["mods_vs_baseline"]
    self.assertEqual(mods["verdict"], "missed")
    self.assertAlmostEqual(mods["ci"][0], 0.004 - 4.303 * 0.001 / 3 ** 0.5, places=9)
    # FP8 vs bf16 with all Mods: 0, +0.1%, +0.2%: [-0.148%, +0.348%] holds +0.02%; resolved
    # once t(n-1) 0.1% / sqrt(n) < 0.1% - 0.02%: n = 8: 2.365 / 2.828 = 0.836 (not yet),
    # n = 9: 2.306 / 3 = 0.769
    unresolved = every["fp8_vs_bf16"]
    self.assertEqual(unresolved["verdict"], "unresolved")
    self.assertEqual(unresolved["pairs_to_resolve"], 9)
    np.testing.assert_allclose(unresolved["changes"], [0.0, 0.001, 0.002], atol=1e-12)
    # FP8 with Mods vs the baseline: +0.3%, +0.5004%, +0.701%: lower end ~ +0.00002% < +0.02%
    self.assertEqual(every["fp8_mods_vs_baseline"]["verdict"], "unresolved")
    self.assertAlmostEqual(every["bf16"]["logloss"], sum(ALL_BF16) / 3, places=12)
    self.assertAlmostEqual(every["bf16"]["ne"], 0.90, places=12)       # 0.89, 0.90, 0.91
    self.assertEqual([r["seed"] for r in every["bf16"]["by_seed"]], [0, 1, 2])
    self.assertEqual(result["timing"], "measured")
    self.assertEqual(every["fp8_all"]["train_speedup"], 1.8)
    self.assertAlmostEqual(every["fp8_all"]["train_ms"], 1000.0 / 1.8 / 1e3)
    self.assertEqual(every["fp8_vs_bf16_speedup"]["train"], [1.2, 1.1, 1.3])
    self.assertEqual(result["settings"]["block_size"], 16)              # wukong tiny

  def test_one_seed_measures_no_spread(self):
    config = ablation.AblationConfig(combinations=((), ALL))             # seeds (0,)
    result = ablation.summarize(config, self.finals, [], "cpu")
    base, every = result["rows"]
    for v in (base["fp8_vs_bf16"], every["mods_vs_baseline"], every["fp8_vs_bf16"]):
      self.assertEqual(v["verdict"], "unresolved")
      self.assertEqual((v["n"], v["seeds"]), (1, [0]))
      self.assertIsNone(v["pairs_to_resolve"])
      self.assertIn("one paired seed measures no spread", v["why"])
    self.assertAlmostEqual(every["mods_vs_baseline"]["mean"], 0.003, places=12)
    self.assertIn("+0.300% unresolved (1 seed: no spread)", ablation.markdown_table(result))
    self.assertIn("unresolved for NB+BN+HS (one paired seed measures no spread)",
                  ablation.reading(result))
    self.assertEqual(result["timing"], "skipped (not on a GPU)")

  def test_pending_and_diverged_arms(self):
    finals = dict(self.finals)
    del finals[ablation.Arm(ALL, "fp8_all", 2).name]
    finals[ablation.Arm((), "fp8_all", 1).name] = {
        "error": "NonFiniteError: non-finite loss/gradient in training step 3", "arm": "x"}
    finals[ablation.Arm((), "bf16", 2).name] = {"error": "NonFiniteError: step 9", "arm": "y"}
    result = ablation.summarize(self.config, finals, [], "cpu")
    self.assertFalse(result["complete"])
    self.assertEqual(result["pending"], ["fp8_all__no_bias+blocknorm+hard_swish__seed2"])
    base, every = result["rows"]
    self.assertEqual(base["fp8_all"]["status"], "error")
    self.assertEqual(base["fp8_all"]["by_seed"][1]["status"], "error")
    self.assertAlmostEqual(base["fp8_all"]["logloss"], (0.49985 + 0.249975) / 2, places=12)
    self.assertEqual(every["fp8_all"]["status"], "pending")
    # FP8 diverged at seed 1, where bf16 finished: missed; bf16's seed 2 diverged: unpaired.
    fp8 = base["fp8_vs_bf16"]
    self.assertEqual((fp8["verdict"], fp8["diverged"], fp8["seeds"]), ("missed", [1], [0, 1]))
    self.assertEqual(fp8["unpaired"], {"2": "the reference diverged"})
    self.assertEqual(fp8["changes"][1], None)                            # JSON: no infinity
    # The pending seed pairs with nothing: 0, +0.1% over two seeds, unresolved.
    self.assertEqual(every["fp8_vs_bf16"]["seeds"], [0, 1])
    self.assertEqual(every["fp8_vs_bf16"]["verdict"], "unresolved")
    table = ablation.markdown_table(result)
    self.assertIn("missed (diverged at seed(s) 1)", table)
    self.assertIn("error baseline fp8_all: seed 1: NonFiniteError", table)
    self.assertIn("Incomplete: 1 unit(s) pending", table)
    json.dumps(result, allow_nan=False)                                  # strict JSON

  def test_report_files(self):
    # One run records its worst training step (a spike); the others predate the field.
    self.finals[ablation.Arm(ALL, "fp8_all", 1).name]["peak_loss"] = 6.91
    result = ablation.summarize(self.config, self.finals, self.rows, "cpu")
    self.assertEqual(result["rows"][1]["fp8_all"]["peak_loss"], 6.91)
    workdir = tempfile.mkdtemp(prefix="loka_ablation_report_")
    paths = ablation.write_outputs(result, workdir)
    self.assertEqual(ablation.load(paths["json"])["rows"][1]["fp8_vs_bf16"]["verdict"],
                     "unresolved")
    with open(paths["table"]) as f:
      table = f.read()
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| mods |"))
    self.assertEqual(len(lines[header].split("|")), len(lines[header + 2].split("|")))
    self.assertIn("seed(s) 0, 1, 2;", table)
    self.assertNotIn("noise", table.lower())
    # Baseline: NE means 0.91 / 0.915; log loss means 0.38333 / 0.38325; FP8 vs bf16 -0.020%
    # [-0.045%, +0.005%] met.
    self.assertIn("| baseline | 0.91000 | 0.91500 | 0.38333 | 0.38325 | -0.020% [-0.045, "
                  "+0.005] met | - | - |", table)
    self.assertIn("| NB+BN+HS |", table)
    self.assertIn("+0.100% [-0.148, +0.348] unresolved (9 paired seeds would resolve it)", table)
    self.assertIn("+0.400% [+0.152, +0.648] missed", table)
    self.assertIn("0.56 (1.80x) / 0.50 (2.00x) | - / 6.91 |", table)   # FP8 + all Mods
    with open(paths["plot"], "rb") as f:
      png = f.read()
    self.assertTrue(png.startswith(PNG_MAGIC))
    self.assertGreater(len(png), 20_000)
    # Without timing rows there is no latency panel: the figure is the quality panel alone
    # (the PNG's width, bytes 16-20 of its header, says how many panels it drew).
    untimed = ablation.summarize(self.config, self.finals, [], "cpu")
    path = ablation.plot(untimed, os.path.join(workdir, "untimed.png"))
    with open(path, "rb") as f:
      untimed_png = f.read()
    width = lambda data: int.from_bytes(data[16:20], "big")
    self.assertLess(width(untimed_png), 0.7 * width(png))
    reading = ablation.reading(result)
    self.assertIn("FP8 vs bf16 with the same Mods (2 combination(s)): met for baseline; "
                  "unresolved for NB+BN+HS (9 paired seeds would resolve it).", reading)
    self.assertIn("Mods alone (bf16) vs the bf16 baseline (1 combination(s)): missed for "
                  "NB+BN+HS.", reading)
    self.assertIn("Fastest train step: NB+BN+HS in fp8_all, 1.80x", reading)

  def test_a_report_of_the_older_schema_says_how_to_rerun(self):
    path = os.path.join(REPO, "docs", "results", "ablation_dlrm_large_warmup_h200_2026-11-28.json")
    with self.assertRaisesRegex(ValueError, r"^\S+ablation_dlrm_large_warmup_h200_2026-11-28"
                                r"\.json has schema 'loka.ablation/1', not 'loka.ablation/2' .*"
                                r"rerun `python3 -m experiments.ablate_mods --workdir=DIR`") as e:
      ablation.load(path)
    self.assertNotIn("\n", str(e.exception))
    with open(path) as f:
      old = json.load(f)
    for render in (ablation.markdown_table, ablation.reading):
      with self.assertRaisesRegex(ValueError, "has schema 'loka.ablation/1'"):
        render(old)

  def test_settings_guard(self):
    workdir = tempfile.mkdtemp(prefix="loka_ablation_settings_")
    ablation.check_settings(self.config, workdir)
    ablation.check_settings(ablation.AblationConfig(combinations=((),), workers=2, seeds=(4,)),
                            workdir)
    with self.assertRaisesRegex(ablation.SettingsError, r"steps: 60 -> 90.*new work directory"):
      ablation.check_settings(ablation.AblationConfig(steps=90), workdir)


class ShouldStopTest(chex.TestCase):
  """`run`'s `should_stop` hook: asked before each unit with its expected seconds; True saves
  what finished and leaves the rest pending for a rerun."""

  def config(self):
    # DLRM, the cheapest tower to compile: the hook is asked the same way for any model.
    return ablation.AblationConfig(model="dlrm", steps=3, batch_size=64, num_eval=256,
                                   combinations=((),), timing="off")

  def test_stopping_at_once_saves_every_unit_as_pending(self):
    workdir = tempfile.mkdtemp(prefix="loka_ablation_stop_")
    asked, lines = [], []
    result = ablation.run(self.config(), workdir, log=lines.append,
                          should_stop=lambda expected_s: asked.append(expected_s) or True)
    self.assertEqual(asked, [0.0])               # nothing timed yet; asked once, then stopped
    self.assertFalse(result["complete"])
    self.assertEqual(result["pending"], ["bf16__none__seed0", "fp8_all__none__seed0"])
    self.assertFalse(os.path.exists(os.path.join(workdir, "runs")))
    with open(os.path.join(workdir, "ablation.md")) as f:
      self.assertIn("Incomplete: 2 unit(s) pending", f.read())
    self.assertIn("stopped: 2 unit(s) left; rerun the same command to continue", lines)

  def test_a_stop_after_one_arm_resumes_with_its_time_known(self):
    workdir = tempfile.mkdtemp(prefix="loka_ablation_stop_")
    asked = []
    first = ablation.run(self.config(), workdir, log=lambda line: None,
                         should_stop=lambda expected_s: asked.append(expected_s) or len(asked) > 1)
    self.assertEqual(asked[0], 0.0)
    self.assertGreater(asked[1], 0.0)             # the first arm's seconds
    self.assertFalse(first["complete"])
    self.assertEqual(first["pending"], ["fp8_all__none__seed0"])
    self.assertEqual(first["rows"][0]["bf16"]["status"], "done")
    with open(os.path.join(workdir, "runs", "bf16__none__seed0", "final.json")) as f:
      recorded_s = json.load(f)["time"]
    asked.clear()
    again = ablation.run(self.config(), workdir, log=lambda line: None,
                         should_stop=lambda expected_s: asked.append(expected_s) and False)
    self.assertEqual(asked, [recorded_s])          # the finished arm's final.json time
    self.assertTrue(again["complete"], again["pending"])
    self.assertEqual(again["rows"][0]["bf16"], first["rows"][0]["bf16"])


def run_cli(*args, timeout=400):
  return run_module("experiments.ablate_mods", *args, timeout=timeout)


class CliTest(chex.TestCase):

  def test_two_combinations_then_a_second_seed_resumed(self):
    workdir = tempfile.mkdtemp(prefix="loka_ablate_cli_")
    # DLRM, the cheapest tower to compile (the run is mostly compiles): 40 steps take every
    # arm's held-out NE to about 0.97.
    args = ("--config.run.model=dlrm", "--config.run.preset=tiny", "--config.run.steps=40",
            "--config.run.num_eval=512", "--config.ablation.combinations=none,all",
            "--config.ablation.workers=2", "--config.timing.mode=force",
            "--config.timing.repeats=2", f"--workdir={workdir}")
    first = run_cli(*args)                                   # seeds "0", the default
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    self.assertRegex(first.stdout, r"(?m)^bf16__none__seed0: ne 0\.\d+ logloss")
    self.assertRegex(first.stdout, r"(?m)^timed NB\+BN\+HS ")
    with open(os.path.join(workdir, "ablation.json")) as f:
      one = json.load(f)
    self.assertTrue(one["complete"], one["pending"])
    self.assertEqual(one["rows"][0]["fp8_vs_bf16"]["why"],
                     "one paired seed measures no spread; the seed count is sized from two")
    self.assertTrue(one["timing"].startswith("smoke"))
    with open(os.path.join(workdir, "timing.jsonl")) as f:
      timing_rows = [json.loads(line) for line in f]
    self.assertLen(timing_rows, 2)
    for row in timing_rows:  # one count of steps per sample for every variant of a mode
      for mode in ("train", "infer"):
        inner = {v[mode]["inner"] for v in row["variants"].values()}
        self.assertLen(inner, 1, (mode, inner))
        self.assertGreaterEqual(inner.pop(), 1)

    # A second seed: only its arms train (seed 0's arms and the timing rows are kept).
    second = run_cli(*args, "--config.ablation.seeds=0,1")
    self.assertEqual(second.returncode, 0, second.stderr[-3000:])
    trained = sorted(re.findall(r"(?m)^(\S+__seed\d+): ", second.stdout))
    self.assertEqual(trained, ["bf16__no_bias+blocknorm+hard_swish__seed1", "bf16__none__seed1",
                               "fp8_all__no_bias+blocknorm+hard_swish__seed1",
                               "fp8_all__none__seed1"])
    self.assertNotRegex(second.stdout, r"(?m)^timed ")
    with open(os.path.join(workdir, "ablation.json")) as f:
      result = json.load(f)
    self.assertTrue(result["complete"], result["pending"])
    self.assertEqual(result["settings"]["seeds"], [0, 1])
    self.assertEqual([r["label"] for r in result["rows"]], ["baseline", "NB+BN+HS"])
    for row in result["rows"]:
      for precision in ("bf16", "fp8_all"):
        entry = row[precision]
        self.assertEqual(entry["status"], "done")
        self.assertBetween(entry["ne"], 0.5, 1.05)        # learned something, finite
        self.assertGreater(entry["train_ms"], 0.0)          # smoke-timed
        by_seed = {r["seed"]: r for r in entry["by_seed"]}
        self.assertEqual(sorted(by_seed), [0, 1])
        self.assertNotEqual(by_seed[0]["logloss"], by_seed[1]["logloss"])   # other seeds
        self.assertAlmostEqual(entry["logloss"], (by_seed[0]["logloss"]
                                                  + by_seed[1]["logloss"]) / 2, places=12)
        old = one["rows"][result["rows"].index(row)][precision]
        self.assertEqual(by_seed[0]["logloss"], old["logloss"])    # seed 0 was not retrained
      # Verdicts on the paired seeds, checked against the logged losses.
      judged = [(row["fp8_vs_bf16"], row["fp8_all"], row["bf16"])]
      if row["mods"]:
        base = result["rows"][0]["bf16"]
        judged += [(row["mods_vs_baseline"], row["bf16"], base),
                   (row["fp8_mods_vs_baseline"], row["fp8_all"], base)]
      for v, arm, ref in judged:
        self.assertEqual(v["seeds"], [0, 1])
        self.assertIn(v["verdict"], ("met", "missed", "unresolved"))
        for seed, change in zip(v["seeds"], v["changes"]):
          a, r = arm["by_seed"][seed]["logloss"], ref["by_seed"][seed]["logloss"]
          self.assertAlmostEqual(change, (a - r) / r, places=12)
        lo, hi = v["ci"]
        self.assertEqual(v["verdict"], "met" if hi <= 2e-4 else "missed" if lo > 2e-4
                         else "unresolved")
    with open(os.path.join(workdir, "ablation.md")) as f:
      table = f.read()
    self.assertIn("Mods ablation: dlrm/tiny, 40 steps x batch 256", table)
    self.assertIn("seed(s) 0, 1;", table)
    self.assertIn(table.strip(), second.stdout)
    with open(os.path.join(workdir, "ablation.png"), "rb") as f:
      self.assertTrue(f.read(8) == PNG_MAGIC)
    for arm in ("bf16__none__seed1", "fp8_all__no_bias+blocknorm+hard_swish__seed1"):
      run_dir = os.path.join(workdir, "runs", arm)
      self.assertTrue(os.path.exists(os.path.join(run_dir, "final.json")), arm)
      self.assertFalse(os.path.exists(os.path.join(run_dir, "checkpoints")), arm)

  def test_bad_seeds_are_a_one_line_error(self):
    done = run_cli("--config.ablation.seeds=0,x", "--workdir=" + tempfile.mkdtemp(),
                   timeout=120)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    self.assertEqual(done.stderr.strip(), "error: --config.ablation.seeds='0,x': list distinct "
                     "non-negative integers, e.g. 0,1,2")


if __name__ == "__main__":
  absltest.main()
