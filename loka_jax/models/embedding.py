"""The embedding front end shared by every tower: tables, pooled bags, dense tokens, sequences.

All embedding tables live in one top-level submodule named `embeddings` (the optimizer gives
it Adagrad); lookups are gathers, not GEMM sites. The bottom MLP that turns dense features
into tokens is made of ordinary sites and lives beside it, as `bottom_mlp`.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from loka_jax.data.spec import BatchError, FeatureSpec
from loka_jax.models.layers import MLP, TowerOptions
from loka_jax.precision import BF16, DtypePolicy

EMBEDDINGS = "embeddings"
POOLINGS = ("sum", "mean")


def _shape_of(value) -> Tuple[int, ...]:
  return tuple(int(s) for s in np.shape(value))


def check_batch(batch: Mapping, features: FeatureSpec, *, model: str,
                need_seq: bool = False) -> int:
  """Static check of a batch's fields against `features`; returns the batch size.

  Raises BatchError (a ValueError) naming the field on a missing field, a wrong rank or
  shape, or non-integer ids. Values are not inspected (the data pipeline does that).
  """
  if not isinstance(batch, Mapping):
    raise BatchError(f"{model}: a batch must be a dict of arrays, got {type(batch).__name__}")
  if need_seq and features.num_seq < 1:
    raise BatchError(f"{model} needs behaviour sequences: the feature spec has num_seq=0; "
                     "use a data spec with num_seq >= 1 (seq_ids, seq_mask)")
  fields = ["sparse_ids", "sparse_mask"]
  if features.num_dense:
    fields.insert(0, "dense")
  if need_seq:
    fields += ["seq_ids", "seq_mask"]
  for field in fields:
    if field not in batch:
      raise BatchError(f"{model}: batch has no {field!r} field (the feature spec needs it); "
                       f"fields: {sorted(batch)}")
  size = _shape_of(batch["sparse_ids"])[0] if _shape_of(batch["sparse_ids"]) else 0
  expected = {
      "dense": (size, features.num_dense),
      "sparse_ids": (size, features.num_sparse, features.bag_size),
      "sparse_mask": (size, features.num_sparse, features.bag_size),
      "seq_ids": (size, features.num_seq, features.seq_len),
      "seq_mask": (size, features.seq_len),
  }
  for field in fields:
    shape = _shape_of(batch[field])
    if shape != expected[field]:
      raise BatchError(f"{model}: {field} has shape {shape}, expected {expected[field]} "
                       f"(batch size {size}, feature spec {features})")
  for field in ("sparse_ids", "seq_ids"):
    if field in fields:
      dtype = getattr(batch[field], "dtype", None) or np.asarray(batch[field]).dtype
      if not jnp.issubdtype(dtype, jnp.integer):
        raise BatchError(f"{model}: {field} must hold integer ids, got dtype {dtype}")
  return size


def table_rows(vocab: int, max_vocab: int) -> int:
  """Rows of a feature's table: its vocabulary, capped at `max_vocab` (0 = no cap)."""
  return min(vocab, max_vocab) if max_vocab > 0 else vocab


def row_index(ids, vocab: int, rows: int):
  """The table row of each id: ids past a capped table (vocab > rows) are hashed modulo its
  rows, then clamped into range (padding slots may hold anything; callers mask them)."""
  if vocab > rows:
    ids = jnp.mod(ids, rows)
  return jnp.clip(ids, 0, rows - 1)


def lookup(table, ids, vocab: int):
  """Gathers rows of `table` for `ids` (see `row_index`)."""
  return jnp.take(table, row_index(ids, vocab, table.shape[0]), axis=0)


