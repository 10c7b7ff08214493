"""Equation tests of the towers' blocks: each block on a tiny hand-sized input against a direct
numpy computation of its equation (fp32 sites, random parameters and inputs)."""
import jax
import numpy as np
from absl.testing import absltest, parameterized
import chex

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import dlrm, interformer, layers, wukong
from loka_jax.models.dhen import DhenLayer
from loka_jax.models.embedding import Embeddings, transform_dense
from loka_jax.models.site import SiteConfig

FP32 = SiteConfig.for_precision("fp32")
SWISH = layers.TowerOptions(site=FP32, activation="swish", norm="layernorm")
RTOL, ATOL = 2e-5, 2e-5
# Tiny graphs: LLVM's optimizations cost more compile time than they could save here.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def randomized(variables, seed=1):
  """Every parameter replaced by fresh random values (zero biases would hide missing terms)."""
  leaves, tree = jax.tree.flatten(variables)
  rng = np.random.default_rng(seed)
  fresh = [np.asarray(rng.normal(0.0, 0.5, leaf.shape), np.float32) for leaf in leaves]
  return jax.tree.unflatten(tree, fresh)


def run(module, *args):
  """(numpy params, output) of `module` on `args` with randomized parameters."""
  init = jax.jit(module.init, compiler_options=FAST_COMPILE)
  variables = randomized(init(jax.random.PRNGKey(0), *args))
  out = jax.jit(module.apply, compiler_options=FAST_COMPILE)(variables, *args)
  params = jax.tree.map(np.asarray, variables.get("params", {}))
  return params, np.asarray(out, np.float64)


def np_swish(x):
  return x / (1.0 + np.exp(-x))


def np_layernorm(x, p, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["layernorm"]["scale"] + p["layernorm"]["bias"]


def np_mlp(x, p, act=np_swish):
  """Hidden layers activated, last layer linear (the default MLP block)."""
  count = len(p)
  for i in range(count):
    dense = p[f"dense_{i}"]
    x = x @ dense["kernel"] + dense.get("bias", 0.0)
    if i < count - 1:
      x = act(x)
  return x


def np_triu(z):
  n = z.shape[-1]
  rows, cols = np.triu_indices(n, k=1)
  return z[:, rows, cols]


def inputs(*shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class WukongEquationTest(chex.TestCase):

  def np_fmb(self, x, p, out_tokens, attentive):
    batch, n, d = x.shape
    if attentive:
      y = np_mlp(x, p["attentive_y"])                       # [B, n, k], per example
    else:
      y = np.broadcast_to(p["fm_proj"]["kernel"], (batch,) + p["fm_proj"]["kernel"].shape)
    # The naive O(n^2 d) FM: all pairwise dot products X X^T, then times Y.
    fm = np.einsum("bnm,bmk->bnk", np.einsum("bnd,bmd->bnm", x, x), y)
    h = np_layernorm(fm.reshape(batch, -1), p["norm"])
    return np_mlp(h, p["mlp"]).reshape(batch, out_tokens, d)

  @parameterized.parameters(False, True)
  def test_fmb_equals_naive_fm(self, attentive):
    x = inputs(2, 5, 6)
    block = wukong.FactorizationMachineBlock(out_tokens=2, rank=3, mlp=(7,), opts=SWISH,
                                             attentive_y=attentive)
    p, out = run(block, x)
    chex.assert_shape(out, (2, 2, 6))
    np.testing.assert_allclose(out, self.np_fmb(x.astype(np.float64), p, 2, attentive),
                               rtol=RTOL, atol=ATOL)

  def test_layer_with_residual_projection(self):
    x = inputs(2, 5, 6, seed=3)                              # n = 5 -> n_F + n_L = 4
    layer = wukong.WukongLayer(fmb_tokens=2, lcb_tokens=2, rank=3, fmb_mlp=(7,), opts=SWISH)
    p, out = run(layer, x)
    x64 = x.astype(np.float64)
    fmb = self.np_fmb(x64, p["fmb"], 2, False)
    lcb = np.einsum("nl,bnd->bld", p["lcb"]["kernel"], x64)         # W_L X over tokens
    residual = np.einsum("nl,bnd->bld", p["residual"]["kernel"], x64)
    expected = np_layernorm(np.concatenate([fmb, lcb], axis=1) + residual, p["norm"])
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)

  def test_layer_identity_residual_has_no_projection(self):
    x = inputs(2, 4, 6, seed=4)
    layer = wukong.WukongLayer(fmb_tokens=2, lcb_tokens=2, rank=3, fmb_mlp=(7,), opts=SWISH)
    p, out = run(layer, x)
    self.assertNotIn("residual", p)
    x64 = x.astype(np.float64)
    cat = np.concatenate([self.np_fmb(x64, p["fmb"], 2, False),
                          np.einsum("nl,bnd->bld", p["lcb"]["kernel"], x64)], axis=1)
    np.testing.assert_allclose(out, np_layernorm(cat + x64, p["norm"]), rtol=RTOL, atol=ATOL)


class DlrmDcnEquationTest(chex.TestCase):

  def test_dot_interaction(self):
    x = inputs(3, 5, 4)
    _, out = run(dlrm.DotInteraction(layers.TowerOptions(site=FP32)), x)
    chex.assert_shape(out, (3, 10))
    gram = np.einsum("bnd,bmd->bnm", x.astype(np.float64), x.astype(np.float64))
    expected = np.stack([[gram[b, i, j] for i in range(5) for j in range(i + 1, 5)]
                         for b in range(3)])
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)

  @parameterized.parameters(0, 3)
  def test_cross_layer(self, rank):
    x0, xl = inputs(4, 10, seed=1), inputs(4, 10, seed=2)
    p, out = run(layers.CrossLayer(rank, layers.TowerOptions(site=FP32)), x0, xl)
    x0, xl = x0.astype(np.float64), xl.astype(np.float64)
    if rank:
      self.assertEqual(p["v"]["kernel"].shape, (10, 3))
      self.assertNotIn("bias", p["v"])
      wx = (xl @ p["v"]["kernel"]) @ p["u"]["kernel"] + p["u"]["bias"]      # W = U V
    else:
      wx = xl @ p["w"]["kernel"] + p["w"]["bias"]
    np.testing.assert_allclose(out, x0 * wx + xl, rtol=RTOL, atol=ATOL)


