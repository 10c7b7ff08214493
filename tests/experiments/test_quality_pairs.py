"""experiments/bench/quality_pairs.py: what pairs two quality rows of one seed (held-out set,
data order, initial weights), and which LoKA plans the rule does not apply to."""
import numpy as np
from absl.testing import absltest

from experiments.bench import quality, quality_pairs
from loka_jax.train import experiment
from loka_jax.train.optim import OptimConfig, make_optimizer


def _row(arm, seed, **fields):
  return {"suite": "quality", "data": "synthetic", "model": "dlrm", "preset": "large",
          "arm": arm, "seed": seed, "device": "H200", "logloss": 0.47,
          "eval_fingerprint": "e", **fields}


class FingerprintTest(absltest.TestCase):

  def test_every_arm_of_a_seed_starts_from_the_same_weights_and_data(self):
    # DLRM `tiny`: the Mods drop the MLPs' biases (and keep every other parameter, drawn
    # from the seed's key by module path), the FP8 arms change no parameter.
    tx = make_optimizer(OptimConfig())
    found = {}
    for arm, mods, precision, kernel in (("bf16", (), "bf16", "xla_fp8_tensorwise"),
                                         ("bf16_mods", ("all",), "bf16", "xla_fp8_tensorwise"),
                                         ("fp8_delayed", (), "fp8_all", "flax_fp8_delayed")):
      for seed in (0, 1):
        spec = experiment.RunSpec(model="dlrm", preset="tiny", precision=precision,
                                  kernel=kernel, mods=mods, seed=seed, num_eval=64)
        model, source, _ = experiment.build_run(spec)
        batch = source.train_batch(0, 16)
        found[arm, seed] = (quality.initial_weights_fingerprint(model, tx, batch, seed),
                            quality_pairs.train_fingerprint(source, 16, 5),
                            quality.eval_fingerprint(source, 16))
    for arm in ("bf16_mods", "fp8_delayed"):
      self.assertEqual(found[arm, 0], found["bf16", 0], arm)
      self.assertEqual(found[arm, 1], found["bf16", 1], arm)
    for i, what in enumerate(("init", "train")):
      self.assertNotEqual(found["bf16", 0][i], found["bf16", 1][i], what)
    self.assertEqual(found["bf16", 0][2], found["bf16", 1][2])  # one held-out set

  def test_the_weights_fingerprint_reads_values_paths_and_shapes_not_biases(self):
    params = {"dense_0": {"kernel": np.ones((3, 4), np.float32),
                          "bias": np.zeros(4, np.float32)},
              "norm": {"scale": np.ones(4, np.float32)}}
    base = quality_pairs.init_fingerprint(params)
    self.assertEqual(quality_pairs.init_fingerprint({"dense_0": {
        "kernel": params["dense_0"]["kernel"]}}), base)     # biases and scales: not read
    changed = {"dense_0": {"kernel": params["dense_0"]["kernel"].copy()}}
    changed["dense_0"]["kernel"][0, 0] = 2.0
    self.assertNotEqual(quality_pairs.init_fingerprint(changed), base)
    self.assertNotEqual(quality_pairs.init_fingerprint(
        {"dense_1": {"kernel": params["dense_0"]["kernel"]}}), base)
    self.assertNotEqual(quality_pairs.init_fingerprint(
        {"dense_0": {"kernel": np.ones((4, 3), np.float32)}}), base)


class PairingTest(absltest.TestCase):

  def test_a_seed_pairs_only_rows_whose_recorded_fingerprints_agree(self):
    self.assertIsNone(quality_pairs.unpaired_why(_row("loka", 0), _row("bf16", 0)))
    # A fingerprint only one row records is not compared (rows written before it).
    self.assertIsNone(quality_pairs.unpaired_why(_row("loka", 0, train_fingerprint="t"),
                                                 _row("bf16", 0)))
    self.assertEqual(quality_pairs.unpaired_why(
        _row("loka", 0, eval_fingerprint="x", init_fingerprint="i"),
        _row("bf16", 0, init_fingerprint="j")), "eval and init fingerprints differ")

  def test_which_plans_run_fp8(self):
    c = quality.Comparison("synthetic", "dlrm", "large")
    loka = lambda **f: [_row("loka", 0, **f)]  # noqa: E731
    self.assertTrue(quality_pairs.fp8_plan([], c, "fp8_naive"))
    self.assertFalse(quality_pairs.fp8_plan(loka(same_run_as="bf16_mods"), c, "loka"))
    self.assertFalse(quality_pairs.fp8_plan(loka(plan_kernels=["xla_bf16"]), c, "loka"))
    self.assertFalse(quality_pairs.fp8_plan(loka(plan_kernels=["xla_bf16", "xla_fp32"]), c,
                                            "loka"))
    self.assertTrue(quality_pairs.fp8_plan(loka(plan_kernels=["pallas_fp8_delayed"]), c,
                                           "loka"))
    self.assertTrue(quality_pairs.fp8_plan(loka(plan_kernels=["no_such_kernel"]), c, "loka"))
    # Rows without their plan's kernels: the LoKA speed row of the same target says.
    speed = {"suite": "models", "variant": "loka", "model": "dlrm", "preset": "large",
             "kernels": ["xla_bf16"]}
    self.assertFalse(quality_pairs.fp8_plan(loka() + [speed], c, "loka"))
    self.assertIsNone(quality_pairs.fp8_plan(loka(), c, "loka"))
    # ... else bf16+Mods' runs, where every seed's score is bit-identical (the CPU's).
    self.assertFalse(quality_pairs.fp8_plan(loka() + [_row("bf16_mods", 0)], c, "loka"))
    self.assertIsNone(quality_pairs.fp8_plan(loka() + [_row("bf16_mods", 0, logloss=0.4)], c,
                                             "loka"))


if __name__ == "__main__":
  absltest.main()
