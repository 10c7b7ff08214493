"""`experiments.measure shadow_arms` on a tiny DLRM (the cheapest tower to compile): the
baseline's own kernel as an arm trains exactly as bf16+Mods, an FP8 arm differs, a rerun trains
nothing, and bad arms fail before any training with a message naming them."""
import json
import os
import tempfile

from absl.testing import absltest

from cli_helpers import run_module

COMMON = ("--model=dlrm", "--preset=tiny", "--mods=all", "--steps=6", "--batch_size=64",
          "--shadow_steps=4", "--windows=2", "--num_eval=512", "--eval_batch_size=256")


def run_cli(*args, timeout=300):
  return run_module("experiments.measure", "shadow_arms", *args, timeout=timeout)


class ShadowArmsTest(absltest.TestCase):

  def test_arms_train_from_one_state_and_a_rerun_skips_them(self):
    workdir = tempfile.mkdtemp(prefix="loka_shadow_arms_")
    plan = os.path.join(workdir, "plan.json")
    _write_plan(plan, {"top_mlp/dense_0": "xla_fp8_rowwise"})
    arms = ("--arm=same=.*:xla_bf16",
            r"--arm=fp8=bottom_mlp/dense_\d+:xla_fp8_rowwise,top_mlp/dense_2:flax_fp8_delayed",
            f"--plan_arm=planned={plan}")
    got = run_cli(*COMMON, *arms, f"--workdir={workdir}")
    self.assertEqual(got.returncode, 0, got.stderr[-3000:])
    with open(os.path.join(workdir, "shadow_arms.jsonl")) as f:
      rows = {(r["arm"], r["window"]): r for r in map(json.loads, f)}
    self.assertLen(rows, 8)
    for window in (0, 1):
      base, same, fp8, planned = (rows[a, window] for a in ("bf16_mods", "same", "fp8",
                                                             "planned"))
      # xla_bf16 at every site is bf16+Mods' program: the same numbers to the last bit.
      for key in ("first_loss", "window_loss", "logloss", "auc", "loss_curve"):
        self.assertEqual(same[key], base[key], (window, key))
      # Four steps make one point of the curve: the mean of the last four steps.
      for arm in (base, same, fp8, planned):
        self.assertLen(arm["loss_curve"], 1)
        self.assertAlmostEqual(arm["loss_curve"][0], arm["window_loss"], places=5)
      # All start from the trained state on the window's first batch; FP8 then moves them
      # (the plan file's one FP8 site too).
      for arm in (fp8, planned):
        self.assertAlmostEqual(arm["first_loss"], base["first_loss"], delta=0.05)
        self.assertNotEqual(arm["logloss"], base["logloss"])
      self.assertNotEqual(planned["logloss"], fp8["logloss"])
      self.assertTrue(0.0 < base["auc"] < 1.0)
    self.assertIn('"top_mlp/dense_0": {"fwd": "xla_fp8_rowwise"',
                  rows["planned", 0]["setup"])
    self.assertNotEqual(rows["bf16_mods", 0]["first_loss"], rows["bf16_mods", 1]["first_loss"])
    self.assertIn("| same | 1 |", got.stdout)
    self.assertIn("(+0.00%)", got.stdout)
    self.assertIn("Training loss, mean of each 25 steps", got.stdout)
    self.assertIn("[shadow_arms] curves:", got.stdout)
    with open(os.path.join(workdir, "shadow_arms.png"), "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    self.assertIn(f"| fp8 | 1 | {rows['fp8', 1]['loss_curve'][0]:.3f} |", got.stdout)
    # A rerun trains nothing and prints the same table.
    again = run_cli(*COMMON, *arms, f"--workdir={workdir}")
    self.assertEqual(again.returncode, 0, again.stderr[-3000:])
    self.assertNotIn("[shadow_arms] window", again.stdout)
    self.assertEqual(again.stdout.split("From step")[1], got.stdout.split("From step")[1])
    # A warm-up after the switch is another recipe: trained again, from the same start.
    warm = run_cli(*COMMON, "--arm=same=.*:xla_bf16", "--warmup_after_switch=3",
                   f"--workdir={workdir}")
    self.assertEqual(warm.returncode, 0, warm.stderr[-3000:])
    self.assertIn("warming up over 3", warm.stdout)
    with open(os.path.join(workdir, "shadow_arms.jsonl")) as f:
      warm_rows = [r for r in map(json.loads, f) if '"warmup_after_switch": 3' in r["setup"]]
    self.assertLen(warm_rows, 4)
    for r in warm_rows:
      plain = rows[r["arm"] if r["arm"] == "bf16_mods" else "same", r["window"]]
      self.assertEqual(r["first_loss"], plain["first_loss"])
      self.assertNotEqual(r["window_loss"], plain["window_loss"])

  def test_bad_arms_fail_before_training(self):
    # Each bad arm is named by the parsers the CLI calls before it trains (in this process:
    # a CLI run each would cost a JAX start-up apiece) ...
    from experiments.tools import shadow_arms
    from loka_jax.kernels import registry
    from loka_jax.models.presets import site_products
    from loka_jax.train import experiment
    model, source, _ = experiment.build_run(
        experiment.RunSpec(model="dlrm", preset="tiny", mods=("all",), num_eval=512))
    example = source.train_batch(0, 8)
    sites = list(site_products(model, None, example))
    for arm, message in (("no_equals", "write NAME=REGEX:KERNEL"),
                         ("x=.*:no_such_kernel", "unknown kernel 'no_such_kernel'"),
                         ("x=no/such/site:xla_bf16", "matches none of the model's sites"),
                         ("x=.*", "is not REGEX:KERNEL"),
                         ("bf16_mods=.*:xla_bf16", "is the baseline")):
      with self.assertRaisesRegex(ValueError, message, msg=arm):
        shadow_arms.parse_arm(arm, sites, registry.names())
    workdir = tempfile.mkdtemp()
    misfit = os.path.join(workdir, "misfit.json")
    _write_plan(misfit, {"layer_9/no/such": "xla_fp8_rowwise"})
    for arm, message in ((f"p={workdir}/absent.json", "absent.json"),
                         (f"p={misfit}", "does not fit the model"),
                         ("no_path", "write NAME=PLAN.json")):
      with self.assertRaisesRegex(ValueError, message, msg=arm):
        shadow_arms.parse_plan_arm(arm, model, example)
    # ... and the CLI exits with the message before training anything.
    for args, message in ((("--arm=x=.*:no_such_kernel",), "unknown kernel 'no_such_kernel'"),
                          (("--arm=x=.*:xla_bf16", f"--plan_arm=x={misfit}"),
                           "does not fit the model")):
      workdir = tempfile.mkdtemp()
      got = run_cli(*COMMON, *args, f"--workdir={workdir}")
      self.assertNotEqual(got.returncode, 0, args)
      self.assertIn(message, got.stderr, args)
      self.assertFalse(os.path.exists(os.path.join(workdir, "run")), args)
    got = run_cli(*COMMON, "--arm=x=.*:xla_bf16", "--arm=x=.*:xla_fp8_rowwise",
                  f"--workdir={tempfile.mkdtemp()}")
    self.assertIn("two arms share a name", got.stderr)


def _write_plan(path, sites):
  """A plan file with `sites` ({site: kernel in every pass}), xla_bf16 elsewhere."""
  from loka_jax import dispatch
  passes = ("fwd", "grad_lhs", "grad_rhs")
  dispatch.save_plan({"schema": "loka.plan/1",
                      "sites": {s: {p: {"kernel": k} for p in passes} for s, k in sites.items()},
                      "default": {p: "xla_bf16" for p in passes}}, path)


if __name__ == "__main__":
  absltest.main()
