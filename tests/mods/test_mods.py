"""Mods: BlockNorm and Hard Swish against direct numpy formulas, BlockNorm's gain / epsilon /
non-divisible widths, the unfused FusedDenseNormAct against the Dense -> Norm -> act chain it
replaces, and every model's shapes and site names with each Mod on (extending
tests/models/test_models.py)."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax.models import (MODEL_NAMES, ActSite, DenseSite, EinsumSite, SiteConfig, apply_mods,
                             build_model, site_name, site_products)
from loka_jax.mods import BlockNorm, functional
from loka_jax.models.fused import FusedDenseNormAct, fused_sites
from loka_jax.precision import BF16, FP32
from model_helpers import EXPECTED_SITES, FINAL_LAYER, random_variables, tiny


def numpy_block_norm(x, block, eps):
  """Each run of `block` features (the last one possibly shorter) over its RMS, in float64."""
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  for start in range(0, x.shape[-1], block):
    part = x[..., start:start + block]
    out[..., start:start + block] = part / np.sqrt(np.mean(part ** 2, axis=-1, keepdims=True)
                                                   + eps)
  return out


def heavy(key, shape):
  """Random features with very different scales per row and per block (never zeros)."""
  k1, k2, k3 = jax.random.split(key, 3)
  rows = jnp.exp(2.0 * jax.random.normal(k2, shape[:-1] + (1,)))
  cols = jnp.exp(jax.random.normal(k3, shape[-1:]))
  return jax.random.normal(k1, shape) * rows * cols


class BlockNormTest(chex.TestCase):

  @parameterized.named_parameters(
      ("divisible", 48, 16), ("shorter_last_block", 40, 16), ("narrower_than_block", 10, 16),
      ("block_of_one", 6, 1), ("default_block_with_tail", 300, 256))
  def test_matches_numpy(self, width, block):
    x = heavy(jax.random.key(width), (3, 5, width))
    eps = 1e-6
    got = jax.jit(lambda v: functional.block_norm(v, block, eps))(x)
    chex.assert_shape(got, x.shape)
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), numpy_block_norm(x, block, eps), rtol=2e-5,
                               atol=2e-6)

  @parameterized.parameters((48, 16), (40, 16), (300, 256), (7, 16))
  def test_every_block_has_unit_rms(self, width, block):
    k1, k2 = jax.random.split(jax.random.key(7))
    # Rows from 1 to 1000 in scale: every block's mean square dwarfs epsilon.
    x = jax.random.normal(k1, (64, width)) * 10.0 ** jax.random.uniform(k2, (64, 1), maxval=3.0)
    y = np.asarray(BlockNorm(block, policy=FP32).apply({}, x), np.float64)
    starts = range(0, width, block)
    rms = np.stack([np.sqrt(np.mean(y[:, s:s + block] ** 2, axis=-1)) for s in starts], -1)
    chex.assert_shape(rms, (64, len(starts)))
    np.testing.assert_allclose(rms, 1.0, atol=1e-5)

  def test_epsilon_keeps_zero_blocks_zero_and_gradients_finite(self):
    x = heavy(jax.random.key(3), (4, 40)).at[:, 16:32].set(0.0)   # the middle block is zero
    y = functional.block_norm(x, 16, 1e-6)
    np.testing.assert_array_equal(np.asarray(y[:, 16:32]), 0.0)
    grad = jax.jit(jax.grad(
        lambda v: jnp.sum(functional.block_norm(v, 16, 1e-6) * jnp.arange(40.0))))(x)
    self.assertTrue(bool(jnp.all(jnp.isfinite(grad))))
    # A larger epsilon shrinks a small block's output below unit RMS, as documented.
    small = 1e-3 * jnp.ones((1, 16))
    self.assertLess(float(jnp.sqrt(jnp.mean(functional.block_norm(small, 16, 1e-4) ** 2))), 0.2)

  def test_learnable_gain(self):
    x = heavy(jax.random.key(4), (6, 40))
    layer = BlockNorm(16, use_gain=True, policy=FP32)
    variables = layer.init(jax.random.key(0), x)
    chex.assert_shape(variables["params"]["scale"], (40,))
    np.testing.assert_allclose(np.asarray(layer.apply(variables, x)),
                               numpy_block_norm(x, 16, 1e-6), rtol=2e-5, atol=2e-6)  # ones
    gain = jax.random.normal(jax.random.key(5), (40,))
    got = layer.apply({"params": {"scale": gain}}, x)
    np.testing.assert_allclose(np.asarray(got), numpy_block_norm(x, 16, 1e-6) * np.asarray(gain),
                               rtol=2e-5, atol=2e-6)
    grad = jax.grad(lambda g: jnp.sum(layer.apply({"params": {"scale": g}}, x) ** 2))(gain)
    self.assertGreater(float(jnp.min(jnp.abs(grad))), 0.0)
    self.assertEqual(BlockNorm(16, policy=FP32).init(jax.random.key(0), x), {})  # parameter-free

  def test_bf16_keeps_float32_statistics(self):
    x = heavy(jax.random.key(6), (8, 40)).astype(jnp.bfloat16)
    y = BlockNorm(16, policy=BF16).apply({}, x)
    chex.assert_type(y, jnp.bfloat16)
    want = numpy_block_norm(np.asarray(x, np.float32), 16, 1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2)  # bf16 rounding

  def test_bad_block_size(self):
    with self.assertRaisesRegex(ValueError, "block_size must be >= 1"):
      functional.block_norm(jnp.ones((2, 4)), 0)


class HardSwishTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_formula(self):
    x = 4.0 * jax.random.normal(jax.random.key(0), (1000,))
    got = self.variant(functional.activation("hard_swish"))(x)
    xn = np.asarray(x, np.float64)
    want = xn * np.minimum(np.maximum(xn + 3.0, 0.0), 6.0) / 6.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(functional.hard_swish(jnp.array([-3.0, 3.0, -5.0]))),
                                  [0.0, 3.0, 0.0])

  def test_unknown_activation_lists_the_known(self):
    with self.assertRaisesRegex(ValueError, "hard_swish"):
      functional.activation("mish")


class ChainReference(nn.Module):
  """What MLP built before the fused layer: DenseSite -> [BlockNorm] -> activation."""
  features: int
  block_size: object
  activation: str
  config: SiteConfig

  @nn.compact
  def __call__(self, x):
    x = DenseSite(self.features, config=self.config, name="dense_0")(x)
    if self.block_size is not None:
      x = BlockNorm(self.block_size, policy=self.config.policy)(x)
    return functional.activation(self.activation)(x)


class FusedLayerUnfusedTest(chex.TestCase):

  @parameterized.parameters((16, "hard_swish", "fp8_all"), (16, "swish", "bf16"),
                            (None, "swish", "fp8_all"), (None, "hard_swish", "bf16"))
  def test_equals_the_chain_it_replaces(self, block_size, activation, precision):
    config = SiteConfig.for_precision(precision)
    x = heavy(jax.random.key(1), (2, 6, 24))
    layer = FusedDenseNormAct(40, config=config, block_size=block_size, activation=activation,
                              name="dense_0")
    variables = layer.init(jax.random.key(2), x)
    variables = jax.tree.map(lambda v: v + 0.3 * jax.random.normal(jax.random.key(3), v.shape),
                             variables)                                    # a nonzero bias
    chain = ChainReference(40, block_size, activation, config)
    got = jax.jit(layer.apply)(variables, x)
    want = jax.jit(chain.apply)({"params": {"dense_0": variables["params"]}}, x)
    chex.assert_shape(got, (2, 6, 40))
    chex.assert_type(got, config.policy.output_dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

  def test_site_and_parameters_are_a_dense_sites(self):
    x = heavy(jax.random.key(4), (5, 24))
    layer = FusedDenseNormAct(40, use_bias=False, config=SiteConfig.for_precision("bf16"),
                              block_size=16, activation="relu", name="dense_3")
    shapes = jax.eval_shape(layer.init, jax.random.key(0), x)
    self.assertEqual(jax.tree.map(lambda s: s.shape, shapes), {"params": {"kernel": (24, 40)}})
    products = site_products(layer, None, x)
    self.assertEqual(list(products), ["dense_3"])
    self.assertEqual((products["dense_3"].lhs_shape, products["dense_3"].rhs_shape),
                     ((5, 24), (24, 40)))

  def test_bad_layer_options(self):
    x = jnp.ones((2, 8))
    with self.assertRaisesRegex(ValueError, "site dense_0: block_size"):
      FusedDenseNormAct(4, block_size=0, name="dense_0").init(jax.random.key(0), x)
    with self.assertRaisesRegex(ValueError, "unknown activation 'tanhh'"):
      FusedDenseNormAct(4, activation="tanhh", name="dense_0").init(jax.random.key(0), x)


def structure(config, features, batch):
  """(site names in call order, {param path: shape}, {fused site: epilogue}) of one build,
  from one abstract trace of `init`."""
  module = build_model(config, features, SiteConfig.for_precision("bf16"))
  names, fused = [], {}

  def record(next_fun, args, kwargs, context):
    site = context.module
    if context.method_name == "__call__" and isinstance(site, (DenseSite, EinsumSite, ActSite)):
      names.append(site_name(site))
      if isinstance(site, FusedDenseNormAct):
        fused[site_name(site)] = (site.block_size, site.activation, site.quantize_output)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)["params"]
  shapes = {jax.tree_util.keystr(p): leaf.shape
            for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  return names, shapes, fused


ONE_AT_A_TIME = (("no_bias",), ("blocknorm",), ("hard_swish",), ("no_bias", "blocknorm",
                                                                  "hard_swish"))


class ModelsWithModsTest(chex.TestCase):
  """Each Mod alone and all together, on every model: sites and shapes stay, only the
  non-final biases (No Bias) and the LayerNorm parameters (BlockNorm) go."""

  @parameterized.parameters(*MODEL_NAMES)
  def test_shapes_and_sites_stable_apart_from_removed_parameters(self, model):
    config, features, batch, _ = tiny(model)
    names, shapes, fused = structure(config, features, batch)
    self.assertCountEqual(names, EXPECTED_SITES[model])
    for mods in ONE_AT_A_TIME:
      modded = apply_mods(config, mods)
      m_names, m_shapes, m_fused = structure(modded, features, batch)
      self.assertEqual(m_names, names, msg=str(mods))
      removed = set(shapes) - set(m_shapes)
      self.assertEqual(set(m_shapes) - set(shapes), set(), msg=str(mods))   # nothing new
      for path in removed:
        is_bias = (slashed(path).endswith("/bias")
                   and slashed(path) != f"{FINAL_LAYER[model]}/bias")
        is_layernorm = "layernorm" in path
        self.assertTrue((is_bias and "no_bias" in mods) or (is_layernorm and "blocknorm" in mods),
                        msg=f"{mods}: {path} removed")
      for path, shape in m_shapes.items():
        self.assertEqual(shape, shapes[path], msg=path)
      if "no_bias" in mods:
        self.assertTrue(any(p.endswith("['bias']") for p in removed))
      # Fused sites: activated MLP layers whose norm is BlockNorm (or none); the Mods only
      # set their block and activation, except that BlockNorm makes normed layers fusable.
      self.assertLessEqual(set(m_fused), set(names))
      self.assertLessEqual(set(fused), set(m_fused), msg=str(mods))
      if "blocknorm" not in mods:
        self.assertEqual(set(m_fused), set(fused), msg=str(mods))
      elif config.mlp_norm:
        self.assertGreater(len(m_fused), len(fused), msg=str(mods))
      for block, act, quant in m_fused.values():
        self.assertFalse(quant)
        self.assertEqual(act, "hard_swish" if "hard_swish" in mods else config.activation)
        self.assertIn(block, (int(modded.mods.block_size), None))

  def test_blocknorm_block_is_the_configs_in_training_and_inference(self):
    config, features, batch, _ = tiny("wukong")
    modded = apply_mods(config, ["blocknorm", "hard_swish"])
    module = build_model(modded, features, SiteConfig.for_precision("fp32"))
    blocks = {block for block, _, _ in fused_sites(module, batch).values()}
    self.assertEqual(blocks, {16})                                          # tiny's block
    norms = []

    def record(next_fun, args, kwargs, context):
      if isinstance(context.module, BlockNorm):
        norms.append(context.module.block_size)
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch)
    self.assertEqual(set(norms), {16})                  # the standalone BlockNorms too
    variables = random_variables(shapes, seed=1)
    train = jax.jit(lambda v: module.apply(v, batch, train=True))(variables)
    infer = jax.jit(lambda v: module.apply(v, batch, train=False))(variables)
    chex.assert_tree_all_finite(train)
    np.testing.assert_array_equal(np.asarray(train), np.asarray(infer))


def slashed(path: str) -> str:
  """"['head']['dense_1']['bias']" -> 'head/dense_1/bias'."""
  return path.strip("[]'").replace("']['", "/")


if __name__ == "__main__":
  absltest.main()
