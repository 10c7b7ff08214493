"""The Mods ablation: combinations, verdicts worked out by hand, the report files, and
`python -m experiments.ablate_mods` end to end on 2 of the 8 combinations (then resumed)."""
import json
import os
import tempfile

import chex
from absl.testing import absltest

from cli_helpers import PNG_MAGIC, run_module
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
    config = ablation.AblationConfig(combinations=((), ALL), noise_seeds=(3,))
    self.assertEqual([a.name for a in ablation.arms(config)],
                     ["bf16__none__seed0", "fp8_all__none__seed0",
                      "bf16__no_bias+blocknorm+hard_swish__seed0",
                      "fp8_all__no_bias+blocknorm+hard_swish__seed0", "bf16__none__seed3"])
    with self.assertRaisesRegex(ValueError, "unknown precision 'fp16'"):
      ablation.AblationConfig(precisions=("fp16",))
    with self.assertRaisesRegex(ValueError, "noise_seeds"):
      ablation.AblationConfig(noise_seeds=(0,))
    with self.assertRaisesRegex(ValueError, "timing"):
      ablation.AblationConfig(timing="sometimes")
    with self.assertRaisesRegex(ValueError, r"warmup_steps must be in \[0, steps=60\], got 61"):
      ablation.AblationConfig(warmup_steps=61)

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


class SummaryTest(chex.TestCase):
  """Verdicts on made-up results whose expected values are worked out by hand here."""

  def setUp(self):
    super().setUp()
    self.config = ablation.AblationConfig(combinations=((), ALL), noise_seeds=(1, 2))
    name = lambda mods, p, seed=0: ablation.Arm(mods, p, seed).name
    self.finals = {
        name((), "bf16"): final(0.90, 0.500),
        name((), "bf16", 1): final(0.904, 0.502),
        name((), "bf16", 2): final(0.896, 0.498),
        name((), "fp8_all"): final(0.905, 0.503),      # +0.003: inside 2 x std = 0.004
        name(ALL, "bf16"): final(0.89, 0.495),         # -0.005: better
        name(ALL, "fp8_all"): final(0.91, 0.505),      # +0.010 vs bf16 with Mods: worse
    }
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

  def test_verdicts(self):
    result = ablation.summarize(self.config, self.finals, self.rows, "cpu")
    self.assertEqual(result["schema"], "loka.ablation/1")
    self.assertTrue(result["complete"])
    noise = result["noise"]
    self.assertEqual(noise["seeds"], [0, 1, 2])
    self.assertAlmostEqual(noise["std"], 0.002, places=9)            # std of .500 .502 .498
    self.assertAlmostEqual(noise["tolerance"], 0.004, places=9)      # 2 x std > 0.02% x .5
    base, every = result["rows"]
    self.assertEqual((base["label"], every["label"]), ("baseline", "NB+BN+HS"))
    self.assertEqual(base["fp8_vs_bf16"]["verdict"], "neutral")
    self.assertAlmostEqual(base["fp8_vs_bf16"]["abs"], 0.003, places=9)
    self.assertAlmostEqual(base["fp8_vs_bf16"]["rel"], 0.006, places=9)
    self.assertIsNone(base["mods_vs_baseline"])
    self.assertEqual(every["mods_vs_baseline"]["verdict"], "better")
    self.assertEqual(every["fp8_vs_bf16"]["verdict"], "worse")
    self.assertAlmostEqual(every["fp8_vs_bf16"]["abs"], 0.010, places=9)
    self.assertEqual(every["fp8_mods_vs_baseline"]["verdict"], "worse")   # +0.005
    self.assertEqual(result["timing"], "measured")
    self.assertEqual(every["fp8_all"]["train_speedup"], 1.8)
    self.assertAlmostEqual(every["fp8_all"]["train_ms"], 1000.0 / 1.8 / 1e3)
    self.assertEqual(every["fp8_vs_bf16_speedup"]["train"], [1.2, 1.1, 1.3])
    self.assertEqual(result["settings"]["block_size"], 16)              # wukong tiny

  def test_without_noise_seeds_the_relative_bound_applies(self):
    config = ablation.AblationConfig(combinations=((),))
    finals = {k: v for k, v in self.finals.items() if "none__seed0" in k}
    result = ablation.summarize(config, finals, [], "cpu")
    self.assertIsNone(result["noise"]["std"])
    self.assertAlmostEqual(result["noise"]["tolerance"], 1e-4)          # 0.02% of 0.5
    self.assertEqual(result["rows"][0]["fp8_vs_bf16"]["verdict"], "worse")   # +0.003
    self.assertEqual(result["timing"], "skipped (not on a GPU)")

  def test_pending_and_failed_arms(self):
    finals = dict(self.finals)
    del finals[ablation.Arm(ALL, "fp8_all", 0).name]
    finals[ablation.Arm((), "fp8_all", 0).name] = {
        "error": "NonFiniteError: non-finite loss/gradient in training step 3", "arm": "x"}
    result = ablation.summarize(self.config, finals, [], "cpu")
    self.assertFalse(result["complete"])
    self.assertEqual(result["pending"], ["fp8_all__no_bias+blocknorm+hard_swish__seed0"])
    base, every = result["rows"]
    self.assertEqual(base["fp8_all"]["status"], "error")
    self.assertEqual(every["fp8_all"]["status"], "pending")
    self.assertIsNone(base["fp8_vs_bf16"])
    table = ablation.markdown_table(result)
    self.assertIn("error baseline fp8_all: NonFiniteError", table)
    self.assertIn("Incomplete: 1 unit(s) pending", table)

  def test_report_files(self):
    # One run records its worst training step (a spike); the others predate the field.
    self.finals[ablation.Arm(ALL, "fp8_all", 0).name]["peak_loss"] = 6.91
    result = ablation.summarize(self.config, self.finals, self.rows, "cpu")
    self.assertEqual(result["rows"][1]["fp8_all"]["peak_loss"], 6.91)
    workdir = tempfile.mkdtemp(prefix="loka_ablation_report_")
    paths = ablation.write_outputs(result, workdir)
    with open(paths["json"]) as f:
      self.assertEqual(json.load(f)["rows"][1]["fp8_vs_bf16"]["verdict"], "worse")
    with open(paths["table"]) as f:
      table = f.read()
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| mods |"))
    self.assertEqual(len(lines[header].split("|")), len(lines[header + 2].split("|")))
    self.assertIn("| baseline | 0.90000 | 0.90500 | 0.50000 | 0.50300 | +0.00300 (+0.600%) "
                  "neutral |", table)
    self.assertIn("| NB+BN+HS |", table)
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
    self.assertIn("FP8 vs bf16 with the same Mods (2 combination(s)): neutral for baseline; "
                  "worse for NB+BN+HS.", reading)
    self.assertIn("Fastest train step: NB+BN+HS in fp8_all, 1.80x", reading)

  def test_settings_guard(self):
    workdir = tempfile.mkdtemp(prefix="loka_ablation_settings_")
    ablation.check_settings(self.config, workdir)
    ablation.check_settings(ablation.AblationConfig(combinations=((),), workers=2), workdir)
    with self.assertRaisesRegex(ablation.SettingsError, r"steps: 60 -> 90.*new work directory"):
      ablation.check_settings(ablation.AblationConfig(steps=90), workdir)


