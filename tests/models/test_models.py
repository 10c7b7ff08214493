"""The towers at `tiny`: logits, site names, precisions, gradients, Mods, presets, FLOPs, errors.

Each model is initialized once per process (model_helpers.tiny's cache); abstract tracing
(`jax.eval_shape`) covers everything that does not need numbers.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax.data.spec import BatchError, FeatureSpec
from loka_jax.models import (EMBEDDINGS, MODEL_NAMES, PRESETS, SiteConfig, apply_mods,
                             build_model, get_config, site_products, tower_flops)
from loka_jax.models.presets import DOCUMENTED_FLOPS
from loka_jax.models.tap import PROBE_COLLECTION
from model_helpers import BATCH, EXPECTED_SITES, FINAL_LAYER, features_of, make_batch, tiny

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
def site_names(config, features, batch, site_config=None):
  module = build_model(config, features, site_config or SiteConfig.for_precision("bf16"))
  return list(site_products(module, None, batch))


def subtree(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def probe_names(tree, path=()):
  """Site names from the probe collection: every node holding sown `lhs`/`rhs` operands."""
  if "lhs" in tree and "rhs" in tree:
    return ["/".join(path)]
  return [name for key, sub in tree.items() for name in probe_names(sub, path + (key,))]


def all_finite(tree):
  # On the host: eager, every leaf's shape compiles an isfinite and a reduction of its own.
  return all(bool(np.all(np.isfinite(np.asarray(leaf, np.float32))))
             for leaf in jax.tree.leaves(tree))


class TinyModelTest(chex.TestCase):

  @parameterized.parameters(*MODEL_NAMES)
  def test_site_names_listed_and_stable(self, model):
    config, features, batch, _ = tiny(model)
    names = site_names(config, features, batch)
    self.assertCountEqual(names, EXPECTED_SITES[model])
    self.assertEqual(names, site_names(config, features, batch))             # a second build
    modded = apply_mods(config, ["all"])
    self.assertEqual(names, site_names(modded, features, batch))             # Mods on
    fp8 = SiteConfig.for_precision("fp8_all", kernel="xla_fp8_rowwise")
    self.assertEqual(names, site_names(config, features, batch, fp8))       # other kernels

  @parameterized.parameters(*MODEL_NAMES)
  def test_fp32_forward_sows_every_site(self, model):
    config, features, batch, variables = tiny(model)
    module = build_model(config, features, SiteConfig.for_precision("fp32"))
    forward = jax.jit(functools.partial(module.apply, mutable=[PROBE_COLLECTION]),
                      compiler_options=FAST_COMPILE)
    logits, state = forward(variables, batch)
    chex.assert_shape(logits, (BATCH,))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    self.assertCountEqual(probe_names(state[PROBE_COLLECTION]), EXPECTED_SITES[model])
    operand = subtree(state[PROBE_COLLECTION], EXPECTED_SITES[model][0])["lhs"][0]
    chex.assert_type(operand, jnp.float32)                                  # fp32 policy

  # One layer of DHEN's and InterFormer's stack: every kind of site runs in FP8 and in the
  # backward below; both layers' sites are traced and run in fp32 at the preset's depth above.
  @parameterized.parameters(*MODEL_NAMES)
  def test_fp8_all_forward(self, model):
    config, features, batch, variables = tiny(model, one_layer=True)
    module = build_model(config, features, SiteConfig.for_precision("fp8_all"))
    logits = jax.jit(module.apply, compiler_options=FAST_COMPILE)(variables, batch)
    chex.assert_shape(logits, (BATCH,))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    self.assertGreater(float(jnp.std(logits)), 0.0)  # examples are told apart

  @parameterized.parameters(*MODEL_NAMES)
  def test_bf16_gradients_finite_and_reach_every_table(self, model):
    config, features, batch, variables = tiny(model, one_layer=True)
    module = build_model(config, features, SiteConfig.for_precision("bf16"))
    labels = jnp.asarray(batch["label"])

    def loss(v):
      logits = module.apply(v, batch, train=True)
      return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                     compiler_options=FAST_COMPILE)(variables)
    chex.assert_shape(logits, (BATCH,))
    chex.assert_type(logits, jnp.float32)
    self.assertTrue(np.isfinite(float(value)))
    self.assertTrue(all_finite(grads))
    chex.assert_trees_all_equal_shapes(grads, variables)
    tables = grads["params"][EMBEDDINGS]
    expected = [f"sparse_{f}" for f in range(features.num_sparse)]
    expected += [f"seq_{a}" for a in range(features.num_seq)]
    self.assertCountEqual(tables, expected)
    for name, grad in tables.items():
      self.assertGreater(float(np.max(np.abs(np.asarray(grad, np.float32)))), 0.0, msg=name)

  @parameterized.parameters(*MODEL_NAMES)
  def test_embedding_tables_only_under_embeddings(self, model):
    config, features, _, variables = tiny(model)
    vocab_rows = set(features.vocab_sizes) | {features.seq_vocab}
    for top, sub in variables["params"].items():
      for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
        name = top + jax.tree_util.keystr(path)
        looks_like_table = (leaf.ndim == 2 and leaf.shape[0] in vocab_rows
                            and leaf.shape[1] == config.embed_dim)
        self.assertEqual(top == EMBEDDINGS, looks_like_table, msg=name)


class ModsTest(chex.TestCase):

  @parameterized.parameters(*MODEL_NAMES)
  def test_no_bias_keeps_only_the_prediction_bias(self, model):
    config, features, batch, _ = tiny(model)
    modded = apply_mods(config, ["no_bias"])
    module = build_model(modded, features, SiteConfig.for_precision("bf16"))
    variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)
    weighted = [name for name, p in site_products(module, variables, batch).items()
                if p.kind == "act_weight"]
    with_bias = [name for name in weighted if "bias" in subtree(variables["params"], name)]
    self.assertEqual(with_bias, [FINAL_LAYER[model]])
    default = build_model(config, features, SiteConfig.for_precision("bf16"))
    default_params = jax.eval_shape(default.init, jax.random.PRNGKey(0), batch)["params"]
    self.assertIn("bias", subtree(default_params, EXPECTED_SITES[model][0]))

  @parameterized.parameters("wukong", "interformer")
  def test_blocknorm_replaces_every_layernorm(self, model):
    config, features, batch, _ = tiny(model)
    for mods, present in (([], True), (["blocknorm"], False)):
      module = build_model(apply_mods(config, mods), features, SiteConfig.for_precision("bf16"))
      params = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)["params"]
      paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
      self.assertEqual(any("layernorm" in p for p in paths), present, msg=str(mods))

  def test_apply_mods_config(self):
    config = get_config("wukong", "tiny")
    self.assertEqual(config.activation, "swish")
    self.assertEqual(get_config("dlrm", "tiny").activation, "relu")
    modded = apply_mods(config, ["hard_swish", "no_bias"])
    self.assertTrue(modded.mods.hard_swish and modded.mods.no_bias)
    self.assertFalse(modded.mods.blocknorm)
    self.assertFalse(config.mods.hard_swish)                                 # a copy
    every = apply_mods(config, "all")
    self.assertTrue(every.mods.no_bias and every.mods.blocknorm and every.mods.hard_swish)
    with self.assertRaisesRegex(ValueError, "no_bias.*blocknorm.*hard_swish"):
      apply_mods(config, ["fast_mode"])

  def test_mods_change_the_function_not_the_sites(self):
    config, features, batch, variables = tiny("dlrm")
    site = SiteConfig.for_precision("fp32")
    base = jax.jit(build_model(config, features, site).apply)(variables, batch)
    hard = jax.jit(build_model(apply_mods(config, ["hard_swish"]), features, site).apply)(
        variables, batch)
    self.assertGreater(float(jnp.max(jnp.abs(base - hard))), 1e-6)


class PresetTest(chex.TestCase):

  def test_unknown_names_list_the_valid_ones(self):
    with self.assertRaisesRegex(ValueError, "dlrm, dcnv2, wukong, dhen, interformer"):
      get_config("bert", "tiny")
    with self.assertRaisesRegex(ValueError, "tiny, small, large"):
      get_config("dlrm", "huge")

  @parameterized.product(model=MODEL_NAMES, preset=PRESETS)
  def test_config_keys(self, model, preset):
    config = get_config(model, preset)
    self.assertIsInstance(config, ml_collections.ConfigDict)
    for key in ("model", "preset", "features", "activation", "norm", "use_bias", "mods",
                "embed_dim", "flops_per_example", "batch_size"):
      self.assertIn(key, config)
    self.assertEqual((config.model, config.preset), (model, preset))
    self.assertEqual((config.norm, config.use_bias), ("layernorm", True))
    self.assertEqual(dict(config.mods), dict(no_bias=False, blocknorm=False, hard_swish=False,
                                             block_size=config.mods.block_size))
    features = features_of(config)
    self.assertLessEqual(max(features.vocab_sizes), 100_000)
    self.assertEqual(features.num_seq > 0, model == "interformer")

  def test_dlrm_tiny_flops_by_hand(self):
    config = get_config("dlrm", "tiny")  # 8 dense, 8 tables, d=16, bottom 32, top 64-32-1
    bottom = 2 * (8 * 32 + 32 * 16)
    interaction = 2 * 9 * 9 * 16         # X X^T over 9 tokens (bottom output + 8 bags)
    top = 2 * ((36 + 16) * 64 + 64 * 32 + 32 * 1)
    self.assertEqual(bottom + interaction + top, 14_944)
    self.assertEqual(config.flops_per_example, 14_944)

  @parameterized.product(model=MODEL_NAMES, preset=PRESETS)
  def test_flops_equal_the_sum_over_sites(self, model, preset):
    config = get_config(model, preset)
    features = features_of(config)
    batch = make_batch(features, size=2)
    module = build_model(config, features, SiteConfig.for_precision("bf16"))
    per_example = sum(p.flops for p in site_products(module, None, batch).values()) // 2
    self.assertEqual(per_example, config.flops_per_example)
    self.assertEqual(tower_flops(config, features), config.flops_per_example)
    self.assertEqual(DOCUMENTED_FLOPS[model, preset], config.flops_per_example)

  def test_wukong_large_is_near_the_public_scale_point(self):
    config = get_config("wukong", "large")
    self.assertEqual((config.num_layers, config.fmb_tokens, config.lcb_tokens, config.fm_rank),
                     (8, 96, 96, 96))
    self.assertEqual(tuple(config.fmb_mlp), (8192, 8192, 8192))
    self.assertBetween(3 * config.flops_per_example / 1e9, 15.0, 30.0)     # train ~ 3x fwd

  @parameterized.parameters("wukong", "dhen")
  def test_variants_build(self, model):
    config, features, batch, _ = tiny(model)
    variant = ml_collections.ConfigDict(config.to_dict())
    if model == "wukong":
      variant.attentive_y = True
    else:
      variant.ensemble, variant.layer_tokens = "concat", 6
    module = build_model(variant, features, SiteConfig.for_precision("bf16"))
    products = site_products(module, None, batch)
    self.assertEqual(sum(p.flops for p in products.values()) // BATCH,
                     tower_flops(variant, features))
    if model == "wukong":
      self.assertEqual(products["layer_0/fmb/fm_proj"].kind, "act_act")
    else:
      self.assertIn("layer_0/ensemble", products)
      self.assertIn("layer_0/shortcut", products)


class FeatureVariantsTest(chex.TestCase):

  def test_sequences_are_ignored_by_towers_without_a_sequence_arch(self):
    config, _, _, _ = tiny("dlrm")
    features = FeatureSpec(num_dense=3, vocab_sizes=(50, 7), bag_size=2, num_seq=2,
                           seq_len=5, seq_vocab=40)
    batch = make_batch(features)
    module = build_model(config, features, SiteConfig.for_precision("bf16"))
    variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)
    self.assertCountEqual(variables["params"][EMBEDDINGS], ["sparse_0", "sparse_1"])
    logits = jax.eval_shape(module.apply, variables, batch)
    chex.assert_shape(logits, (BATCH,))

  def test_no_dense_features(self):
    config, _, _, _ = tiny("wukong")
    features = FeatureSpec(num_dense=0, vocab_sizes=(50, 7, 9), bag_size=2)
    batch = {k: v for k, v in make_batch(features).items() if k != "dense"}
    module = build_model(config, features, SiteConfig.for_precision("bf16"))
    names = list(site_products(module, None, batch))
    self.assertNotIn("bottom_mlp/dense_0", names)
    self.assertIn("layer_0/residual", names)                  # 3 tokens -> 8

  def test_dense_transform(self):
    config, features, batch, variables = tiny("dcnv2")
    site = SiteConfig.for_precision("fp32")
    raw = ml_collections.ConfigDict(config.to_dict())
    raw.dense_transform = "none"
    logged = jax.jit(build_model(config, features, site).apply)(variables, batch)
    plain = jax.jit(build_model(raw, features, site).apply)(variables, batch)
    self.assertGreater(float(jnp.max(jnp.abs(logged - plain))), 1e-4)
    raw.dense_transform = "cube_root"
    with self.assertRaisesRegex(ValueError, "signed_log1p"):
      jax.eval_shape(build_model(raw, features, site).init, jax.random.PRNGKey(0), batch)


class BadInputTest(chex.TestCase):

  def init_error(self, model, batch):
    config, features, _, _ = tiny(model)
    module = build_model(config, features, SiteConfig.for_precision("bf16"))
    with self.assertRaises(ValueError) as ctx:
      jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)
    return str(ctx.exception)

  @parameterized.parameters(*MODEL_NAMES)
  def test_missing_field(self, model):
    _, _, batch, _ = tiny(model)
    batch = {k: v for k, v in batch.items() if k != "sparse_mask"}
    self.assertIn("sparse_mask", self.init_error(model, batch))

  def test_wrong_shape_names_field_and_expected_shape(self):
    _, _, batch, _ = tiny("dcnv2")
    message = self.init_error("dcnv2", dict(batch, dense=batch["dense"][:, :5]))
    self.assertIn("dense", message)
    self.assertIn(f"({BATCH}, 8)", message)
    message = self.init_error("dcnv2", dict(batch, sparse_ids=batch["sparse_ids"][..., 0]))
    self.assertIn("sparse_ids", message)

  def test_float_ids_rejected(self):
    _, _, batch, _ = tiny("dlrm")
    message = self.init_error("dlrm", dict(batch, sparse_ids=batch["sparse_ids"] * 1.5))
    self.assertIn("integer", message)

  def test_interformer_needs_sequences(self):
    config, features, batch, _ = tiny("interformer")
    message = self.init_error("interformer", {k: v for k, v in batch.items()
                                              if not k.startswith("seq_")})
    self.assertIn("seq_ids", message)
    flat = FeatureSpec(features.num_dense, features.vocab_sizes, features.bag_size)
    with self.assertRaisesRegex(ValueError, "num_seq"):
      build_model(config, flat, SiteConfig.for_precision("bf16"))

  def test_batch_errors_are_batch_errors(self):
    _, _, batch, _ = tiny("wukong")
    config, features, _, _ = tiny("wukong")
    module = build_model(config, features, SiteConfig.for_precision("bf16"))
    with self.assertRaises(BatchError):
      jax.eval_shape(module.init, jax.random.PRNGKey(0), {"dense": batch["dense"]})


if __name__ == "__main__":
  absltest.main()
