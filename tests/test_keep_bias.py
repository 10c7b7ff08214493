"""No Bias's exceptions: `keep_bias:PATTERN` Mods entries keep the matching dense sites' biases."""
import json
import os
import subprocess
import sys
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest

from loka_jax.models import apply_mods, get_config
from loka_jax.models.presets import ModsError
from loka_jax.train import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    with self.assertRaisesRegex(ModsError, r"\['crosss_\*'\] match no dense site.*cross_0/u"):
      build(["all", "keep_bias:crosss_*"])
    with self.assertRaisesRegex(ModsError, r"unknown Mod\(s\) \['no_bais'\]"):
      apply_mods(get_config("dcnv2", "tiny"), ["no_bais"])

  def test_the_train_script_takes_and_records_them(self):
    with tempfile.TemporaryDirectory() as tmp:
      run = subprocess.run(
          [sys.executable, "-m", "experiments.train", "--model=dcnv2", "--preset=tiny",
           "--mods=all,keep_bias:cross_*", "--steps=2", "--num_eval=256", "--progress=false",
           f"--workdir={tmp}"], cwd=ROOT, capture_output=True, text=True)
      self.assertEqual(run.returncode, 0, run.stderr[-2000:])
      with open(os.path.join(tmp, "config.json")) as f:
        self.assertEqual(json.load(f)["run"]["mods"], ["all", "keep_bias:cross_*"])
      bad = subprocess.run(
          [sys.executable, "-m", "experiments.train", "--model=dcnv2", "--preset=tiny",
           "--mods=all,keep_bias:nowhere", "--steps=2", "--progress=false",
           f"--workdir={os.path.join(tmp, 'bad')}"], cwd=ROOT, capture_output=True, text=True)
      self.assertNotEqual(bad.returncode, 0)
      self.assertIn("error: keep_bias pattern(s) ['nowhere'] match no dense site", bad.stderr)


if __name__ == "__main__":
  absltest.main()
