"""DHEN: stacked layers, each an ensemble of interaction modules on the same tokens.

Layer: `Y = Norm(Ensemble_j Interaction_j(X) + ShortCut(X))`; every module maps n x d to
n_out x d; ShortCut is the identity, or a linear map over the token axis when n changes;
the ensemble is a sum (default) or a token-axis concat followed by a linear projection.

Sites per layer `layer_<i>`:
  dot        `dot/pairwise` (X X^T, act x act), `dot/mlp/dense_<j>`
  attention  `attention/mha/{query,key,value,out}`, `attention/mha/{scores,context}`,
             `attention/ffn/dense_<j>`, `attention_proj` (only when n changes)
  dcn        `dcn/w` or `dcn/v`, `dcn/u` (a DCNv2 cross layer on flatten(X)), `dcn_proj`
  linear     `linear` (W X over the token axis)
  `ensemble` (concat mode), `shortcut` (when n changes); then `head/dense_<j>`.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import embedding
from loka_jax.models.layers import (MLP, CrossLayer, EncoderLayer, TowerOptions, strict_upper,
                                    token_linear)
from loka_jax.models.site import ActSite

MODULES = ("dot", "attention", "dcn", "linear")
ENSEMBLES = ("sum", "concat")


def check_layer_options(modules: Sequence[str], ensemble: str) -> None:
  unknown = [m for m in modules if m not in MODULES]
  if unknown or not modules:
    raise ValueError(f"DHEN modules {list(modules)}: use a non-empty subset of {MODULES}")
  if ensemble not in ENSEMBLES:
    raise ValueError(f"unknown DHEN ensemble {ensemble!r}; use one of {ENSEMBLES}")


class DotModule(nn.Module):
  """Pairwise dots X X^T, strict upper triangle, MLP to out_tokens * d."""
  out_tokens: int
  mlp: Sequence[int]
  opts: TowerOptions
  mlp_norm: bool = False

  @nn.compact
  def __call__(self, x):
    batch, _, d = x.shape
    pairs = strict_upper(ActSite("bnd,bmd->bnm", config=self.opts.site, name="pairwise")(x, x))
    h = MLP(tuple(self.mlp) + (self.out_tokens * d,), self.opts, norm_hidden=self.mlp_norm,
            name="mlp")(pairs)
    return h.reshape(batch, self.out_tokens, d)


class DhenLayer(nn.Module):
  """One DHEN layer: [B, n, d] -> [B, out_tokens, d]."""
  out_tokens: int
  modules: Sequence[str]
  opts: TowerOptions
  ensemble: str = "sum"
  dot_mlp: Sequence[int] = (64,)
  num_heads: int = 2
  attention_ffn: int = 64
  dcn_rank: int = 0
  mlp_norm: bool = False

  @nn.compact
  def __call__(self, x):
    check_layer_options(self.modules, self.ensemble)
    batch, n, d = x.shape
    site = self.opts.site
    to_out = lambda y, name: y if n == self.out_tokens else token_linear(y, self.out_tokens,
                                                                         site, name)
    outs = []
    for module in self.modules:
      if module == "dot":
        y = DotModule(self.out_tokens, self.dot_mlp, self.opts, self.mlp_norm, name="dot")(x)
      elif module == "attention":
        y = EncoderLayer(self.num_heads, self.attention_ffn, self.opts, name="attention")(x)
        y = to_out(y, "attention_proj")
      elif module == "dcn":
        flat = x.reshape(batch, n * d)
        y = CrossLayer(self.dcn_rank, self.opts, name="dcn")(flat, flat).reshape(batch, n, d)
        y = to_out(y, "dcn_proj")
      else:
        y = token_linear(x, self.out_tokens, site, "linear")
      outs.append(y)
    dtype = outs[0].dtype
    if self.ensemble == "sum":
      mixed = sum(o.astype(dtype) for o in outs)
    else:
      mixed = token_linear(jnp.concatenate([o.astype(dtype) for o in outs], axis=1),
                           self.out_tokens, site, "ensemble")
    shortcut = to_out(x, "shortcut")
    return self.opts.make_norm("norm")(mixed + shortcut.astype(mixed.dtype))


class DHEN(nn.Module):
  """Embeddings -> `num_layers` DHEN layers -> flatten -> head MLP -> logit."""
  features: FeatureSpec
  opts: TowerOptions
  embed_dim: int
  bottom_mlp: Sequence[int]
  num_layers: int
  modules: Sequence[str]
  head_mlp: Sequence[int]
  layer_tokens: int = 0
  ensemble: str = "sum"
  dot_mlp: Sequence[int] = (64,)
  num_heads: int = 2
  attention_ffn: int = 64
  dcn_rank: int = 0
  dense_tokens: int = 1
  max_vocab: int = 0
  pooling: str = "sum"
  dense_transform: str = "signed_log1p"
  mlp_norm: bool = True

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train  # no dropout or batch statistics in this tower
    embedding.check_batch(batch, self.features, model="dhen")
    x, _, _ = embedding.embed_inputs(
        batch, features=self.features, embed_dim=self.embed_dim, max_vocab=self.max_vocab,
        pooling=self.pooling, dense_tokens=self.dense_tokens, bottom_mlp=self.bottom_mlp,
        bottom_activate_final=False, norm_hidden=self.mlp_norm, opts=self.opts,
        dense_transform=self.dense_transform)
    for i in range(self.num_layers):
      x = DhenLayer(self.layer_tokens or x.shape[1], self.modules, self.opts, self.ensemble,
                    self.dot_mlp, self.num_heads, self.attention_ffn, self.dcn_rank,
                    self.mlp_norm, name=f"layer_{i}")(x)
    head = MLP(tuple(self.head_mlp) + (1,), self.opts, norm_hidden=self.mlp_norm,
               final_bias=True, name="head")(x.reshape(x.shape[0], -1))
    return head[:, 0].astype(jnp.float32)
