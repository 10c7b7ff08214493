"""The towers at `tiny` for the model, Mods and HLO tests: random batches of the data contract,
random variables (cheaper than compiling `init`), each model built once per process (`tiny`),
the tiny presets' site names written out from the towers' equations, and the compiled HLO of
a tiny Wukong train step (`from model_helpers import ...`)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import EMBEDDINGS, SiteConfig, build_model, get_config
from loka_jax.models.presets import site_products
from loka_jax.train import experiment
from loka_jax.train.loop import compiled_steps
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import create_train_state

BATCH = 4


def make_batch(features: FeatureSpec, size: int = BATCH, seed: int = 0):
  """A random batch of the contract (ids in range, ragged bags and sequences)."""
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, v, (size, features.bag_size)) for v in features.vocab_sizes], 1)
  mask = rng.random(ids.shape) < 0.7
  batch = {
      "dense": rng.lognormal(0.0, 1.0, (size, features.num_dense)).astype(np.float32),
      "sparse_ids": np.where(mask, ids, 0).astype(np.int32),
      "sparse_mask": mask,
      "label": (rng.random(size) < 0.3).astype(np.float32),
  }
  if features.num_seq:
    lengths = rng.integers(1, features.seq_len + 1, (size, 1))
    seq_mask = np.arange(features.seq_len)[None, :] >= features.seq_len - lengths  # right-aligned
    seq_ids = rng.integers(0, features.seq_vocab, (size, features.num_seq, features.seq_len))
    batch["seq_ids"] = np.where(seq_mask[:, None], seq_ids, 0).astype(np.int32)
    batch["seq_mask"] = seq_mask
  return batch


def features_of(config) -> FeatureSpec:
  return FeatureSpec.from_dict(config.features)


def random_variables(shapes, seed=0):
  """Fresh random values for a variable tree (cheaper than compiling `init`, which would run
  the whole forward pass): kernels ~ N(0, 1/fan_in), tables ~ N(0, 1/d), norms near 1."""
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = jax.tree_util.keystr(path)
    noise = rng.standard_normal(leaf.shape)
    if name.endswith("['scale']"):
      values = 1.0 + 0.1 * noise
    elif name.endswith("['bias']"):
      values = 0.1 * noise
    elif f"['{EMBEDDINGS}']" in name:
      values = noise / np.sqrt(leaf.shape[-1])
    else:
      values = noise / np.sqrt(max(1, int(np.prod(leaf.shape[:-1]))))
    return jnp.asarray(values, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


# The towers whose stack repeats one layer module: tests that need every kind of site, not
# the preset's depth, run them one layer deep (their compiles halve).
ONE_LAYER = ("dhen", "interformer")


@functools.lru_cache(maxsize=None)
def tiny(model: str, one_layer: bool = False):
  """(config, features, batch, variables) of a tiny model, built once per session;
  `one_layer`: one layer of the stack for the towers of ONE_LAYER."""
  config = get_config(model, "tiny")
  if one_layer and model in ONE_LAYER:
    config.num_layers = 1
  features = features_of(config)
  batch = make_batch(features)
  module = build_model(config, features, SiteConfig.for_precision("bf16"))
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)
  return config, features, batch, random_variables(shapes)


def mlp(prefix, count):
  return [f"{prefix}/dense_{i}" for i in range(count)]


def attention(prefix):
  return [f"{prefix}/{p}" for p in ("query", "key", "value", "scores", "context", "out")]


def dhen_layer(prefix, projected):
  names = [f"{prefix}/dot/pairwise"] + mlp(f"{prefix}/dot/mlp", 2)
  names += attention(f"{prefix}/attention/mha") + mlp(f"{prefix}/attention/ffn", 2)
  names += [f"{prefix}/dcn/w", f"{prefix}/linear"]
  if projected:
    names += [f"{prefix}/attention_proj", f"{prefix}/dcn_proj", f"{prefix}/shortcut"]
  return names


def cross_arch(prefix):
  return ([f"{prefix}/x_lce"] + mlp(f"{prefix}/x_gate/mlp", 1) + [
      f"{prefix}/pma/{p}" for p in ("key", "value", "scores", "context", "out")] +
          mlp(f"{prefix}/s_gate/mlp", 1))


# The tiny presets' sites, written out from the towers' equations.
EXPECTED_SITES = {
    "dlrm": mlp("bottom_mlp", 2) + ["interaction/dot"] + mlp("top_mlp", 3),
    "dcnv2": mlp("bottom_mlp", 2) + ["cross_0/v", "cross_0/u", "cross_1/v", "cross_1/u"]
             + mlp("top_mlp", 3),
    "wukong": mlp("bottom_mlp", 2) + [
        name for i in range(2) for name in
        [f"layer_{i}/fmb/fm_proj", f"layer_{i}/fmb/optimized_fm"] + mlp(f"layer_{i}/fmb/mlp", 3)
        + [f"layer_{i}/lcb"] + ([f"layer_{i}/residual"] if i == 0 else [])] + mlp("head", 2),
    "dhen": mlp("bottom_mlp", 2) + dhen_layer("layer_0", False) + dhen_layer("layer_1", False)
            + mlp("head", 2),
    "interformer": mlp("bottom_mlp", 2) + mlp("seq_merge/mask_mlp", 2) + mlp("seq_merge/lce", 1)
                   + [name for i in range(2) for name in
                      cross_arch(f"layer_{i}/cross") + dhen_layer(f"layer_{i}/interaction", True)
                      + mlp(f"layer_{i}/interaction_mlp", 2)
                      + [f"layer_{i}/sequence/pffn/weight", f"layer_{i}/sequence/pffn/apply"]
                      + attention(f"layer_{i}/sequence/mha")]
                   + cross_arch("cross_final") + mlp("head", 2),
}

FINAL_LAYER = {"dlrm": "top_mlp/dense_2", "dcnv2": "top_mlp/dense_2", "wukong": "head/dense_1",
               "dhen": "head/dense_1", "interformer": "head/dense_1"}


def wukong_train_hlo():
  """(compiled HLO text of tiny Wukong+Mods' bf16 train step, its site names)."""
  spec = experiment.RunSpec(model="wukong", preset="tiny", data="synthetic", precision="bf16",
                            mods=("all",))
  model, source, _ = experiment.build_run(spec)
  batch = source.train_batch(0, 32)
  state = create_train_state(model, make_optimizer(OptimConfig()), batch, 0)
  train_step, _ = compiled_steps(model, OptimConfig(), "stop")
  hlo = train_step.lower(state, batch).compile().as_text()
  return hlo, list(site_products(model, None, batch))


def entry_arguments(hlo_text: str) -> int:
  """How many arguments a compiled program's entry computation takes."""
  return len(re.findall(r"parameter\(\d+\)", hlo_text[hlo_text.index("ENTRY"):]))
