"""DCNv2: x0 = flatten(X0); stacked cross layers `x_{l+1} = x0 * (W_l x_l + b_l) + x_l`
(full rank or low rank `W = U V`), then the over-arch MLP.

Sites: `bottom_mlp/dense_<i>`, `cross_<l>/w` (full rank) or `cross_<l>/v`, `cross_<l>/u`
(low rank), `top_mlp/dense_<i>`.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import embedding
from loka_jax.models.layers import MLP, CrossLayer, TowerOptions


class DCNv2(nn.Module):
  """Stacked cross network followed by the over-arch MLP (the MLPerf DLRMv2 layout)."""
  features: FeatureSpec
  opts: TowerOptions
  embed_dim: int
  bottom_mlp: Sequence[int]
  top_mlp: Sequence[int]
  num_cross_layers: int
  cross_rank: int = 0
  max_vocab: int = 0
  pooling: str = "sum"
  dense_transform: str = "signed_log1p"
  mlp_norm: bool = False

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train  # no dropout or batch statistics in this tower
    embedding.check_batch(batch, self.features, model="dcnv2")
    x0, _, _ = embedding.embed_inputs(
        batch, features=self.features, embed_dim=self.embed_dim, max_vocab=self.max_vocab,
        pooling=self.pooling, dense_tokens=1, bottom_mlp=self.bottom_mlp,
        bottom_activate_final=True, norm_hidden=self.mlp_norm, opts=self.opts,
        dense_transform=self.dense_transform)
    x0 = x0.reshape(x0.shape[0], -1)
    x = x0
    for layer in range(self.num_cross_layers):
      x = CrossLayer(self.cross_rank, self.opts, name=f"cross_{layer}")(x0, x)
    top = MLP(tuple(self.top_mlp) + (1,), self.opts, norm_hidden=self.mlp_norm, final_bias=True,
              name="top_mlp")(x)
    return top[:, 0].astype(jnp.float32)
