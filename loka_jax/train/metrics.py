"""Quality metrics of a click model: log loss, normalized entropy (NE) and AUC.

The loss used for training (`bce_with_logits`, jnp) and the host-side evaluation metrics
(numpy, over a whole held-out set) share one numerically stable formula:
  loss(z, y) = max(z, 0) - z * y + log(1 + exp(-|z|)),
which never exponentiates a large positive number, so huge logits give finite losses.
NE = log loss / entropy(base CTR of the evaluated labels): 1.0 is what predicting the base
rate achieves, lower is better.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np

# The quality budget: a change of held-out log loss within 0.02% (relative) is neutral.
# Validation's held-out check, the served-quality gate, the quality suite's floor and the Mods
# ablation's all start from it.
NEUTRAL_REL_LOGLOSS = 2e-4


def bce_with_logits(logits, labels):
  """Element-wise binary cross entropy from logits (jnp, float32)."""
  z = jnp.asarray(logits, jnp.float32)
  y = jnp.asarray(labels, jnp.float32)
  return jnp.maximum(z, 0.0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))


def bce_with_logits_np(logits, labels) -> np.ndarray:
  """Element-wise binary cross entropy from logits (numpy, float64 on the host)."""
  z = np.asarray(logits, np.float64)
  y = np.asarray(labels, np.float64)
  return np.maximum(z, 0.0) - z * y + np.log1p(np.exp(-np.abs(z)))


def calibration(logits, labels) -> float:
  """Mean predicted probability over the observed positive rate (1: calibrated; inf where
  no example is positive)."""
  rate = float(np.mean(np.asarray(labels, np.float64)))
  # tanh form of the sigmoid: no overflow warning for large negative logits
  mean_p = float(np.mean(0.5 * (1.0 + np.tanh(0.5 * np.asarray(logits, np.float64)))))
  return mean_p / rate if rate > 0 else math.inf


def binary_entropy(p: float) -> float:
  """Entropy in nats of a Bernoulli(p); 0 at p in {0, 1}."""
  p = float(p)
  if p <= 0.0 or p >= 1.0:
    return 0.0
  return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def normalized_entropy(logloss: float, base_ctr: float) -> float:
  """NE = logloss / entropy(base_ctr); NaN when the labels are all one class."""
  entropy = binary_entropy(base_ctr)
  return float(logloss) / entropy if entropy > 0.0 else float("nan")


def average_ranks(values: np.ndarray) -> np.ndarray:
  """1-based ranks of `values`, tied values sharing the mean of their ranks."""
  values = np.asarray(values, np.float64).ravel()
  order = np.argsort(values, kind="mergesort")
  sorted_values = values[order]
  # Boundaries of runs of equal values in sorted order.
  starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
  ends = np.r_[starts[1:], sorted_values.size]
  mean_rank = (starts + ends + 1) / 2.0  # mean of the 1-based ranks starts+1 .. ends
  ranks = np.empty(values.size, np.float64)
  ranks[order] = np.repeat(mean_rank, ends - starts)
  return ranks


def auc(scores, labels) -> float:
  """Exact ROC AUC (Mann-Whitney U): P(score_pos > score_neg) + 0.5 P(tie).

  Labels are thresholded at 0.5. NaN when only one class is present or a score is NaN.
  """
  scores = np.asarray(scores, np.float64).ravel()
  positive = np.asarray(labels, np.float64).ravel() >= 0.5
  if scores.shape != positive.shape:
    raise ValueError(f"auc: {scores.size} scores but {positive.size} labels")
  num_pos = int(positive.sum())
  num_neg = positive.size - num_pos
  if num_pos == 0 or num_neg == 0 or np.isnan(scores).any():
    return float("nan")
  rank_sum = average_ranks(scores)[positive].sum()
  u = rank_sum - num_pos * (num_pos + 1) / 2.0
  return float(u / (num_pos * num_neg))


class EvalAccumulator:
  """Streams eval batches: sums of losses and labels, plus every score for the exact AUC."""

  def __init__(self):
    self.loss_sum = 0.0
    self.label_sum = 0.0
    self.count = 0
    self._logits: List[np.ndarray] = []
    self._labels: List[np.ndarray] = []

  def add(self, logits, labels, valid: Optional[int] = None) -> None:
    """Adds one batch; `valid` keeps only the first rows (a padded last batch)."""
    logits = np.asarray(logits, np.float64).ravel()
    labels = np.asarray(labels, np.float64).ravel()
    if logits.shape != labels.shape:
      raise ValueError(f"eval batch: {logits.size} logits but {labels.size} labels")
    if valid is not None:
      logits, labels = logits[:valid], labels[:valid]
    self.loss_sum += float(bce_with_logits_np(logits, labels).sum())
    self.label_sum += float(labels.sum())
    self.count += labels.size
    self._logits.append(logits)
    self._labels.append(labels)

  def scores(self) -> Tuple[np.ndarray, np.ndarray]:
    """(logits, labels) of every example added, in order."""
    return np.concatenate(self._logits), np.concatenate(self._labels)

  def result(self) -> Dict[str, float]:
    """{'logloss', 'ne', 'auc', 'base_ctr', 'num_examples'} over everything added."""
    if self.count == 0:
      raise ValueError("no eval examples were accumulated: the eval set is empty or smaller "
                       "than one eval batch; add held-out examples (num_eval) or lower the "
                       "eval batch size")
    logloss = self.loss_sum / self.count
    base_ctr = self.label_sum / self.count
    return {
        "logloss": logloss,
        "ne": normalized_entropy(logloss, base_ctr),
        "auc": auc(np.concatenate(self._logits), np.concatenate(self._labels)),
        "base_ctr": base_ctr,
        "num_examples": self.count,
    }


def paired_logloss_change(logits, base_logits, labels) -> Tuple[float, float]:
  """(relative change of the mean log loss from `base_logits` to `logits` on the same
  examples, its standard error).

  The error comes from the spread of the per-example differences: how far the change
  measured on this eval set may lie from the change over the data distribution it samples.
  Paired, so what both arms share (the examples, the model) cancels.
  """
  logits, base_logits, labels = (np.asarray(a, np.float64).ravel()
                                 for a in (logits, base_logits, labels))
  if not logits.shape == base_logits.shape == labels.shape or logits.size < 2:
    raise ValueError(f"paired log loss: {logits.size} logits, {base_logits.size} base logits "
                     f"and {labels.size} labels; give two or more of each, one per example")
  base = bce_with_logits_np(base_logits, labels)
  diff = bce_with_logits_np(logits, labels) - base
  scale = base.mean()
  if not scale > 0:
    raise ValueError("paired log loss: the base log loss is 0; no relative change exists")
  return float(diff.mean() / scale), float(diff.std(ddof=1) / np.sqrt(diff.size) / scale)


def json_safe(metrics: Mapping) -> Dict:
  """A copy fit for JSON: non-finite floats become None, and an `error` string names them."""
  out, bad = {}, []
  for key, value in metrics.items():
    if isinstance(value, (float, np.floating)) or (isinstance(value, np.ndarray) and value.ndim == 0
                                                   and value.dtype.kind == "f"):
      value = float(value)
      if not math.isfinite(value):
        bad.append(f"{key}={value}")
        value = None
    elif isinstance(value, np.integer):
      value = int(value)
    elif isinstance(value, np.bool_):
      value = bool(value)
    out[key] = value
  if bad:
    message = "non-finite metric(s): " + ", ".join(bad)
    out["error"] = f"{out['error']}; {message}" if out.get("error") else message
  return out
