"""A toy click model and a toy teacher-labelled data source for the training-loop tests.

Small enough to compile in about a second; same contracts as the real towers and sources:
`model.apply(variables, batch, train=...)` -> float32 logits [B], tables under `embeddings`,
batches a pure function of (seed, step).
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import DenseSite, SiteConfig

TOY_FEATURES = FeatureSpec(num_dense=4, vocab_sizes=(50, 30), bag_size=2)


class ToyEmbeddings(nn.Module):
  features: FeatureSpec
  dim: int

  @nn.compact
  def __call__(self, ids, mask):
    pooled = []
    for f, vocab in enumerate(self.features.vocab_sizes):
      table = self.param(f"table_{f}", nn.initializers.normal(0.1), (vocab, self.dim))
      rows = jnp.take(table, ids[:, f], axis=0) * mask[:, f, :, None]
      pooled.append(rows.sum(axis=1))
    return jnp.concatenate(pooled, axis=-1)


class ToyClickModel(nn.Module):
  """dense ++ pooled embeddings -> DenseSite(hidden) -> relu -> DenseSite(1)."""
  features: FeatureSpec = TOY_FEATURES
  dim: int = 8
  hidden: int = 32
  config: SiteConfig = SiteConfig.for_precision("fp32")

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train
    pooled = ToyEmbeddings(self.features, self.dim, name="embeddings")(
        jnp.asarray(batch["sparse_ids"]), jnp.asarray(batch["sparse_mask"]).astype(jnp.float32))
    x = jnp.concatenate([jnp.asarray(batch["dense"]), pooled], axis=-1)
    h = nn.relu(DenseSite(self.hidden, config=self.config, name="hidden")(x))
    return DenseSite(1, config=self.config, name="out")(h)[:, 0].astype(jnp.float32)


class ToySource:
  """Labels from a fixed random teacher (linear in dense + per-id effects): NE can fall
  well below 1. Batches are a pure function of (seed, step)."""

  def __init__(self, seed: int = 0, num_eval: int = 512, features: FeatureSpec = TOY_FEATURES,
               nan_at_step: Optional[int] = None):
    self.name = "toy"
    self.features = features
    self.seed = seed
    self.nan_at_step = nan_at_step
    teacher = np.random.default_rng(1234)
    self._w = teacher.normal(0, 1.0, features.num_dense)
    self._effects = [teacher.normal(0, 1.5, v) for v in features.vocab_sizes]
    self._eval = self._make(np.random.default_rng([seed, 1, 0]), num_eval)
    p = 1 / (1 + np.exp(-self._eval.pop("_logit")))
    y = self._eval["label"]
    self.oracle_ne = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
                           / _entropy(y.mean()))

  def _make(self, rng, n):
    f = self.features
    dense = rng.normal(size=(n, f.num_dense)).astype(np.float32)
    ids = np.stack([rng.integers(0, v, size=(n, f.bag_size)) for v in f.vocab_sizes], axis=1)
    mask = rng.random((n, f.num_sparse, f.bag_size)) < 0.8
    mask[:, :, 0] = True
    logit = dense @ self._w - 0.5
    for j, effects in enumerate(self._effects):
      logit = logit + (effects[ids[:, j]] * mask[:, j]).sum(axis=1)
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"dense": dense, "sparse_ids": np.where(mask, ids, 0).astype(np.int32),
            "sparse_mask": mask, "label": label, "_logit": logit}

  def train_batch(self, step: int, batch_size: int):
    batch = self._make(np.random.default_rng([self.seed, 0, step]), batch_size)
    del batch["_logit"]
    if self.nan_at_step is not None and step == self.nan_at_step:
      batch["dense"][3, 1] = np.nan  # a fault the loop must catch (no validation here)
    return batch

  def eval_batches(self, batch_size: int):
    n = self.num_eval_examples() // batch_size * batch_size
    for start in range(0, n, batch_size):
      yield {k: v[start:start + batch_size] for k, v in self._eval.items()}

  def num_eval_examples(self) -> int:
    return len(self._eval["label"])


def _entropy(p):
  return -(p * np.log(p) + (1 - p) * np.log(1 - p))
