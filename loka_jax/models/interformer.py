"""InterFormer: interleaved interaction, sequence and cross archs over static tokens and a
behaviour sequence.

- Sequence input: the num_seq attribute embeddings of each event are merged by MaskNet,
  `S = MLP_lce(S_cat * MLP_mask(S_cat))`, into one d-wide sequence (padded events zero).
- Cross arch (layer input -> summaries): `X_sum = Gating(LCE(X))` (LCE: n -> n_sum over the
  token axis) and `S_sum = Gating([S_CLS | S_PMA | S_recent])`, with
  `Gating(Z) = act(Z * MLP(Z))` (act sigmoid by default) and MLP over the flattened tokens.
  X_sum of the first layer is prepended to the sequence as its n_sum CLS tokens.
- Interaction arch: `X' = MLP(DHEN_layer([X | S_sum]))`, the DHEN layer mapping back to n
  tokens and the MLP acting on each token.
- Sequence arch: `S' = MHA(PFFN(X_sum, S))`; PFFN: `W_p = X_sum W` (flatten(X_sum) -> d x d,
  per example), `S_p = Norm(S + S W_p)`; MHA: self-attention with the sequence mask and rotary
  positions, residual, norm.
- Prediction: `MLP([X_sum | S_sum])` of a final cross arch on the last layer's output.

Sequences follow the batch contract (chronological, right-aligned: the most recent event
last); the recent tokens are the last real events, wherever the padding sits.

Sites: `seq_merge/{mask_mlp,lce}/dense_<j>`; per layer `layer_<i>`: `cross/x_lce`,
`cross/x_gate/mlp/dense_<j>`, `cross/pma/{key,value,scores,context,out}`,
`cross/s_gate/mlp/dense_<j>`, `interaction/...` (a DHEN layer, see dhen.py),
`interaction_mlp/dense_<j>`, `sequence/pffn/weight`, `sequence/pffn/apply` (S W_p, act x act),
`sequence/mha/{query,key,value,scores,context,out}`; then `cross_final/...`, `head/dense_<j>`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from loka_jax.data.spec import FeatureSpec
from loka_jax.mods import functional
from loka_jax.models import embedding
from loka_jax.models.dhen import DhenLayer, check_layer_options
from loka_jax.models.layers import MLP, PoolingAttention, SelfAttention, TowerOptions, token_linear
from loka_jax.models.site import ActSite, DenseSite

SEQ_MERGES = ("masknet", "sum")


def recent_tokens(events, mask, count: int):
  """The `count` most recent real events of [B, T, d] (newest first), zero where a sequence
  has fewer real events. mask [B, T] bool."""
  real = jnp.sum(mask, axis=1)                               # [B]
  rank = jnp.cumsum(mask, axis=1) - 1                        # rank of each real event
  picks = []
  for j in range(count):
    hit = mask & (rank == (real - 1 - j)[:, None])
    picks.append(jnp.argmax(hit, axis=1))
  index = jnp.stack(picks, axis=1)                           # [B, count]
  tokens = jnp.take_along_axis(events, index[..., None], axis=1)
  valid = jnp.arange(count)[None, :] < real[:, None]
  return tokens * valid[..., None].astype(tokens.dtype)


class MaskNetMerge(nn.Module):
  """MaskNet merge of the per-attribute sequences [B, A, T, d] into one [B, T, d]."""
  hidden: Sequence[int]
  opts: TowerOptions

  @nn.compact
  def __call__(self, seq, mask):
    batch, attrs, length, d = seq.shape
    cat = jnp.transpose(seq, (0, 2, 1, 3)).reshape(batch, length, attrs * d)
    gate = MLP(tuple(self.hidden) + (attrs * d,), self.opts, name="mask_mlp")(cat)
    merged = MLP((d,), self.opts, name="lce")(cat.astype(gate.dtype) * gate)
    return merged * mask[..., None].astype(merged.dtype)


class Gating(nn.Module):
  """`act(Z * MLP(Z))` on [B, m, d], the MLP over the flattened tokens."""
  hidden: Sequence[int]
  activation: str
  opts: TowerOptions

  @nn.compact
  def __call__(self, z):
    batch, m, d = z.shape
    g = MLP(tuple(self.hidden) + (m * d,), self.opts, name="mlp")(z.reshape(batch, m * d))
    return functional.activation(self.activation)(z.astype(g.dtype) * g.reshape(batch, m, d))


class CrossArch(nn.Module):
  """Summaries of both modes: X_sum [B, n_sum, d] and S_sum [B, n_sum + n_pma + n_recent, d].

  With `events` given (first layer), the sequence is built here as [X_sum | events].
  """
  num_sum: int
  num_pma: int
  num_recent: int
  num_heads: int
  gate_mlp: Sequence[int]
  gate_activation: str
  opts: TowerOptions

  @nn.compact
  def __call__(self, x, s, s_mask, events=None):
    x_sum = token_linear(x, self.num_sum, self.opts.site, "x_lce")
    x_sum = Gating(self.gate_mlp, self.gate_activation, self.opts, name="x_gate")(x_sum)
    if events is not None:
      s = jnp.concatenate([x_sum.astype(events.dtype), events], axis=1)
    cls = s[:, :self.num_sum]
    pma = PoolingAttention(self.num_pma, self.num_heads, self.opts, name="pma")(s, s_mask)
    recent = recent_tokens(s[:, self.num_sum:], s_mask[:, self.num_sum:], self.num_recent)
    z = jnp.concatenate([cls.astype(pma.dtype), pma, recent.astype(pma.dtype)], axis=1)
    s_sum = Gating(self.gate_mlp, self.gate_activation, self.opts, name="s_gate")(z)
    return x_sum, s_sum, s


class PersonalizedFFN(nn.Module):
  """`S_p = Norm(S + S W_p)` with `W_p = flatten(X_sum) W` (+ bias: the shared part), d x d."""
  opts: TowerOptions

  @nn.compact
  def __call__(self, x_sum, s):
    batch, _, d = s.shape
    # Scaled so that S W_p keeps S's magnitude at initialization (W_p entries ~ 1/sqrt(d)).
    init = nn.initializers.variance_scaling(1.0 / d, "fan_in", "truncated_normal")
    w = DenseSite(d * d, use_bias=self.opts.bias_at(self, "weight"), config=self.opts.site,
                  kernel_init=init, name="weight")(x_sum.reshape(batch, -1)).reshape(batch, d, d)
    y = ActSite("btd,bde->bte", config=self.opts.site, name="apply")(s, w)
    return self.opts.make_norm("norm")(s.astype(y.dtype) + y)


class SequenceArch(nn.Module):
  """`S' = MHA(PFFN(X_sum, S))`: personalized FFN, then masked self-attention + norm."""
  num_heads: int
  opts: TowerOptions
  use_rotary: bool = True

  @nn.compact
  def __call__(self, x_sum, s, s_mask):
    s = PersonalizedFFN(self.opts, name="pffn")(x_sum, s)
    positions = jnp.arange(s.shape[1]) if self.use_rotary else None
    h = SelfAttention(self.num_heads, self.opts, name="mha")(s, s_mask, positions)
    return self.opts.make_norm("norm")(s.astype(h.dtype) + h)


@dataclasses.dataclass(frozen=True)
class InterFormerArch:
  """The hyper-parameters of the interleaved layers (shared by every layer)."""
  num_layers: int
  num_heads: int
  num_cls: int                     # n_sum: X_sum tokens, also the sequence's CLS tokens
  num_pma: int                     # PMA learnable queries
  num_recent: int                  # most recent events in S_sum
  head_mlp: Sequence[int]
  interaction_modules: Sequence[str] = ("dot", "attention", "dcn", "linear")
  ensemble: str = "sum"
  dot_mlp: Sequence[int] = (64,)
  attention_ffn: int = 64
  dcn_rank: int = 0
  interaction_mlp: Sequence[int] = (64,)
  gate_mlp: Sequence[int] = ()
  gate_activation: str = "sigmoid"
  seq_merge: str = "masknet"
  masknet_hidden: Sequence[int] = (64,)
  use_rotary: bool = True
  mlp_norm: bool = True

  def __post_init__(self):
    for field in ("head_mlp", "interaction_modules", "dot_mlp", "interaction_mlp", "gate_mlp",
                  "masknet_hidden"):
      object.__setattr__(self, field, tuple(getattr(self, field)))
    if self.seq_merge not in SEQ_MERGES:
      raise ValueError(f"unknown seq_merge {self.seq_merge!r}; use one of {SEQ_MERGES}")
    functional.activation(self.gate_activation)
    check_layer_options(self.interaction_modules, self.ensemble)

  @property
  def summary_tokens(self) -> int:
    """Tokens of S_sum: CLS + PMA + recent."""
    return self.num_cls + self.num_pma + self.num_recent


def make_cross(arch: InterFormerArch, opts: TowerOptions, name: str) -> CrossArch:
  return CrossArch(arch.num_cls, arch.num_pma, arch.num_recent, arch.num_heads, arch.gate_mlp,
                   arch.gate_activation, opts, name=name)


class InterFormerLayer(nn.Module):
  """One interleaved layer: cross arch summaries feed the interaction and sequence archs."""
  arch: InterFormerArch
  opts: TowerOptions

  @nn.compact
  def __call__(self, x, s, s_mask, events=None):
    arch = self.arch
    x_sum, s_sum, s = make_cross(arch, self.opts, "cross")(x, s, s_mask, events)
    n, d = x.shape[1:]
    mixed = DhenLayer(n, arch.interaction_modules, self.opts, arch.ensemble, arch.dot_mlp,
                      arch.num_heads, arch.attention_ffn, arch.dcn_rank, arch.mlp_norm,
                      name="interaction")(jnp.concatenate([x.astype(s_sum.dtype), s_sum], axis=1))
    x = MLP(arch.interaction_mlp + (d,), self.opts, norm_hidden=arch.mlp_norm,
            name="interaction_mlp")(mixed)
    s = SequenceArch(arch.num_heads, self.opts, arch.use_rotary, name="sequence")(x_sum, s, s_mask)
    return x, s


class InterFormer(nn.Module):
  """Embeddings + sequence merge -> `num_layers` interleaved layers -> final summaries -> head."""
  features: FeatureSpec
  opts: TowerOptions
  arch: InterFormerArch
  embed_dim: int
  bottom_mlp: Sequence[int]
  dense_tokens: int = 1
  max_vocab: int = 0
  pooling: str = "sum"
  dense_transform: str = "signed_log1p"

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train  # no dropout or batch statistics in this tower
    arch = self.arch
    embedding.check_batch(batch, self.features, model="interformer", need_seq=True)
    if arch.num_recent > self.features.seq_len:
      raise ValueError(f"interformer: num_recent={arch.num_recent} exceeds seq_len="
                       f"{self.features.seq_len}")
    x, _, seq = embedding.embed_inputs(
        batch, features=self.features, embed_dim=self.embed_dim, max_vocab=self.max_vocab,
        pooling=self.pooling, dense_tokens=self.dense_tokens, bottom_mlp=self.bottom_mlp,
        bottom_activate_final=False, norm_hidden=arch.mlp_norm, opts=self.opts,
        dense_transform=self.dense_transform, with_sequences=True)
    seq_mask = embedding.sequence_mask(batch)
    if arch.seq_merge == "masknet":
      events = MaskNetMerge(arch.masknet_hidden, self.opts, name="seq_merge")(seq, seq_mask)
    else:
      events = jnp.sum(seq, axis=1)  # padded events are already zero
    batch_size = x.shape[0]
    s_mask = jnp.concatenate([jnp.ones((batch_size, arch.num_cls), bool), seq_mask], axis=1)
    s = None
    for i in range(arch.num_layers):
      # The first layer builds the sequence: [X_sum | events] (X_sum as the CLS tokens).
      x, s = InterFormerLayer(arch, self.opts, name=f"layer_{i}")(
          x, s, s_mask, events if s is None else None)
    x_sum, s_sum, _ = make_cross(arch, self.opts, "cross_final")(
        x, s, s_mask, events if s is None else None)
    summary = jnp.concatenate([x_sum.reshape(batch_size, -1),
                               s_sum.reshape(batch_size, -1).astype(x_sum.dtype)], axis=-1)
    head = MLP(arch.head_mlp + (1,), self.opts, norm_hidden=arch.mlp_norm, final_bias=True,
               name="head")(summary)
    return head[:, 0].astype(jnp.float32)
