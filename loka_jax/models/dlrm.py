"""DLRM: bottom MLP on dense features, pooled embedding bags, pairwise dot interaction, top MLP.

Sites: `bottom_mlp/dense_<i>`, `interaction/dot` (act x act, X X^T), `top_mlp/dense_<i>`.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import embedding
from loka_jax.models.layers import MLP, TowerOptions, strict_upper
from loka_jax.models.site import ActSite


class DotInteraction(nn.Module):
  """Z = X X^T over the tokens (one act x act site `dot`), strict upper triangle flattened."""
  opts: TowerOptions

  @nn.compact
  def __call__(self, x):
    z = ActSite("bnd,bmd->bnm", config=self.opts.site, name="dot")(x, x)
    return strict_upper(z)


class DLRM(nn.Module):
  """tokens = [bottom output, pooled bags]; logits = top_mlp([bottom | triu(X X^T)])."""
  features: FeatureSpec
  opts: TowerOptions
  embed_dim: int
  bottom_mlp: Sequence[int]
  top_mlp: Sequence[int]
  max_vocab: int = 0
  pooling: str = "sum"
  dense_transform: str = "signed_log1p"
  mlp_norm: bool = False

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train  # no dropout or batch statistics in this tower
    embedding.check_batch(batch, self.features, model="dlrm")
    x0, bottom, _ = embedding.embed_inputs(
        batch, features=self.features, embed_dim=self.embed_dim, max_vocab=self.max_vocab,
        pooling=self.pooling, dense_tokens=1, bottom_mlp=self.bottom_mlp,
        bottom_activate_final=True, norm_hidden=self.mlp_norm, opts=self.opts,
        dense_transform=self.dense_transform)
    pairs = DotInteraction(self.opts, name="interaction")(x0)
    parts = [pairs] if bottom is None else [bottom.astype(pairs.dtype), pairs]
    top = MLP(tuple(self.top_mlp) + (1,), self.opts, norm_hidden=self.mlp_norm, final_bias=True,
              name="top_mlp")(jnp.concatenate(parts, axis=-1))
    return top[:, 0].astype(jnp.float32)