class DhenEquationTest(chex.TestCase):

  def test_linear_and_dot_modules_summed(self):
    x = inputs(2, 4, 3)
    layer = DhenLayer(out_tokens=4, modules=("linear", "dot"), opts=SWISH, dot_mlp=(5,))
    p, out = run(layer, x)
    x64 = x.astype(np.float64)
    linear = np.einsum("nl,bnd->bld", p["linear"]["kernel"], x64)
    dot = np_mlp(np_triu(np.einsum("bnd,bmd->bnm", x64, x64)), p["dot"]["mlp"]).reshape(2, 4, 3)
    np.testing.assert_allclose(out, np_layernorm(linear + dot + x64, p["norm"]),
                               rtol=RTOL, atol=ATOL)

  def test_concat_ensemble_and_shortcut_projection(self):
    x = inputs(2, 5, 3, seed=5)
    layer = DhenLayer(out_tokens=3, modules=("linear", "dcn"), opts=SWISH, ensemble="concat",
                      dcn_rank=2)
    p, out = run(layer, x)
    x64 = x.astype(np.float64)
    linear = np.einsum("nl,bnd->bld", p["linear"]["kernel"], x64)
    flat = x64.reshape(2, 15)
    cross = flat * ((flat @ p["dcn"]["v"]["kernel"]) @ p["dcn"]["u"]["kernel"]
                    + p["dcn"]["u"]["bias"]) + flat
    dcn = np.einsum("nl,bnd->bld", p["dcn_proj"]["kernel"], cross.reshape(2, 5, 3))
    mixed = np.einsum("nl,bnd->bld", p["ensemble"]["kernel"], np.concatenate([linear, dcn], 1))
    shortcut = np.einsum("nl,bnd->bld", p["shortcut"]["kernel"], x64)
    np.testing.assert_allclose(out, np_layernorm(mixed + shortcut, p["norm"]),
                               rtol=RTOL, atol=ATOL)


def np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


