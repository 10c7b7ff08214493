"""No Bias's exceptions: `keep_bias:PATTERN` Mods entries keep the matching dense sites' biases."""
import json
import os
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from experiments.bench import mods_set, quality, suite, towers
from loka_jax.models import SiteConfig, apply_mods, get_config
from loka_jax.models.presets import ModsError
from loka_jax.train import experiment


def biased_sites(params):
  return sorted("/".join(str(k.key) for k in path[:-1])
                for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
                if path[-1].key == "bias")


def build(mods, model="dcnv2"):
  spec = experiment.RunSpec(model=model, preset="tiny", mods=tuple(mods), num_eval=256)
  net, source, _ = experiment.build_run(spec)
  batch = source.train_batch(0, 32)
  variables = net.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
                       batch, train=False)
  return net, batch, variables


class KeepBiasTest(chex.TestCase):

  def test_only_the_matching_sites_keep_their_bias(self):
    _, _, plain = build(["all"])
    _, _, kept = build(["all", "keep_bias:cross_*", "keep_bias:top_mlp/dense_0"])
    # Under No Bias only the prediction layer keeps its bias by design.
    self.assertEqual(biased_sites(plain["params"]), ["top_mlp/dense_2"])
    self.assertEqual(biased_sites(kept["params"]),
                     ["cross_0/u", "cross_1/u", "top_mlp/dense_0", "top_mlp/dense_2"])
    # Every other parameter is the same: adding a bias draws no random numbers.
    for path, leaf in jax.tree_util.tree_flatten_with_path(plain["params"])[0]:
      other = kept["params"]
      for key in path:
        other = other[key.key]
      np.testing.assert_array_equal(leaf, other, err_msg=jax.tree_util.keystr(path))

  def test_keeping_every_bias_is_the_model_without_no_bias(self):
    # No Bias with every bias kept is Hard Swish alone (BlockNorm does nothing to DCNv2),
    # parameter for parameter and output for output.
    net, batch, kept = build(["all", "keep_bias:*"])
    plain_net, _, plain = build(["hard_swish"])
    chex.assert_trees_all_equal_shapes(kept["params"], plain["params"])
    chex.assert_trees_all_equal(kept["params"], plain["params"])
    np.testing.assert_array_equal(net.apply(kept, batch, train=False),
                                  plain_net.apply(plain, batch, train=False))

  def test_wrong_patterns_fail_by_name(self):
    with self.assertRaisesRegex(ModsError, "only No Bias drops: add no_bias"):
      apply_mods(get_config("dcnv2", "tiny"), ["hard_swish", "keep_bias:cross_*"])
    with self.assertRaisesRegex(ModsError, "empty keep_bias"):
      apply_mods(get_config("dcnv2", "tiny"), ["all", "keep_bias:"])
    with self.assertRaisesRegex(ModsError, r"\['crosss_\*'\] keep no bias.*cross_0/u"):
      build(["all", "keep_bias:crosss_*"])
    # A low-rank cross layer's `v` has no bias by design: nothing to keep there.
    with self.assertRaisesRegex(ModsError, r"\['cross_\*/v'\] keep no bias"):
      build(["all", "keep_bias:cross_*/v"])
    # The prediction layer has its bias under No Bias too: keeping it would change nothing.
    with self.assertRaisesRegex(ModsError, r"\['top_mlp/dense_2'\] keep no bias.*"
                                r"with a bias anyway: top_mlp/dense_2\)"):
      build(["all", "keep_bias:top_mlp/dense_2"])
    # A pattern that also matches a site it does keep is not an error.
    build(["all", "keep_bias:top_mlp/*"])
    with self.assertRaisesRegex(ModsError, r"unknown Mod\(s\) \['no_bais'\]"):
      apply_mods(get_config("dcnv2", "tiny"), ["no_bais"])

  def test_the_train_script_takes_and_records_them(self):
    with tempfile.TemporaryDirectory() as tmp:
      run = run_module(
          "experiments.train", "--config.run.model=dcnv2",
          "--config.run.preset=tiny", "--config.run.mods=all,keep_bias:cross_*",
          "--config.run.steps=2", "--config.run.num_eval=256", "--config.train.progress=false",
          f"--workdir={tmp}")
      self.assertEqual(run.returncode, 0, run.stderr[-2000:])
      with open(os.path.join(tmp, "config.json")) as f:
        self.assertEqual(json.load(f)["run"]["mods"], ["all", "keep_bias:cross_*"])
      bad = run_module(
          "experiments.train", "--config.run.model=dcnv2",
          "--config.run.preset=tiny", "--config.run.mods=all,keep_bias:nowhere",
          "--config.run.steps=2", "--config.train.progress=false",
          f"--workdir={os.path.join(tmp, 'bad')}")
      self.assertNotEqual(bad.returncode, 0)
      self.assertIn("error: keep_bias pattern(s) ['nowhere'] keep no bias", bad.stderr)


