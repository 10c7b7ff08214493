"""A benchmark run with a Mods set other than every Mod: its arms build with that set, its rows
are a subject of their own (never standing in for the default's, never judged against them),
and its plans live in their own folder. Checked on tiny towers on the CPU and on hand-made
rows with known answers."""
import json
import os
from unittest import mock

import numpy as np
from absl.testing import absltest

from cli_helpers import load_config, run_module
from bench_rows import speed, tempdir
from experiments.bench import (call as call_lib, collect, mods_set, quality, settings, suite,
                               tables, targets, variants)
from experiments.bench.results import ResultsFile
from loka_jax.models.presets import ModsError
from loka_jax.train.loop import TIME_SPLIT_FIELDS

NB_BN = ("no_bias", "blocknorm")
LABEL = "no_bias+blocknorm"


def _row(variant, speedup, rng, set_label=None):
  row = {"suite": "models", "model": "dlrm", "preset": "large", "variant": variant,
         "device": "H200", "batch_size": 4096, "train": speed(speedup, rng),
         "infer": speed(speedup, rng), "train_memory_bytes": 2 ** 31}
  return row if set_label is None else {**row, "mods_set": set_label}


class ParseTest(absltest.TestCase):

  def test_a_set_is_canonical_and_every_mod_is_the_default(self):
    self.assertEqual(mods_set.parse("blocknorm,no_bias"), NB_BN)  # MODS' order
    self.assertEqual(mods_set.parse(["hard_swish", "blocknorm", "no_bias"]), mods_set.DEFAULT)
    self.assertEqual(mods_set.parse("all"), mods_set.DEFAULT)
    self.assertIsNone(mods_set.label("all"))
    self.assertEqual(mods_set.label(["blocknorm", "no_bias"]), LABEL)
    self.assertEqual(mods_set.plans_root("P", "all"), "P")
    self.assertEqual(mods_set.plans_root("P", NB_BN), os.path.join("P", f"mods_{LABEL}"))
    # A script's empty --mods is every Mod; the reports name a set's subject with it.
    self.assertEqual(mods_set.of_flag([]), mods_set.DEFAULT)
    self.assertEqual(mods_set.of_flag(["blocknorm", "no_bias"]), NB_BN)
    self.assertEqual(mods_set.subject("dlrm", "large", None), "dlrm/large")
    self.assertEqual(mods_set.subject("dlrm", "large", LABEL),
                     f"dlrm/large (Mods {LABEL})")
    self.assertEqual(mods_set.row_subject({"model": "dlrm", "preset": "large",
                                           "mods_set": LABEL}), f"dlrm/large (Mods {LABEL})")

  def test_an_empty_or_unknown_set_is_refused_by_name(self):
    with self.assertRaisesRegex(ValueError, "the Mods set is empty"):
      mods_set.parse(" , ")
    with self.assertRaisesRegex(ValueError, r"unknown Mod\(s\) \['swish'\]"):
      mods_set.parse("no_bias,swish")
    with self.assertRaisesRegex(ValueError, "unknown Mod"):
      suite.SpeedSettings(mods=("layernorm",))
    with self.assertRaisesRegex(ValueError, "empty"):
      quality.QualitySettings(mods=())

  def test_arms_without_mods_are_left_as_they_are(self):
    bf16 = variants.VARIANTS["bf16"]
    self.assertIs(mods_set.apply(bf16, NB_BN), bf16)
    self.assertEqual(mods_set.apply(variants.VARIANTS["loka"], NB_BN).mods, NB_BN)
    self.assertEqual(mods_set.apply(quality.ARMS["bf16_mods"], NB_BN).mods, NB_BN)
    self.assertEqual(mods_set.apply(quality.ARMS["fp8_naive"], NB_BN).mods, ())


