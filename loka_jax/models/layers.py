"""Building blocks shared by the towers: MLPs, token-axis linear maps, cross layers, attention.

Every product goes through a GEMM site (`DenseSite`, `EinsumSite`, `ActSite`) created with an
explicit, readable name, so a site's name is the path of the blocks that hold it
(e.g. `layer_0/attention/scores`). Each site is called exactly once per forward pass, which
stateful fused-op kernels (delayed scaling) rely on.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.mods import Norm, functional
from loka_jax.models.fused import FusedDenseNormAct
from loka_jax.models.site import ActSite, DenseSite, EinsumSite, SiteConfig

TOKEN_LINEAR_SPEC = "bnd,nl->bld"  # W X over the token axis; the weight is the right operand


@dataclasses.dataclass(frozen=True)
class TowerOptions:
  """Tower-wide choices every block needs: sites (policy + plan), activation, norm, biases.

  Mods arrive here already resolved (see `build.tower_options`): `use_bias` False is the
  No Bias mod, norm 'blocknorm' the BlockNorm mod, activation 'hard_swish' the Hard Swish mod.
  `keep_bias` holds No Bias's exceptions: glob patterns of the dense sites (by path, e.g.
  `top_mlp/dense_0`) that keep their bias; blocks ask `bias_at`.
  """
  site: SiteConfig = SiteConfig()
  activation: str = "relu"
  norm: str = "layernorm"
  block_size: int = 256
  use_bias: bool = True
  keep_bias: Tuple[str, ...] = ()

  def __post_init__(self):
    functional.activation(self.activation)  # unknown names fail at build time

  @property
  def policy(self):
    return self.site.policy

  def bias_at(self, module: nn.Module, name: str) -> bool:
    """Whether the dense site `name` inside `module` has a bias: with biases on, every one;
    under No Bias, those whose path matches a `keep_bias` pattern."""
    if self.use_bias:
      return True
    path = "/".join(tuple(module.path) + (name,))
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.keep_bias)

  def act(self, x):
    return functional.activation(self.activation)(x)

  def make_norm(self, name: str) -> Norm:
    return Norm(kind=self.norm, block_size=self.block_size, policy=self.policy, name=name)


# Norms an activated MLP layer can fold into one fused site (models.fused.FusedDenseNormAct).
FUSABLE_NORMS = ("blocknorm", "none")


class MLP(nn.Module):
  """Stack of dense sites `dense_0..`; hidden layers: Linear [-> Norm] -> activation.

  `final_bias=True` keeps the last layer's bias whatever `opts.use_bias` says: the final
  prediction layer keeps its bias under the No Bias mod. Activated layers whose norm is
  BlockNorm (or none) are one `FusedDenseNormAct` site named `dense_<i>`, so a plan can give
  them a fused-epilogue kernel; unfused it computes what Linear -> Norm -> activation did.
  """
  features: Sequence[int]
  opts: TowerOptions
  activate_final: bool = False
  norm_hidden: bool = False
  final_bias: Optional[bool] = None

  @nn.compact
  def __call__(self, x):
    if not self.features:
      raise ValueError(f"MLP {'/'.join(self.path)} has no layers")
    last = len(self.features) - 1
    norm = self.opts.norm if self.norm_hidden else "none"
    for i, width in enumerate(self.features):
      use_bias = self.opts.bias_at(self, f"dense_{i}")
      if i == last and self.final_bias is not None:
        use_bias = self.final_bias
      if (i < last or self.activate_final) and norm in FUSABLE_NORMS:
        x = FusedDenseNormAct(
            int(width), use_bias=use_bias, config=self.opts.site,
            block_size=self.opts.block_size if norm == "blocknorm" else None,
            activation=self.opts.activation, name=f"dense_{i}")(x)
        continue
      x = DenseSite(int(width), use_bias=use_bias, config=self.opts.site, name=f"dense_{i}")(x)
      if i < last or self.activate_final:
        if self.norm_hidden:
          x = self.opts.make_norm(f"norm_{i}")(x)
        x = self.opts.act(x)
    return x


def token_linear(x, out_tokens: int, site: SiteConfig, name: str):
  """`W X` over the token axis: [B, n, d] -> [B, out_tokens, d] (Wukong's LCB, DHEN's linear)."""
  return EinsumSite(TOKEN_LINEAR_SPEC, (x.shape[1], out_tokens), config=site, name=name)(x)


class CrossLayer(nn.Module):
  """DCNv2 cross layer `x_{l+1} = x0 * (W x_l + b) + x_l`.

  rank 0: full-rank W as one site `w`; rank r > 0: `W = U V` as two sites, `v` (D -> r, no
  bias) then `u` (r -> D, carrying the bias).
  """
  rank: int
  opts: TowerOptions

  @nn.compact
  def __call__(self, x0, x):
    width = x.shape[-1]
    if self.rank <= 0:
      y = DenseSite(width, use_bias=self.opts.bias_at(self, "w"), config=self.opts.site,
                    name="w")(x)
    else:
      y = DenseSite(self.rank, use_bias=False, config=self.opts.site, name="v")(x)
      y = DenseSite(width, use_bias=self.opts.bias_at(self, "u"), config=self.opts.site,
                    name="u")(y)
    dt = y.dtype
    return x0.astype(dt) * y + x.astype(dt)


def strict_upper(z):
  """Strict upper triangle of [B, n, n] pairwise products, flattened to [B, n(n-1)/2]."""
  n = z.shape[-1]
  rows, cols = np.triu_indices(n, k=1)
  return z[:, rows, cols]


def rotary(x, positions):
  """Rotary position embedding on [B, L, H, Dh] (Dh even), positions [L]; math in float32."""
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"rotary positions need an even head dimension, got {head_dim}")
  half = head_dim // 2
  freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle = positions.astype(jnp.float32)[:, None] * freq[None, :]        # [L, half]
  cos = jnp.cos(angle)[None, :, None, :]
  sin = jnp.sin(angle)[None, :, None, :]
  xf = x.astype(jnp.float32)
  a, b = xf[..., :half], xf[..., half:]
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


def attend(q, k, v, key_mask, site: SiteConfig):
  """Scaled dot-product attention through two act x act sites, `scores` and `context`.

  q [B, Q, H, Dh], k and v [B, K, H, Dh], key_mask [B, K] bool (True = attend) or None.
  Softmax runs in float32 with masked keys at the most negative float (never NaN).
  """
  scores = ActSite("bqhd,bkhd->bhqk", config=site, name="scores")(q, k)
  scores = scores.astype(jnp.float32) / math.sqrt(q.shape[-1])
  if key_mask is not None:
    scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  return ActSite("bhqk,bkhd->bqhd", config=site, name="context")(probs, v)


def split_heads(x, num_heads: int):
  batch, length, width = x.shape
  if width % num_heads:
    raise ValueError(f"width {width} is not divisible by {num_heads} heads")
  return x.reshape(batch, length, num_heads, width // num_heads)


class SelfAttention(nn.Module):
  """Multi-head self-attention: `query`/`key`/`value`/`out` projections (act x weight) and
  `scores`/`context` (act x act); optional rotary positions on queries and keys."""
  num_heads: int
  opts: TowerOptions

  @nn.compact
  def __call__(self, x, key_mask=None, positions=None):
    width = x.shape[-1]
    dense = lambda name: DenseSite(width, use_bias=self.opts.bias_at(self, name),
                                   config=self.opts.site, name=name)
    q = split_heads(dense("query")(x), self.num_heads)
    k = split_heads(dense("key")(x), self.num_heads)
    v = split_heads(dense("value")(x), self.num_heads)
    if positions is not None:
      q, k = rotary(q, positions), rotary(k, positions)
    ctx = attend(q, k, v, key_mask, self.opts.site)
    return dense("out")(ctx.reshape(x.shape[:2] + (width,)))


class PoolingAttention(nn.Module):
  """Pooling by multi-head attention (PMA): learnable queries attend over a token set."""
  num_queries: int
  num_heads: int
  opts: TowerOptions

  @nn.compact
  def __call__(self, x, key_mask=None):
    batch, _, width = x.shape
    dense = lambda name: DenseSite(width, use_bias=self.opts.bias_at(self, name),
                                   config=self.opts.site, name=name)
    seeds = self.param("queries", nn.initializers.normal(stddev=1.0),
                       (self.num_queries, width), self.opts.policy.param_dtype)
    q = jnp.broadcast_to(seeds.astype(self.opts.policy.compute_dtype)[None],
                         (batch, self.num_queries, width))
    q = split_heads(q, self.num_heads)
    k = split_heads(dense("key")(x), self.num_heads)
    v = split_heads(dense("value")(x), self.num_heads)
    ctx = attend(q, k, v, key_mask, self.opts.site)
    return dense("out")(ctx.reshape(batch, self.num_queries, width))


class EncoderLayer(nn.Module):
  """Post-norm transformer encoder layer: attention + residual + norm, FFN + residual + norm."""
  num_heads: int
  ffn_dim: int
  opts: TowerOptions

  @nn.compact
  def __call__(self, x, key_mask=None, positions=None):
    h = SelfAttention(self.num_heads, self.opts, name="mha")(x, key_mask, positions)
    x = self.opts.make_norm("norm_0")(x.astype(h.dtype) + h)
    f = MLP((self.ffn_dim, x.shape[-1]), self.opts, name="ffn")(x)
    return self.opts.make_norm("norm_1")(x.astype(f.dtype) + f)
