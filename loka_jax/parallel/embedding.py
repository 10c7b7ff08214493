"""Row-sharded embedding tables and their lookup under `shard_map`.

Each table `[rows, d]` is padded with zero rows to a multiple of M (step.TableLayout) and
split into `model`-axis shards of `padded / M` consecutive rows. The choice of exchange
(documented in docs/PARALLEL.md): a masked local gather + reduce-scatter.

  ids of the data shard [B_d, F, bag] (replicated over `model`, so no ids travel)
    -> each model shard gathers the rows it owns (others contribute 0) and pools them:
       partial bags [B_d, F, d]
    -> reduce-scatter over `model`: device j keeps the full bags of its B_d / M examples.
  backward: the pooled gradients are all-gathered over `model` (the transpose of the
  reduce-scatter) and scatter-added into each shard's own rows.

Pooling happens before any communication, so the bytes moved do not grow with the bag size,
and every shape is static (no id bucketing, no capacity factor, nothing dropped). Routing
ids to their owner with an all-to-all would move fewer bytes only when the ids of one bag
are few and the width d is large, and needs variable-size buckets. The exchange is a
collective with a codec (collectives.py): fp32, bf16 or FP8 with row scales, both ways.

The towers' `Embeddings` module is swapped in place with `nn.intercept_methods`
(`sharded_embeddings`), so models need no parallel-specific code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from loka_jax.data.spec import FeatureSpec
from loka_jax.models.embedding import Embeddings, row_index, table_rows
from loka_jax.parallel import collectives
from loka_jax.parallel.mesh import MODEL, axis_size

EXCHANGE_SCOPE = "loka_embedding_exchange"  # named scope of the exchange's collectives (HLO)


def table_shapes(features: FeatureSpec, embed_dim: int, max_vocab: int,
                 with_sequences: bool) -> Dict[str, tuple]:
  """{table name: (rows, d)} as `Embeddings` creates them."""
  shapes = {f"sparse_{f}": (table_rows(v, max_vocab), embed_dim)
            for f, v in enumerate(features.vocab_sizes)}
  if with_sequences:
    for a in range(features.num_seq):
      shapes[f"seq_{a}"] = (table_rows(features.seq_vocab, max_vocab), embed_dim)
  return shapes


def local_rows(shard: jax.Array, ids: jax.Array, vocab: int, rows: int,
               axis: str = MODEL) -> jax.Array:
  """fp32 rows for `ids` from this device's shard; ids owned by another shard give 0.

  Ids map to table rows through `models.embedding.row_index` with the table's own `rows`
  (not its padded length), as in the single-device lookup: both give the same rows, and the
  padding rows at the end of the last shards are never read.
  """
  local = shard.shape[0]
  ids = row_index(ids, vocab, rows) - lax.axis_index(axis) * local
  mine = (ids >= 0) & (ids < local)
  gathered = jnp.take(shard, jnp.clip(ids, 0, local - 1), axis=0).astype(jnp.float32)
  return gathered * mine[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def exchange(partial: jax.Array, axis: str, codec: collectives.Codec) -> jax.Array:
  """[B_d, ...] partial sums on each model shard -> [B_d / M, ...] full sums (fp32)."""
  m = axis_size(axis)
  if m == 1:  # one shard holds every row: nothing to exchange, nothing to quantize
    return partial.astype(jnp.float32)
  with jax.named_scope(EXCHANGE_SCOPE):
    chunks = partial.reshape((m, partial.shape[0] // m) + partial.shape[1:])
    return collectives.reduce_scatter(chunks, axis, codec)


def _exchange_fwd(partial, axis, codec):
  return exchange(partial, axis, codec), partial.shape[0]


def _exchange_bwd(axis, codec, batch, g):
  # The transpose of a reduce-scatter: every shard needs every example's gradient, through
  # the same codec as the forward exchange.
  if axis_size(axis) == 1:
    return (g.astype(jnp.float32),)
  with jax.named_scope(EXCHANGE_SCOPE):
    full = collectives.all_gather(g, axis, codec)
    return (full.reshape((batch,) + g.shape[1:]),)


exchange.defvjp(_exchange_fwd, _exchange_bwd)


@dataclasses.dataclass(frozen=True)
class ShardedLookup:
  """The sharded `Embeddings.__call__`: tables are local row shards, ids cover the data shard."""
  tables: Mapping[str, jax.Array]
  ids: Mapping[str, jax.Array]    # sparse_ids, sparse_mask (+ seq_ids, seq_mask) of [B_d, ...]
  codec: collectives.Codec
  axis: str = MODEL

  def bags(self, module: Embeddings) -> jax.Array:
    """[B_d / M, F, d] pooled bags in the compute dtype."""
    ids, mask = self.ids["sparse_ids"], self.ids["sparse_mask"]
    pooled = []
    for f, vocab in enumerate(module.features.vocab_sizes):
      rows = local_rows(self.tables[f"sparse_{f}"], ids[:, f], vocab,
                        table_rows(vocab, module.max_vocab), self.axis)
      m = mask[:, f].astype(jnp.float32)[..., None]
      total = jnp.sum(rows * m, axis=1)
      if module.pooling == "mean":  # linear, so dividing the partial sums is exact
        total = total / jnp.maximum(jnp.sum(m, axis=1), 1.0)
      pooled.append(total)
    partial = jnp.stack(pooled, axis=1)
    return exchange(partial, self.axis, self.codec).astype(module.policy.compute_dtype)

  def sequences(self, module: Embeddings) -> jax.Array:
    """[B_d / M, A, T, d] behaviour-sequence embeddings, padded events zero."""
    seq_ids, mask = self.ids["seq_ids"], self.ids["seq_mask"].astype(jnp.float32)[:, :, None]
    vocab = module.features.seq_vocab
    rows = table_rows(vocab, module.max_vocab)
    per_attr = [local_rows(self.tables[f"seq_{a}"], seq_ids[:, a], vocab, rows, self.axis)
                * mask for a in range(module.features.num_seq)]
    partial = jnp.stack(per_attr, axis=1)
    return exchange(partial, self.axis, self.codec).astype(module.policy.compute_dtype)

  def __call__(self, module: Embeddings):
    if not module.features.vocab_sizes:
      raise ValueError("sharded embeddings need at least one sparse feature")
    if module.pooling not in ("sum", "mean"):
      raise ValueError(f"unknown pooling {module.pooling!r}")
    seq = self.sequences(module) if module.with_sequences and module.features.num_seq else None
    return self.bags(module), seq


@contextlib.contextmanager
def sharded_embeddings(lookup: ShardedLookup):
  """Within this context every `Embeddings` module looks its ids up through `lookup`.

  Its `setup` is skipped too: the table parameters it would declare have their full shapes,
  while under `shard_map` the tables are row shards (`lookup.tables`).
  """
  def intercept(next_fun, args, kwargs, context):
    if not isinstance(context.module, Embeddings):
      return next_fun(*args, **kwargs)
    if context.method_name == "setup":
      return None
    if context.method_name == "__call__":
      return lookup(context.module)
    raise NotImplementedError(
        f"Embeddings.{context.method_name} has no sharded form; call the module itself")

  with nn.intercept_methods(intercept):
    yield