class InterFormerEquationTest(chex.TestCase):

  def test_gating(self):
    z = inputs(2, 3, 4)
    p, out = run(interformer.Gating(hidden=(), activation="sigmoid", opts=SWISH), z)
    z64 = z.astype(np.float64)
    mlp = (z64.reshape(2, 12) @ p["mlp"]["dense_0"]["kernel"]
           + p["mlp"]["dense_0"]["bias"]).reshape(2, 3, 4)
    np.testing.assert_allclose(out, 1.0 / (1.0 + np.exp(-z64 * mlp)), rtol=RTOL, atol=ATOL)

  def test_personalized_ffn(self):
    x_sum, s = inputs(2, 2, 4, seed=1), inputs(2, 6, 4, seed=2)
    p, out = run(interformer.PersonalizedFFN(SWISH), x_sum, s)
    dense = p["weight"]
    w_p = (x_sum.reshape(2, 8).astype(np.float64) @ dense["kernel"] + dense["bias"])
    w_p = w_p.reshape(2, 4, 4)                                         # per-example d x d
    s64 = s.astype(np.float64)
    expected = np_layernorm(s64 + np.einsum("btd,bde->bte", s64, w_p), p["norm"])
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)

  def test_recent_tokens_skip_padding(self):
    events = np.arange(2 * 5, dtype=np.float32).reshape(2, 5, 1) + 1.0
    mask = np.array([[1, 0, 1, 1, 0], [0, 1, 0, 0, 0]], bool)          # padding anywhere
    out = np.asarray(interformer.recent_tokens(events, mask, 3))[..., 0]
    np.testing.assert_array_equal(out, [[4.0, 3.0, 1.0], [7.0, 0.0, 0.0]])

  def test_masked_self_attention(self):
    x = inputs(2, 5, 4)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    p, out = run(layers.SelfAttention(num_heads=2, opts=SWISH), x, mask)
    x64 = x.astype(np.float64)
    proj = lambda name, v: v @ p[name]["kernel"] + p[name]["bias"]
    heads = lambda v: v.reshape(2, 5, 2, 2)
    q, k, v = (heads(proj(name, x64)) for name in ("query", "key", "value"))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(2.0)
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    ctx = np.einsum("bhqk,bkhd->bqhd", np_softmax(scores), v).reshape(2, 5, 4)
    np.testing.assert_allclose(out, proj("out", ctx), rtol=RTOL, atol=ATOL)

  def test_rotary_scores_depend_on_relative_position(self):
    q, k = inputs(1, 1, 1, 8, seed=1), inputs(1, 1, 1, 8, seed=2)
    def score(m, n):
      qm = np.asarray(layers.rotary(q, np.array([m])), np.float64)
      kn = np.asarray(layers.rotary(k, np.array([n])), np.float64)
      return float(np.sum(qm * kn))
    self.assertAlmostEqual(score(3, 1), score(7, 5), places=4)
    self.assertNotAlmostEqual(score(3, 1), score(1, 3), places=3)
    rotated = np.asarray(layers.rotary(q, np.array([5])))
    np.testing.assert_allclose(np.linalg.norm(rotated), np.linalg.norm(q), rtol=1e-5)

  def test_masknet_merge(self):
    seq = inputs(2, 2, 3, 4)                                           # [B, A, T, d]
    mask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    p, out = run(interformer.MaskNetMerge(hidden=(5,), opts=SWISH), seq, mask)
    cat = np.transpose(seq.astype(np.float64), (0, 2, 1, 3)).reshape(2, 3, 8)
    merged = np_mlp(cat * np_mlp(cat, p["mask_mlp"]), p["lce"])
    np.testing.assert_allclose(out, merged * mask[..., None], rtol=RTOL, atol=ATOL)


class EmbeddingTest(chex.TestCase):

  def test_signed_log1p_dense_transform(self):
    dense = np.array([[-1e4, -2.0, 0.0, 0.5, 3.0, 1e4]], np.float32)
    out = np.asarray(transform_dense(dense, "signed_log1p"))
    np.testing.assert_allclose(out, np.sign(dense) * np.log(1.0 + np.abs(dense)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(transform_dense(dense, "none")), dense)

  @parameterized.parameters("sum", "mean")
  def test_pooled_bags(self, pooling):
    spec = FeatureSpec(num_dense=0, vocab_sizes=(7, 30), bag_size=3)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, 7, (4, 3)), rng.integers(0, 30, (4, 3))], 1).astype(np.int32)
    mask = rng.random((4, 2, 3)) < 0.6
    mask[0, 0] = False                                                 # an empty bag
    ids[~mask] = 0
    module = Embeddings(spec, embed_dim=5, max_vocab=10, pooling=pooling,
                        policy=FP32.policy)
    batch = {"sparse_ids": ids, "sparse_mask": mask}
    variables = module.init(jax.random.PRNGKey(0), batch)
    tables = variables["params"]
    self.assertEqual(tables["sparse_0"].shape, (7, 5))
    self.assertEqual(tables["sparse_1"].shape, (10, 5))                # capped: ids hash mod 10
    out, _ = module.apply(variables, batch)
    for f, rows in enumerate((7, 10)):
      table = np.asarray(tables[f"sparse_{f}"], np.float64)
      gathered = table[ids[:, f] % rows] * mask[:, f, :, None]
      expected = gathered.sum(1)
      if pooling == "mean":
        expected = expected / np.maximum(mask[:, f].sum(1), 1)[:, None]
      np.testing.assert_allclose(np.asarray(out)[:, f], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[0, 0], 0.0)


if __name__ == "__main__":
  absltest.main()
