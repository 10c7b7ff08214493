"""The bench's quality protocol on the CPU: one held-out set for every arm, checkpoints of
large states, a plan without FP8 handed the bf16+Mods run, the warm-up and clipped recipes,
and quality runs paced against the call's hard end."""
import dataclasses
import json
import os
import time
from unittest import mock

from absl.testing import absltest

from bench_rows import find_verdict, quality_row, tempdir
from loka_jax import dispatch
from experiments.bench import mods_set, pace, planning, quality, tables, targets
from experiments.bench.results import ResultsFile
from loka_jax.kernels.choice import KernelChoice
from loka_jax.train import read_metrics


class QualityProtocolTest(absltest.TestCase):

  def test_every_arm_scores_the_same_eval_set(self):
    out = tempdir(self)
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
      out = tempdir(self)
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

  def test_a_run_expected_to_be_short_saves_no_checkpoint_before_its_end(self):
    # Seed 0's run has no recorded time to expect and is saved every quarter; seed 1's is
    # expected to take about as long as seed 0's (seconds), under the bar, and is not saved
    # midway. With the bar at 0 every run is saved again; the scores never change.
    self.assertEqual(quality.checkpoint_plan(100, 8, False, quality.SHORT_RUN_S - 0.1), (0, 0))
    self.assertEqual(quality.checkpoint_plan(100, 8, True, quality.SHORT_RUN_S - 0.1), (0, 1))
    self.assertEqual(quality.checkpoint_plan(100, 8, False, quality.SHORT_RUN_S), (2, 3))
    scores = {}
    for bar in (quality.SHORT_RUN_S, 0.0):
      out = tempdir(self)
      settings = quality.QualitySettings(preset="tiny", steps=8, batch_size=64, min_eval=64,
                                         arms=("bf16",), seeds=(0, 1))
      results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
      with mock.patch.object(quality, "SHORT_RUN_S", bar):
        self.assertTrue(quality.run_model("dlrm", settings, results, out,
                                          deadline=float("inf"), device="cpu"))
      rows = sorted(results.rows(), key=lambda r: r["seed"])
      self.assertLess(rows[0]["train_s"] * pace.MARGIN, quality.SHORT_RUN_S)
      plans = []
      for row in rows:
        with open(os.path.join(quality.run_dir(out, row), "config.json")) as f:
          train = json.load(f)["train"]
        plans.append((train["checkpoint_every"], train["keep_checkpoints"]))
      self.assertEqual(plans, [(2, 3), (0, 0)] if bar else [(2, 3), (2, 3)])
      scores[bar] = [r["logloss"] for r in rows]
    self.assertEqual(scores[quality.SHORT_RUN_S], scores[0.0])

  def _save_uniform_plan(self, settings, kernel):
    path = planning.plan_path(settings.plans_root, "dlrm", "tiny")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    dispatch.save_plan({"schema": dispatch.SCHEMA, "model": "dlrm", "sites": {}, "rules": [],
                        "default": KernelChoice.uniform(kernel).to_dict()}, path)
    return path

  def test_a_plan_without_fp8_hands_loka_the_bf16_mods_run(self):
    out = tempdir(self)
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
    rows = [quality_row("dlrm", "large", "bf16", s, 0.47 + 0.001 * s) for s in range(3)]
    rows += [quality_row("dlrm", "large", "bf16_mods", 0, 0.4705),
             quality_row("dlrm", "large", "loka", 0, 0.4705, same_run_as="bf16_mods")]
    table = tables.quality_table(rows)
    self.assertIn("| loka (bf16_mods' runs at seeds [0]: no FP8 site) |", table)
    self.assertNotIn("| bf16_mods (", table)
    verdict = find_verdict(targets.check_quality(rows), "loka_quality_vs_bf16_mods",
                       "synthetic:dlrm/large", "quality")
    self.assertEqual((verdict["verdict"], verdict["met"]), ("not applicable", None))
    self.assertIn("the plan runs no FP8 kernel", verdict["note"])
    self.assertIn("at seeds [0] its rows are the bf16+Mods runs", verdict["note"])
    self.assertNotIn("no FP8 kernel", find_verdict(targets.check_quality(rows[:3] + rows[3:4] + [
        quality_row("dlrm", "large", "loka", 0, 0.4705, plan_kernels=["xla_fp8_rowwise"])]),
        "loka_quality_vs_bf16_mods", "synthetic:dlrm/large", "quality")["note"])

  def run_recipes(self, field, values, logs=None):
    """(folder, results) of DLRM `tiny` bf16 at seed 0, 4 steps, once per recipe `field`
    value."""
    out = tempdir(self)
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    common = dict(preset="tiny", steps=4, batch_size=64, min_eval=100, arms=("bf16",),
                  noise_seeds=())
    for value in values:
      self.assertTrue(quality.run_model(
          "dlrm", quality.QualitySettings(**{field: value}, **common), results, out,
          deadline=float("inf"), device="cpu",
          log=(lambda _: None) if logs is None else logs.append))
    return out, results

  def test_a_warm_up_recipe_trains_its_own_runs(self):
    out, results = self.run_recipes("warmup_steps", (0, 2))
    rows = list(results.rows())
    self.assertEqual(sorted(quality.row_warmup(r) for r in rows), [0, 2])
    self.assertNotIn("warmup_steps", rows[0])  # plain rows keep the keys they always had
    # Step 1 of a warm-up from 0 applies no update, so the two runs must differ.
    self.assertNotEqual(rows[0]["logloss"], rows[1]["logloss"])
    run_dir = os.path.join(out, "synthetic", "dlrm_tiny", "bf16_seed0_warmup2")
    config = json.load(open(os.path.join(run_dir, "config.json")))
    self.assertEqual(config["train"]["optim"]["warmup_steps"], 2)

  def test_naive_fp8_with_the_mods_pairs_with_bf16_mods_and_is_judged_as_a_peer(self):
    out = tempdir(self)
    settings = quality.QualitySettings(preset="tiny", steps=3, batch_size=64, min_eval=100,
                                       arms=("bf16_mods", "fp8_naive_mods"), seeds=(0, 1))
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    self.assertTrue(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                      device="cpu", log=lambda _: None))
    by = {(r["arm"], r["seed"]): r for r in results.rows()}
    naive_mods = by["fp8_naive_mods", 0]
    self.assertEqual((naive_mods["precision"], naive_mods["mods"]), ("fp8_all", ["all"]))
    # bf16+Mods' architecture: the same initial weights, bias and norm scales included.
    self.assertEqual(naive_mods["init_fingerprint"], by["bf16_mods", 0]["init_fingerprint"])
    self.assertNotEqual(naive_mods["logloss"], by["bf16_mods", 0]["logloss"])  # FP8 ran
    self.assertNotIn("fp8_naive_mods", quality.QualitySettings().arms)  # asked for by name
    # Hand-made scores: +0.5% and +0.7% of bf16+Mods' at two seeds.
    rows = [quality_row("dlrm", "tiny", "bf16_mods", s, loss) for s, loss in enumerate((0.5, 0.6))]
    rows += [quality_row("dlrm", "tiny", "fp8_naive_mods", s, loss * (1 + d))
             for s, (loss, d) in enumerate(((0.5, 5e-3), (0.6, 7e-3)))]
    v = find_verdict(targets.check_quality(rows), "fp8_naive_mods_quality_vs_bf16_mods",
                     "synthetic:dlrm/tiny", "quality")
    self.assertEqual((v["judged"], v["n"]), (False, 2))
    self.assertAlmostEqual(v["value"], 6e-3)
    self.assertIn("| synthetic:dlrm/tiny | naive FP8 with the Mods | bf16+Mods | 2 | +0.600% |",
                  tables.quality_verdicts_table(targets.check_quality(rows)))

  def test_loka_under_the_error_budget_alone_reads_its_own_plan_and_is_judged_as_a_peer(self):
    # LoKA's plan keeps bf16 everywhere (its row is bf16+Mods' run); the plan selected by the
    # error budget alone runs FP8 forwards, from its own folder, and trains a run of its own.
    out = tempdir(self)
    settings = quality.QualitySettings(preset="tiny", steps=3, batch_size=64, min_eval=100,
                                       arms=("bf16_mods", "loka", "loka_accuracy"), seeds=(0,),
                                       plans_dir=os.path.join(out, "plans"))
    asked = []

    def plan_maker(model, accuracy_only):
      asked.append(accuracy_only)
      root = os.path.join(settings.plans_root, "accuracy_only") if accuracy_only else (
          settings.plans_root)
      path = planning.plan_path(root, model, settings.preset)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      forward = "xla_fp8_tensorwise" if accuracy_only else "xla_bf16"
      dispatch.save_plan({"schema": "loka.plan/1", "sites": {}, "default": {
          "fwd": forward, "grad_lhs": "xla_bf16", "grad_rhs": "xla_bf16"}}, path)
      return path
    results = ResultsFile(os.path.join(out, "quality.jsonl"), quality.KEY_FIELDS)
    self.assertTrue(quality.run_model("dlrm", settings, results, out, deadline=float("inf"),
                                      device="cpu", log=lambda _: None, plan_maker=plan_maker))
    self.assertEqual(asked, [False, True])
    by = {r["arm"]: r for r in results.rows()}
    self.assertEqual(by["loka"]["same_run_as"], "bf16_mods")
    accuracy = by["loka_accuracy"]
    self.assertNotIn("same_run_as", accuracy)
    self.assertIn(os.path.join("plans", "accuracy_only", "dlrm_tiny"), accuracy["plan"])
    self.assertIn("xla_fp8_tensorwise", accuracy["plan_kernels"])
    self.assertEqual(accuracy["init_fingerprint"], by["bf16_mods"]["init_fingerprint"])
    self.assertNotEqual(accuracy["logloss"], by["bf16_mods"]["logloss"])  # FP8 ran
    self.assertNotIn("loka_accuracy", quality.QualitySettings().arms)  # asked for by name
    # Hand-made scores, -0.1% and +0.3% of bf16+Mods': judged as a peer; where its rows took
    # bf16+Mods' runs, not applicable.
    rows = [quality_row("dlrm", "tiny", "bf16_mods", s, loss) for s, loss in enumerate((0.5, 0.6))]
    mine = [quality_row("dlrm", "tiny", "loka_accuracy", s, loss * (1 + d),
                        plan_kernels=["xla_bf16", "xla_fp8_tensorwise"])
            for s, (loss, d) in enumerate(((0.5, -1e-3), (0.6, 3e-3)))]
    v = find_verdict(targets.check_quality(rows + mine),
                     "loka_accuracy_quality_vs_bf16_mods", "synthetic:dlrm/tiny", "quality")
    self.assertEqual((v["judged"], v["n"]), (False, 2))
    self.assertAlmostEqual(v["value"], 1e-3)
    self.assertIn("| synthetic:dlrm/tiny | LoKA, error budget alone | bf16+Mods | 2 | +0.100% |",
                  tables.quality_verdicts_table(targets.check_quality(rows + mine)))
    twins = [dict(quality_row("dlrm", "tiny", "loka_accuracy", s, loss), same_run_as="bf16_mods")
             for s, loss in enumerate((0.5, 0.6))]
    v = find_verdict(targets.check_quality(rows + twins),
                     "loka_accuracy_quality_vs_bf16_mods", "synthetic:dlrm/tiny", "quality")
    self.assertEqual(v["verdict"], "not applicable")

  def test_a_cooldown_recipe_trains_its_own_runs_and_is_compared_apart(self):
    logs = []
    out, results = self.run_recipes("cooldown_steps", (0, 2), logs)
    plain, cooled = sorted(results.rows(), key=quality.row_cooldown)
    self.assertIn("  quality synthetic dlrm/tiny bf16 seed 0 cooldown 2", logs)
    self.assertNotIn("cooldown_steps", plain)  # plain rows keep the keys they always had
    self.assertEqual(cooled["cooldown_steps"], 2)
    # The last two steps run at half the rate and at none: the runs differ.
    self.assertNotEqual(plain["logloss"], cooled["logloss"])
    run_dir = os.path.join(out, "synthetic", "dlrm_tiny", "bf16_seed0_cooldown2")
    self.assertEqual(quality.run_dir(out, cooled), run_dir)  # found again from its row
    optim = json.load(open(os.path.join(run_dir, "config.json")))["train"]["optim"]
    self.assertEqual((optim["cooldown_start"], optim["cooldown_steps"]), (2, 2))
    self.assertEqual([c.subject for c in quality.comparisons(list(results.rows()))],
                     ["synthetic:dlrm/tiny", "synthetic:dlrm/tiny (cooldown 2)"])
    self.assertEqual(quality.recipe_label(50, 1.0, 200), "warmup 50, clip 1, cooldown 200")
    with self.assertRaisesRegex(ValueError, r"cooldown_steps must be in \[0, steps - "
                                r"warmup_steps = 2\], got 3"):
      quality.QualitySettings(steps=4, warmup_steps=2, cooldown_steps=3)

  def test_a_clipped_recipe_trains_its_own_runs_and_rows_keep_the_worst_step(self):
    logs = []
    out, results = self.run_recipes("clip_norm", (None, 1e-9), logs)
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
    out = tempdir(self)
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
    # Once the run's own card has a recorded run of the model, only its runs count: there
    # its arm without a run expects the card's longest of another arm.
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings, "bf16", "y"),
                           pace.MARGIN * 162.7)
    results.append({"suite": "quality", "data": "synthetic", "model": "dhen",
                    "preset": "large", "arm": "bf16_mods", "seed": 0, "device": "y",
                    "train_s": 40.0})
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings, "bf16", "y"),
                           pace.MARGIN * 40.0)
    self.assertAlmostEqual(quality.expected_run_s(results, "dhen", settings, "bf16", "x"),
                           pace.MARGIN * 162.7)

  def test_run_model_stops_before_a_run_that_would_outlast_the_hard_end(self):
    out = tempdir(self)
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