class SpeedRunTest(absltest.TestCase):

  def test_the_arms_build_with_the_set_and_its_rows_are_their_own(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "bench.jsonl"), suite.KEY_FIELDS)
    target = suite.tower_targets(["32x16x2"])[0]
    chosen = variants.parse_variants(["bf16_mods"])
    real_build = suite.Target.build
    built = []

    def spy(self_, site, mods=()):   # records what was built, builds it for real
      built.append(tuple(mods))
      return real_build(self_, site, mods)

    def run(mods):
      settings = suite.SpeedSettings(repeats=3, probe=False, min_call_s=5e-4, mods=mods)
      with mock.patch.object(suite.Target, "build", spy):
        return suite.run_target(target, chosen, results, settings=settings,
                                deadline=float("inf"), device="cpu", log=lambda _: None)
    self.assertTrue(run(mods_set.DEFAULT))
    self.assertEqual(built, [(), ("all",)])
    built.clear()
    self.assertTrue(run(NB_BN))          # the default's rows do not stand in for the set's
    self.assertEqual(built, [(), NB_BN])
    rows = list(results.rows())
    self.assertEqual([(r["variant"], r.get("mods_set")) for r in rows],
                     [("bf16", None), ("bf16_mods", None), ("bf16", LABEL),
                      ("bf16_mods", LABEL)])
    self.assertEqual(rows[3]["mods"], list(NB_BN))
    self.assertNotIn("mods_set", rows[1])  # the default's rows keep the keys they always had
    built.clear()
    self.assertTrue(run(NB_BN))          # a rerun of the set skips its finished rows
    self.assertEqual(built, [])
    self.assertLen(list(results.rows()), 4)
    # Reports name the set and keep the two apart.
    text = tables.speed_table(rows, "towers")
    self.assertIn(f"| tower | 32x16x2 (Mods {LABEL}) | bf16+Mods |", text)
    self.assertIn("| tower | 32x16x2 | bf16+Mods |", text)
    self.assertEqual(set(targets.speed_index(rows)),
                     {("towers", "tower", "32x16x2", "cpu", None),
                      ("towers", "tower", "32x16x2", "cpu", LABEL)})

  def test_its_loka_plan_is_looked_up_in_the_sets_own_folder(self):
    out = tempdir(self)
    plans = os.path.join(out, "plans")
    target = suite.tower_targets(["32x16x2"])[0]
    loka = mods_set.apply(variants.VARIANTS["loka"], NB_BN)
    settings = suite.SpeedSettings(probe=False, plans_dir=plans, mods=NB_BN)
    with mock.patch.object(suite.planning, "load", return_value=None) as load:
      plan, _, missing = suite.plan_for(target, loka, None, settings)
    self.assertIsNone(plan)
    self.assertIn("not ready", missing)
    load.assert_called_once_with(os.path.join(plans, f"mods_{LABEL}"), "tower", "32x16x2")