class Embeddings(nn.Module):
  """Every embedding table of a tower: `sparse_<f>` (one per sparse feature) and, for towers
  that read behaviour sequences, `seq_<a>` (one per sequence attribute); each [rows, d]."""
  features: FeatureSpec
  embed_dim: int
  max_vocab: int = 0
  pooling: str = "sum"
  policy: DtypePolicy = BF16
  with_sequences: bool = False

  def setup(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"unknown pooling {self.pooling!r}; use one of {POOLINGS}")
    init = nn.initializers.normal(stddev=self.embed_dim ** -0.5)
    self.sparse = [
        self.param(f"sparse_{f}", init, (table_rows(v, self.max_vocab), self.embed_dim),
                   self.policy.param_dtype)
        for f, v in enumerate(self.features.vocab_sizes)]
    rows = table_rows(self.features.seq_vocab, self.max_vocab)
    attrs = self.features.num_seq if self.with_sequences else 0
    self.seq = [self.param(f"seq_{a}", init, (rows, self.embed_dim), self.policy.param_dtype)
                for a in range(attrs)]

  def bags(self, sparse_ids, sparse_mask):
    """Pooled multi-hot bags: [B, F, bag] ids and mask -> [B, F, d] in the compute dtype."""
    pooled = []
    for f, vocab in enumerate(self.features.vocab_sizes):
      rows = lookup(self.sparse[f], sparse_ids[:, f], vocab).astype(jnp.float32)  # [B, bag, d]
      mask = sparse_mask[:, f].astype(jnp.float32)[..., None]
      total = jnp.sum(rows * mask, axis=1)
      if self.pooling == "mean":
        total = total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
      pooled.append(total)
    if not pooled:
      return jnp.zeros((sparse_ids.shape[0], 0, self.embed_dim), self.policy.compute_dtype)
    return jnp.stack(pooled, axis=1).astype(self.policy.compute_dtype)

  def sequences(self, seq_ids, seq_mask):
    """Behaviour sequences: [B, A, T] ids, [B, T] mask -> [B, A, T, d], padded events zero."""
    mask = seq_mask.astype(jnp.float32)[:, :, None]
    per_attr = [lookup(self.seq[a], seq_ids[:, a], self.features.seq_vocab).astype(jnp.float32)
                * mask for a in range(self.features.num_seq)]
    return jnp.stack(per_attr, axis=1).astype(self.policy.compute_dtype)

  def __call__(self, batch):
    sparse = self.bags(jnp.asarray(batch["sparse_ids"]), jnp.asarray(batch["sparse_mask"]))
    seq = None
    if self.seq:
      seq = self.sequences(jnp.asarray(batch["seq_ids"]), jnp.asarray(batch["seq_mask"]))
    return sparse, seq


DENSE_TRANSFORMS = ("signed_log1p", "none")


def transform_dense(dense, kind: str):
  """'signed_log1p': sign(x) log(1 + |x|), the usual treatment of count-like dense features
  (heavy tails and rare huge values saturate instead of dominating the tower); 'none': raw."""
  if kind == "signed_log1p":
    return jnp.sign(dense) * jnp.log1p(jnp.abs(dense))
  if kind == "none":
    return dense
  raise ValueError(f"unknown dense_transform {kind!r}; use one of {DENSE_TRANSFORMS}")


def embed_inputs(batch, *, features: FeatureSpec, embed_dim: int, max_vocab: int, pooling: str,
                 dense_tokens: int, bottom_mlp: Sequence[int], bottom_activate_final: bool,
                 norm_hidden: bool, opts: TowerOptions, dense_transform: str = "signed_log1p",
                 with_sequences: bool = False):
  """The front end, called inside a tower's compact `__call__` so that its submodules sit at
  the top level (`embeddings`, `bottom_mlp`).

  Returns (X0 [B, n, d] with the dense tokens first, bottom output [B, dense_tokens*d] or
  None, sequence embeddings [B, A, T, d] when `with_sequences`, else None).
  """
  sparse, seq = Embeddings(features, embed_dim, max_vocab, pooling, opts.policy,
                           with_sequences, name=EMBEDDINGS)(batch)
  if not features.num_dense:
    return sparse, None, seq
  dense = transform_dense(jnp.asarray(batch["dense"], jnp.float32), dense_transform)
  dense = dense.astype(opts.policy.compute_dtype)
  bottom = MLP(tuple(bottom_mlp) + (dense_tokens * embed_dim,), opts,
               activate_final=bottom_activate_final, norm_hidden=norm_hidden,
               name="bottom_mlp")(dense)
  tokens = bottom.reshape(bottom.shape[0], dense_tokens, embed_dim)
  x0 = jnp.concatenate([tokens.astype(sparse.dtype), sparse], axis=1)
  return x0, bottom, seq


def num_input_tokens(features: FeatureSpec, dense_tokens: int) -> int:
  """n of X0: the dense tokens (if any dense feature) plus one per sparse feature."""
  return features.num_sparse + (dense_tokens if features.num_dense else 0)


def sequence_mask(batch) -> Optional[jnp.ndarray]:
  return jnp.asarray(batch["seq_mask"]).astype(bool) if "seq_mask" in batch else None
