"""Wukong: stacked factorization-machine blocks (FMB) and linear compression blocks (LCB).

Layer i: `X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + R(X_i))` with R the identity when the token
count is unchanged, else a linear map over the token axis. FMB uses the optimized FM:
`P = X^T Y` first (d x k, O(nkd)), then `F = X P` (n x k), `reshape(MLP(LN(flatten(F))))`.

Sites per layer `layer_<i>`: `fmb/fm_proj` (P = X^T Y; act x weight, or act x act with the
attentive Y whose MLP is `fmb/attentive_y/dense_<j>`), `fmb/optimized_fm` (F = X P, act x act),
`fmb/mlp/dense_<j>`, `lcb` (act x weight over the token axis), `residual` (only when the token
count changes); then `head/dense_<j>`.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import embedding
from loka_jax.models.layers import MLP, TowerOptions, token_linear
from loka_jax.models.site import ActSite, EinsumSite


class FactorizationMachineBlock(nn.Module):
  """FMB: [B, n, d] -> [B, out_tokens, d] through the optimized FM `X (X^T Y)`."""
  out_tokens: int
  rank: int
  mlp: Sequence[int]
  opts: TowerOptions
  attentive_y: bool = False
  mlp_norm: bool = False

  @nn.compact
  def __call__(self, x):
    batch, n, d = x.shape
    site = self.opts.site
    if self.attentive_y:
      # Y depends on the example: a linear compression of each token (d -> k) then an MLP.
      y = MLP((self.rank, self.rank), self.opts, name="attentive_y")(x)          # [B, n, k]
      p = ActSite("bnd,bnk->bdk", config=site, name="fm_proj")(x, y)
    else:
      p = EinsumSite("bnd,nk->bdk", (n, self.rank), config=site, name="fm_proj")(x)  # X^T Y
    f = ActSite("bnd,bdk->bnk", config=site, name="optimized_fm")(x, p)            # X P
    h = self.opts.make_norm("norm")(f.reshape(batch, n * self.rank))
    h = MLP(tuple(self.mlp) + (self.out_tokens * d,), self.opts, norm_hidden=self.mlp_norm,
            name="mlp")(h)
    return h.reshape(batch, self.out_tokens, d)


class WukongLayer(nn.Module):
  """One interaction layer: FMB and LCB side by side, residual, norm."""
  fmb_tokens: int
  lcb_tokens: int
  rank: int
  fmb_mlp: Sequence[int]
  opts: TowerOptions
  attentive_y: bool = False
  mlp_norm: bool = False

  @nn.compact
  def __call__(self, x):
    fmb = FactorizationMachineBlock(self.fmb_tokens, self.rank, self.fmb_mlp, self.opts,
                                    self.attentive_y, self.mlp_norm, name="fmb")(x)
    lcb = token_linear(x, self.lcb_tokens, self.opts.site, "lcb")
    out = jnp.concatenate([fmb.astype(lcb.dtype), lcb], axis=1)
    width = self.fmb_tokens + self.lcb_tokens
    residual = x if x.shape[1] == width else token_linear(x, width, self.opts.site, "residual")
    return self.opts.make_norm("norm")(out + residual.astype(out.dtype))


class Wukong(nn.Module):
  """Embeddings -> `num_layers` Wukong layers -> flatten -> head MLP -> logit."""
  features: FeatureSpec
  opts: TowerOptions
  embed_dim: int
  bottom_mlp: Sequence[int]
  num_layers: int
  fmb_tokens: int
  lcb_tokens: int
  fm_rank: int
  fmb_mlp: Sequence[int]
  head_mlp: Sequence[int]
  attentive_y: bool = False
  dense_tokens: int = 1
  max_vocab: int = 0
  pooling: str = "sum"
  dense_transform: str = "signed_log1p"
  mlp_norm: bool = True

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train  # no dropout or batch statistics in this tower
    embedding.check_batch(batch, self.features, model="wukong")
    x, _, _ = embedding.embed_inputs(
        batch, features=self.features, embed_dim=self.embed_dim, max_vocab=self.max_vocab,
        pooling=self.pooling, dense_tokens=self.dense_tokens, bottom_mlp=self.bottom_mlp,
        bottom_activate_final=False, norm_hidden=self.mlp_norm, opts=self.opts,
        dense_transform=self.dense_transform)
    for i in range(self.num_layers):
      x = WukongLayer(self.fmb_tokens, self.lcb_tokens, self.fm_rank, self.fmb_mlp, self.opts,
                      self.attentive_y, self.mlp_norm, name=f"layer_{i}")(x)
    head = MLP(tuple(self.head_mlp) + (1,), self.opts, norm_hidden=self.mlp_norm,
               final_bias=True, name="head")(x.reshape(x.shape[0], -1))
    return head[:, 0].astype(jnp.float32)