class VerdictTest(absltest.TestCase):

  def test_each_set_is_judged_against_its_own_bf16_mods(self):
    rng = np.random.default_rng(0)
    # Default set: LoKA 1.10x its bf16+Mods (met). Without Hard Swish: 0.90x its own (missed);
    # judged against the default's bf16+Mods it would read 0.90 / 1.0 as well, but against the
    # set's 1.2x bf16+Mods it reads 0.75: the set's own row must be the one used.
    rows = [_row("bf16", 1.0, rng), _row("bf16_mods", 1.0, rng), _row("loka", 1.1, rng),
            _row("bf16", 1.0, rng, LABEL), _row("bf16_mods", 1.2, rng, LABEL),
            _row("loka", 0.9, rng, LABEL)]
    verdicts = {(v["subject"], v["mode"]): v for v in targets.check_speed(rows)
                if v["target"] == "loka_not_slower_than_bf16_mods"}
    self.assertTrue(verdicts[("dlrm/large", "train")]["met"])
    other = verdicts[(f"dlrm/large (Mods {LABEL})", "train")]
    self.assertFalse(other["met"])
    self.assertAlmostEqual(other["value"], 0.75, delta=0.02)
    self.assertIn(f"dlrm/large (Mods {LABEL})",
                  tables.glance_table(targets.check_speed(rows)))

  def test_collected_files_keep_both_sets_rows(self):
    out = tempdir(self)
    rng = np.random.default_rng(1)
    paths = []
    for name, label in (("a.jsonl", None), ("b.jsonl", LABEL)):
      paths.append(os.path.join(out, name))
      with open(paths[-1], "w") as f:
        f.write(json.dumps(_row("bf16_mods", 1.0, rng, label)) + "\n")
    self.assertLen(collect.read_rows(paths), 2)

  def test_quality_rows_of_a_set_are_compared_with_one_another_and_the_shared_runs(self):
    def q(arm, seed, logloss, label=None):
      row = {"suite": "quality", "data": "synthetic", "model": "dlrm", "preset": "large",
             "arm": arm, "seed": seed, "device": "H200", "logloss": logloss, "ne": 0.9,
             "auc": 0.7, "eval_fingerprint": "e", "warmup_steps": 50,
             **({"plan_kernels": ["xla_fp8_rowwise"]} if arm == "loka" else {})}
      return row if label is None else {**row, "mods_set": label}
    # The arms without Mods ran once, in the default set; the set's comparison shares them.
    rows = [q("bf16", s, 0.47) for s in range(3)] + [q("fp8_naive", 0, 0.4730)]
    rows += [q(a, s, 0.47 * 1.01) for a in ("bf16_mods", "loka") for s in range(3)]  # +1%
    rows += [q("bf16_mods", s, 0.47, LABEL) for s in range(3)]
    rows += [q("loka", s, 0.47 * (1 + d), LABEL) for s, d in enumerate((0.0, 1e-5, 2e-5))]
    verdicts = {v["subject"]: v for v in targets.check_quality(rows)
                if v["target"] == "loka_quality_vs_bf16"}
    self.assertEqual(verdicts["synthetic:dlrm/large (warmup 50)"]["verdict"], "missed")
    mine = verdicts[f"synthetic:dlrm/large (warmup 50) (Mods {LABEL})"]
    # Paired with the shared bf16 runs: 0, 0.001%, 0.002%, mean 1e-5, upper end
    # 1e-5 + 4.303 * 1e-5 / sqrt(3) = 3.484e-5 <= 2e-4.
    self.assertEqual(mine["verdict"], "met")
    self.assertAlmostEqual(mine["value"], 1e-5, places=10)
    self.assertAlmostEqual(mine["ci"][1], 3.4843e-5, places=8)
    table = tables.quality_table(rows)
    self.assertIn(f"| synthetic | dlrm | large (warmup 50) (Mods {LABEL}) | loka | 0,1,2 |",
                  table)
    self.assertIn(f"| synthetic | dlrm | large (warmup 50) (Mods {LABEL}) | bf16 | 0,1,2 |",
                  table)
    self.assertIn(f"| synthetic | dlrm | large (warmup 50) (Mods {LABEL}) | fp8_naive | 0 |",
                  table)
    # Only the arms without Mods are shared: the default set's Mods arms stay its own.
    self.assertEqual(table.count("| bf16_mods | 0,1,2 |"), 2)
    comparison = [c for c in quality.comparisons(rows) if c.mods_set == LABEL]
    self.assertLen(comparison, 1)
    self.assertEqual(
        sorted(r["arm"] for r in rows if comparison[0].holds(r)),
        ["bf16"] * 3 + ["bf16_mods"] * 3 + ["fp8_naive"] + ["loka"] * 3)


class QualityRunTest(absltest.TestCase):

  def test_the_sets_arms_train_apart_and_look_for_the_sets_plan(self):
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    common = dict(preset="tiny", steps=2, batch_size=64, min_eval=64, noise_seeds=(),
                  arms=("bf16", "bf16_mods", "loka"), plans_dir=os.path.join(out, "plans"))
    logs = []
    for mods in (mods_set.DEFAULT, NB_BN):
      # Not done: the LoKA arm waits for its plan (no probe here), every other arm trained.
      self.assertFalse(quality.run_model("dlrm", quality.QualitySettings(mods=mods, **common),
                                         results, out, deadline=float("inf"), device="cpu",
                                         log=logs.append))
    rows = list(results.rows())
    # bf16 trained once: the set's run of it is the default set's.
    self.assertEqual([(r["arm"], r.get("mods_set"), r["mods"]) for r in rows],
                     [("bf16", None, []), ("bf16_mods", None, ["all"]),
                      ("bf16_mods", LABEL, list(NB_BN))])
    self.assertLen([line for line in logs if " bf16 seed 0" in line], 1)
    # Each trained run says where its time went (the loop's split of final.json).
    for row in rows:
      self.assertEqual(sorted(row["time_split"]), sorted(TIME_SPLIT_FIELDS))
      self.assertLessEqual(sum(row["time_split"].values()), row["train_s"] + 0.2)
    self.assertNotEqual(rows[1]["logloss"], rows[2]["logloss"])  # Hard Swish on, then off
    self.assertTrue(os.path.isdir(os.path.join(out, "synthetic", "dlrm_tiny",
                                               f"bf16_mods_seed0_mods_{LABEL}")))
    missing = [line for line in logs if "no plan at" in line]
    self.assertLen(missing, 2)
    self.assertIn(os.path.join(out, "plans", f"mods_{LABEL}", "dlrm_tiny", "plan.json"),
                  missing[1])