class BenchKeepBiasTest(chex.TestCase):

  def test_a_mods_set_names_its_patterns_and_keeps_one_folder(self):
    mods = mods_set.parse("all,keep_bias:cross_*/*,keep_bias:top_mlp/dense_0")
    self.assertEqual(mods, ("no_bias", "blocknorm", "hard_swish", "keep_bias:cross_*/*",
                            "keep_bias:top_mlp/dense_0"))
    self.assertEqual(mods_set.parse("keep_bias:top_mlp/dense_0,keep_bias:cross_*/*,all"), mods)
    label = mods_set.label(mods)
    self.assertEqual(label, "no_bias+blocknorm+hard_swish+keep_bias:cross_*/*+"
                            "keep_bias:top_mlp/dense_0")
    root = mods_set.plans_root("P", mods)
    self.assertEqual(os.path.dirname(root), "P")
    row = {"data": "synthetic", "model": "dcnv2", "preset": "large", "arm": "bf16_mods",
           "seed": 2, "mods_set": label}
    run = quality.run_dir("Q", row)
    self.assertEqual(os.path.dirname(run), os.path.join("Q", "synthetic", "dcnv2_large"))
    self.assertNotIn("*", run)
    with self.assertRaisesRegex(ValueError, "only No Bias drops"):
      mods_set.parse("hard_swish,keep_bias:cross_*")
    with self.assertRaisesRegex(ValueError, "empty keep_bias"):
      mods_set.parse("all,keep_bias:")

  def test_the_bench_builds_its_models_and_towers_with_them(self):
    target = suite.Target("models", "dcnv2", "tiny")
    site = SiteConfig.for_precision("bf16")
    model = target.build(site, mods_set.parse("all,keep_bias:cross_*"))
    batch = target.source().train_batch(0, 8)
    params = model.init(jax.random.PRNGKey(0), batch)["params"]
    self.assertEqual(biased_sites(params), ["cross_0/u", "cross_1/u", "top_mlp/dense_2"])
    with self.assertRaisesRegex(ModsError, "keep no bias: they match no dense site"):
      target.build(site, mods_set.parse("all,keep_bias:tower/*"))
    shape = towers.TowerShape.parse("32x16x2")
    tower = towers.build_tower(shape, site, mods_set.parse("all,keep_bias:mlp/dense_0"))
    params = tower.init(jax.random.PRNGKey(0), towers.TowerSource(16).train_batch(0, 4))
    self.assertEqual(biased_sites(params["params"]), ["mlp/dense_0", "mlp/dense_2"])
    with self.assertRaisesRegex(ValueError, r"\['mlp/dense_9'\] match no hidden site"):
      towers.build_tower(shape, site, mods_set.parse("all,keep_bias:mlp/dense_9"))
    # The head (mlp/dense_2 at depth 2) has its bias anyway: keeping it is no exception.
    with self.assertRaisesRegex(ValueError, r"\['mlp/dense_2'\] match no hidden site.*"
                                r"head mlp/dense_2 has a bias anyway"):
      towers.build_tower(shape, site, mods_set.parse("all,keep_bias:mlp/dense_2"))


if __name__ == "__main__":
  absltest.main()