class ShouldStopTest(chex.TestCase):
  """`run`'s `should_stop` hook: asked before each unit with its expected seconds; True saves
  what finished and leaves the rest pending for a rerun."""

  def config(self):
    return ablation.AblationConfig(steps=3, num_eval=256, combinations=((),), timing="off")

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

  def test_two_combinations_end_to_end_then_resumed(self):
    workdir = tempfile.mkdtemp(prefix="loka_ablate_cli_")
    args = ("--config.run.model=wukong", "--config.run.preset=tiny", "--config.run.steps=20",
            "--config.run.num_eval=512", "--config.ablation.combinations=none,all",
            "--config.ablation.workers=2", "--config.timing.mode=force",
            "--config.timing.repeats=2", f"--workdir={workdir}")
    first = run_cli(*args)
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    self.assertRegex(first.stdout, r"(?m)^bf16__none__seed0: ne 0\.\d+ logloss")
    self.assertRegex(first.stdout, r"(?m)^timed NB\+BN\+HS ")
    with open(os.path.join(workdir, "ablation.json")) as f:
      result = json.load(f)
    self.assertTrue(result["complete"], result["pending"])
    self.assertEqual([r["label"] for r in result["rows"]], ["baseline", "NB+BN+HS"])
    for row in result["rows"]:
      for precision in ("bf16", "fp8_all"):
        entry = row[precision]
        self.assertEqual(entry["status"], "done")
        self.assertBetween(entry["ne"], 0.5, 1.05)        # learned something, finite
        self.assertGreater(entry["train_ms"], 0.0)          # smoke-timed
        self.assertGreater(entry["infer_ms"], 0.0)
      self.assertIn(row["fp8_vs_bf16"]["verdict"], ("neutral", "better", "worse"))
      self.assertLen(row["fp8_vs_bf16_speedup"]["train"], 3)
    self.assertTrue(result["timing"].startswith("smoke"))
    self.assertIsNone(result["noise"]["std"])              # one seed: the relative bound
    self.assertNotEqual(result["rows"][0]["bf16"]["ne"], result["rows"][1]["bf16"]["ne"])
    for arm in ("bf16__none__seed0", "fp8_all__no_bias+blocknorm+hard_swish__seed0"):
      run_dir = os.path.join(workdir, "runs", arm)
      self.assertTrue(os.path.exists(os.path.join(run_dir, "final.json")), arm)
      self.assertFalse(os.path.exists(os.path.join(run_dir, "checkpoints")), arm)
    with open(os.path.join(workdir, "timing.jsonl")) as f:
      timing_rows = [json.loads(line) for line in f]
    self.assertLen(timing_rows, 2)
    for row in timing_rows:  # one count of steps per sample for every variant of a mode
      for mode in ("train", "infer"):
        inner = {v[mode]["inner"] for v in row["variants"].values()}
        self.assertLen(inner, 1, (mode, inner))
        self.assertGreaterEqual(inner.pop(), 1)
    with open(os.path.join(workdir, "ablation.md")) as f:
      table = f.read()
    self.assertIn("Mods ablation: wukong/tiny, 20 steps x batch 256", table)
    self.assertIn(table.strip(), first.stdout)
    with open(os.path.join(workdir, "ablation.png"), "rb") as f:
      self.assertTrue(f.read(8) == PNG_MAGIC)

    again = run_cli(*args)                                   # resumed: nothing to redo
    self.assertEqual(again.returncode, 0, again.stderr[-3000:])
    self.assertNotRegex(again.stdout, r"(?m)^(\S+__seed\d+: |timed )")
    with open(os.path.join(workdir, "ablation.json")) as f:
      self.assertEqual(json.load(f)["rows"], result["rows"])


if __name__ == "__main__":
  absltest.main()