class KeepBiasCheckTest(absltest.TestCase):
  """A keep_bias pattern that keeps no bias at a model the call runs stops the call before its
  first row; one that keeps a bias passes. DLRM `tiny`'s prediction layer, top_mlp/dense_2,
  keeps its bias under No Bias anyway; top_mlp/dense_0's bias is one No Bias drops."""

  SUITES = (("bench_quality", "--config.quality.data=synthetic", "--config.quality.preset=tiny"),
            ("bench_models", "--config.targets.presets=tiny"))

  def call(self, config, pattern, *fields):
    return settings.from_config(load_config(config, "--config.targets.models=dlrm",
                                            f"--config.targets.mods=all,keep_bias:{pattern}",
                                            *fields), "/w")

  def test_the_speed_and_quality_suites_check_every_model_they_run(self):
    for config, *fields in self.SUITES:
      with self.subTest(config):
        with self.assertRaisesRegex(
            ModsError, r"^--config.targets.mods=no_bias,blocknorm,hard_swish,"
            r"keep_bias:top_mlp/dense_2 at dlrm/tiny: keep_bias pattern\(s\) "
            r"\['top_mlp/dense_2'\] keep no bias: .*with a bias anyway: top_mlp/dense_2"):
          call_lib.check_mods_set(self.call(config, "top_mlp/dense_2", *fields))
        call_lib.check_mods_set(self.call(config, "top_mlp/dense_0", *fields))

  def test_the_bench_exits_with_one_line_and_writes_no_row(self):
    out = tempdir(self)
    done = run_module("experiments.bench", "--config=experiments/configs/bench_quality.py",
                      "--config.quality.data=synthetic", "--config.quality.preset=tiny",
                      "--config.targets.models=dlrm", "--config.quality.steps=2",
                      "--config.quality.arms=bf16_mods", "--config.probe.enabled=false",
                      "--config.targets.mods=all,keep_bias:top_mlp/dense_2", f"--workdir={out}",
                      timeout=240)
    self.assertEqual(done.returncode, 1, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    self.assertRegex(last, r"^error: --config.targets.mods=.* at dlrm/tiny: keep_bias pattern")
    self.assertNotIn("Traceback", done.stderr)
    self.assertFalse(os.path.exists(os.path.join(out, "quality.jsonl")))


class CliTest(absltest.TestCase):

  def test_the_mods_field_reaches_the_rows_and_a_bad_one_is_refused(self):
    out = tempdir(self)
    cmd = ["experiments.bench",
           "--config=" + os.path.join("experiments", "configs", "bench_towers.py"),
           "--config.targets.towers=32x16x2", "--config.speed.variants=bf16_mods",
           "--config.speed.repeats=3", "--config.pacing.max_minutes=3", f"--workdir={out}",
           "--config.probe.enabled=false", "--config.speed.min_call_ms=0.5",
           # conftest's compilation cache (unset, one in the workdir): the tower's steps this
           # file compiled are not compiled again
           f"--config.compile_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}"]
    bad = run_module(*cmd, "--config.targets.mods=no_bias,swish", timeout=240)
    self.assertNotEqual(bad.returncode, 0)
    self.assertIn("--config.targets.mods=no_bias,swish: unknown Mod(s) ['swish']", bad.stderr)
    run = run_module(*cmd, "--config.targets.mods=blocknorm,no_bias", timeout=240)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])
    rows = [json.loads(line) for line in open(os.path.join(out, "bench.jsonl"))]
    self.assertEqual([(r["variant"], r.get("mods_set"), r["mods"]) for r in rows],
                     [("bf16", LABEL, []), ("bf16_mods", LABEL, list(NB_BN))])
    self.assertIn(f"32x16x2 (Mods {LABEL})", open(os.path.join(out, "report.md")).read())


if __name__ == "__main__":
  absltest.main()
