"""The batch contract shared by every data source, model and training loop.

A batch is a dict of numpy or jax arrays:
  dense        float32 [B, num_dense]          dense features (finite)
  sparse_ids   int32   [B, num_sparse, bag]    multi-hot ids per sparse feature, padded
  sparse_mask  bool    [B, num_sparse, bag]    True where an id is real
  seq_ids      int32   [B, num_seq, seq_len]   behaviour sequences (only if num_seq > 0);
                                               num_seq attributes of the same events
  seq_mask     bool    [B, seq_len]            True where an event is real
  label        float32 [B]                     click label in {0, 1}
Padded id slots hold 0 and are masked out; real ids lie in [0, vocab).
Sequences are right-aligned: padding first, the most recent event at position seq_len - 1.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Tuple

import numpy as np

ID_POLICIES = ("error", "hash", "clip")


class BatchError(ValueError):
  """A batch that breaks the contract: the message names the field and the first bad row."""


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  num_dense: int
  vocab_sizes: Tuple[int, ...]
  bag_size: int = 1
  num_seq: int = 0
  seq_len: int = 0
  seq_vocab: int = 0

  def __post_init__(self):
    object.__setattr__(self, "vocab_sizes", tuple(int(v) for v in self.vocab_sizes))
    bad = ([f"num_dense={self.num_dense} (must be >= 0)"] if self.num_dense < 0 else []) + (
        [f"bag_size={self.bag_size} (must be >= 1)"] if self.bag_size < 1 else []) + (
        [f"vocab_sizes[{i}]={v} (must be >= 1)" for i, v in enumerate(self.vocab_sizes) if v < 1])
    if bad:
      raise ValueError(f"invalid FeatureSpec: {'; '.join(bad)}; fix the data spec or preset")
    if self.num_seq and (self.seq_len < 1 or self.seq_vocab < 1):
      raise ValueError(f"FeatureSpec with sequences needs seq_len and seq_vocab >= 1: {self}")

  @property
  def num_sparse(self) -> int:
    return len(self.vocab_sizes)

  def shapes(self, batch_size: int) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    out = {
        "dense": ((batch_size, self.num_dense), np.dtype(np.float32)),
        "sparse_ids": ((batch_size, self.num_sparse, self.bag_size), np.dtype(np.int32)),
        "sparse_mask": ((batch_size, self.num_sparse, self.bag_size), np.dtype(bool)),
        "label": ((batch_size,), np.dtype(np.float32)),
    }
    if self.num_seq:
      out["seq_ids"] = ((batch_size, self.num_seq, self.seq_len), np.dtype(np.int32))
      out["seq_mask"] = ((batch_size, self.seq_len), np.dtype(bool))
    return out

  def to_dict(self):
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping) -> "FeatureSpec":
    return cls(**{k: (tuple(v) if k == "vocab_sizes" else v) for k, v in d.items()})


def _first_bad_row(bad: np.ndarray) -> int:
  flat = bad.reshape(bad.shape[0], -1).any(axis=1)
  return int(np.argmax(flat))


def apply_id_policy(ids: np.ndarray, vocab: np.ndarray, mask: np.ndarray, field: str,
                    policy: str) -> np.ndarray:
  """Out-of-range real ids: 'error' raises naming the row, 'hash' wraps modulo the
  vocabulary, 'clip' clamps into [0, vocab)."""
  if policy not in ID_POLICIES:
    raise ValueError(f"unknown id policy {policy!r}; use one of {ID_POLICIES}")
  bad = mask & ((ids < 0) | (ids >= vocab))
  if not bad.any():
    return ids
  if policy == "error":
    row = _first_bad_row(bad)
    where = np.argwhere(bad[row])[0]
    value = ids[row][tuple(where)]
    raise BatchError(
        f"{field}: id {int(value)} out of range at row {row}, position "
        f"{tuple(int(w) for w in where)}"
        f" (vocabulary sizes {np.unique(vocab).tolist()}); fix the data or pass "
        "id_policy='hash' or 'clip'")
  if policy == "hash":
    return np.where(mask, np.mod(ids, vocab), ids).astype(ids.dtype)
  return np.where(mask, np.clip(ids, 0, vocab - 1), ids).astype(ids.dtype)


def validate_batch(batch: Mapping[str, np.ndarray], spec: FeatureSpec,
                   id_policy: str = "error") -> Dict[str, np.ndarray]:
  """Checks a host batch against `spec`; returns it (ids fixed per `id_policy`).

  Raises BatchError naming the field (and row) on: a missing field, a wrong shape or dtype,
  NaN/Inf dense values or labels, labels outside [0, 1], ids out of range.
  """
  if not isinstance(batch, Mapping):
    raise BatchError(f"a batch must be a dict of arrays, got {type(batch).__name__}")
  batch = {k: np.asarray(v) for k, v in batch.items()}
  if "label" not in batch:
    raise BatchError(f"batch has no 'label' field; fields: {sorted(batch)}")
  size = batch["label"].shape[0] if batch["label"].ndim else 0
  for field, (shape, dtype) in spec.shapes(size).items():
    if field not in batch:
      raise BatchError(f"batch has no {field!r} field (the feature spec needs it); "
                       f"fields: {sorted(batch)}")
    value = batch[field]
    if value.shape != shape:
      raise BatchError(f"{field}: shape {value.shape}, expected {shape} for batch size {size}")
    kind_ok = (np.issubdtype(value.dtype, np.floating) if dtype.kind == "f" else
               np.issubdtype(value.dtype, np.integer) if dtype.kind == "i" else
               value.dtype == np.bool_)
    if not kind_ok:
      raise BatchError(f"{field}: dtype {value.dtype}, expected {dtype}")
    batch[field] = value.astype(dtype, copy=False)
  for field in ("dense", "label"):
    bad = ~np.isfinite(batch[field])
    if bad.any():
      row = _first_bad_row(bad if bad.ndim > 1 else bad[:, None])
      col = f", column {int(np.argmax(bad[row]))}" if bad.ndim > 1 else ""
      raise BatchError(
          f"{field}: non-finite value "
          f"{batch[field][row] if bad.ndim == 1 else batch[field][row][bad[row]][0]} "
          f"at row {row}{col}; clean or impute the input before training")
  label = batch["label"]
  if ((label < 0) | (label > 1)).any():
    row = int(np.argmax((label < 0) | (label > 1)))
    raise BatchError(f"label: value {label[row]} at row {row} is outside [0, 1]")
  vocab = np.asarray(spec.vocab_sizes, np.int64)[None, :, None]
  batch["sparse_ids"] = apply_id_policy(batch["sparse_ids"], vocab, batch["sparse_mask"],
                                        "sparse_ids", id_policy)
  if spec.num_seq:
    seq_mask = np.broadcast_to(batch["seq_mask"][:, None, :], batch["seq_ids"].shape)
    batch["seq_ids"] = apply_id_policy(batch["seq_ids"], np.int64(spec.seq_vocab), seq_mask,
                                       "seq_ids", id_policy)
  return batch
