"""Synthetic recommendation data: Zipf ids, multi-hot bags, heavy-tailed dense features with
outlier channels, behaviour sequences, and labels drawn from a hidden teacher network.

Every random draw comes from `np.random.default_rng` keyed by a tuple, so a training batch is a
pure function of (spec.task_seed, seed, step, batch_size), and the teacher, its calibration and
the held-out set depend on spec.task_seed alone (every training seed sees the same task).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Dict, Iterator, Mapping, Optional, Tuple, Union

import numpy as np

from loka_jax.data import sources
from loka_jax.data.spec import FeatureSpec, validate_batch

DENSE_FAMILIES = ("normal", "lognormal", "student_t")
TEACHER_GROUPS = ("dense", "sparse", "seq")
DEFAULT_FEATURES = FeatureSpec(num_dense=13, vocab_sizes=(1000,) * 8, bag_size=4, num_seq=2,
                               seq_len=16, seq_vocab=1000)

# Keys of the independent random streams (the second element of every rng key).
_TEACHER, _CALIBRATION, _TRAIN, _EVAL = 1, 2, 3, 4
_EVAL_CHUNK = 4096          # the eval set is drawn in chunks of this size, whatever the batch size
# Teacher embedding rows: ids beyond share rows modulo this, which keeps the table cache-sized
# (the labels stay a fixed random function of the ids, only a hashed one).
_MAX_TEACHER_ROWS = 1 << 16


def _default_dense_mix():
  return {"normal": 0.4, "lognormal": 0.3, "student_t": 0.3}


def _default_teacher_weights():
  return {"dense": 1.0, "sparse": 1.0, "seq": 0.5}


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
  """Distribution knobs of the synthetic source (JSON keys = field names; docs/DATA.md)."""
  task_seed: int = 0                      # teacher, calibration and eval set
  num_eval: int = 16384                   # held-out examples
  zipf_exponent: Union[float, Tuple[float, ...]] = 1.05   # global, or one per sparse table
  seq_zipf_exponent: float = 1.05         # behaviour-sequence item ids
  bag_length_probs: Optional[Tuple[float, ...]] = None    # weights of lengths 1..bag_size
  bag_length_decay: float = 0.6           # if no probs: P(length l) ~ decay ** (l - 1)
  multi_hot_fraction: float = 0.5         # leading fraction of tables that are multi-hot
  empty_bag_prob: float = 0.0             # probability that a bag is empty (missing feature)
  dense_mix: Dict[str, float] = dataclasses.field(default_factory=_default_dense_mix)
  dense_families: Optional[Tuple[str, ...]] = None        # one family per dense feature
  lognormal_sigma: float = 1.0
  student_t_df: float = 3.0
  dense_log10_scale_std: float = 0.5      # per-feature scale 10 ** N(0, std)
  num_outlier_features: int = 2           # channels with rare huge values
  outlier_prob: float = 1e-3
  outlier_scale: float = 1e4
  seq_min_length: int = 1                 # sequence lengths uniform in [min, seq_len]
  seq_category_vocab: int = 64            # values of sequence attributes 1.. (item categories)
  base_ctr: float = 0.25
  target_oracle_ne: float = 0.8
  teacher_logit_scale: Optional[float] = None  # fixed scale instead of matching target_oracle_ne
  teacher_hidden: int = 32
  teacher_embed_dim: int = 4
  teacher_weights: Dict[str, float] = dataclasses.field(default_factory=_default_teacher_weights)
  calibration_examples: int = 16384
  features: Optional[Dict[str, object]] = None  # a FeatureSpec dict overriding the preset's

  def __post_init__(self):
    def bad(key, why):
      raise ValueError(f"synthetic spec: {key}={getattr(self, key)!r} {why}")
    if not isinstance(self.task_seed, int) or self.task_seed < 0:
      bad("task_seed", "must be an integer >= 0")
    if self.num_eval < 1:
      bad("num_eval", "must be >= 1")
    exps = self.zipf_exponent if isinstance(self.zipf_exponent, tuple) else (self.zipf_exponent,)
    if any(not (0.0 <= float(e) <= 5.0) for e in exps) or not (0 <= self.seq_zipf_exponent <= 5):
      bad("zipf_exponent", "(and seq_zipf_exponent) must lie in [0, 5]")
    if self.bag_length_probs is not None and (
        any(p < 0 for p in self.bag_length_probs) or sum(self.bag_length_probs) <= 0):
      bad("bag_length_probs", "must be non-negative weights with a positive sum")
    if not 0 < self.bag_length_decay <= 1:
      bad("bag_length_decay", "must lie in (0, 1]")
    for key in ("multi_hot_fraction", "outlier_prob"):
      if not 0 <= getattr(self, key) <= 1:
        bad(key, "must lie in [0, 1]")
    if not 0 <= self.empty_bag_prob < 1:
      bad("empty_bag_prob", "must lie in [0, 1)")
    unknown = sorted(set(self.dense_mix) - set(DENSE_FAMILIES))
    if unknown or any(v < 0 for v in self.dense_mix.values()) or sum(self.dense_mix.values()) <= 0:
      bad("dense_mix", f"must map families {DENSE_FAMILIES} to non-negative weights "
          f"(unknown: {unknown})")
    if self.dense_families is not None:
      unknown = sorted(set(self.dense_families) - set(DENSE_FAMILIES))
      if unknown:
        bad("dense_families", f"names unknown families {unknown}; use {DENSE_FAMILIES}")
    if self.lognormal_sigma <= 0 or self.student_t_df <= 0 or self.dense_log10_scale_std < 0:
      bad("lognormal_sigma", "(and student_t_df) must be > 0, dense_log10_scale_std >= 0")
    if self.num_outlier_features < 0 or self.outlier_scale <= 0:
      bad("num_outlier_features", "must be >= 0 and outlier_scale > 0")
    if self.seq_min_length < 0 or self.seq_category_vocab < 1:
      bad("seq_min_length", "must be >= 0 and seq_category_vocab >= 1")
    if not 0 < self.base_ctr < 1:
      bad("base_ctr", "must lie in (0, 1)")
    if not 0 < self.target_oracle_ne < 1:
      bad("target_oracle_ne", "must lie in (0, 1)")
    if self.teacher_logit_scale is not None and self.teacher_logit_scale < 0:
      bad("teacher_logit_scale", "must be >= 0")
    if self.teacher_hidden < 1 or self.teacher_embed_dim < 1 or self.calibration_examples < 256:
      bad("teacher_hidden", "and teacher_embed_dim must be >= 1, calibration_examples >= 256")
    unknown = sorted(set(self.teacher_weights) - set(TEACHER_GROUPS))
    if unknown or any(v < 0 for v in self.teacher_weights.values()):
      bad("teacher_weights", f"must map {TEACHER_GROUPS} to weights >= 0 (unknown: {unknown})")
    if self.features is not None:
      FeatureSpec.from_dict(self.features)  # fails early, naming the bad FeatureSpec

  def to_dict(self) -> Dict[str, object]:
    return sources.config_to_dict(self)

  def to_json(self, indent: Optional[int] = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

  @classmethod
  def from_dict(cls, values: Mapping[str, object]) -> "SyntheticSpec":
    return sources.config_from_dict(cls, values, "synthetic spec")

  @classmethod
  def from_json(cls, text: str) -> "SyntheticSpec":
    try:
      values = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"synthetic spec is not valid JSON: {e}") from e
    if not isinstance(values, dict):
      raise ValueError(f"synthetic spec must be a JSON object, got {type(values).__name__}")
    return cls.from_dict(values)

  @classmethod
  def load(cls, spec) -> "SyntheticSpec":
    """None, a SyntheticSpec, a dict, a JSON string or the path of a JSON file."""
    return sources.load_config(cls, spec, "synthetic spec")


def binary_entropy(p: np.ndarray) -> np.ndarray:
  """Entropy in nats of Bernoulli(p)."""
  p = np.clip(np.asarray(p, np.float64), 1e-12, 1 - 1e-12)
  return -(p * np.log(p) + (1 - p) * np.log1p(-p))


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
  """Log loss of `probs` on `labels` divided by the entropy of the labels' base rate."""
  labels = np.asarray(labels, np.float64)
  p = np.clip(np.asarray(probs, np.float64), 1e-12, 1 - 1e-12)
  logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p))
  return float(logloss / binary_entropy(labels.mean()))


def _rowwise_matmul(a: np.ndarray, b: np.ndarray, block: int = 64) -> np.ndarray:
  """a @ b in row blocks small enough that OpenBLAS stays on one thread: host data generation
  runs beside training, and threaded BLAS on these small products is slower and jittery."""
  return np.concatenate([a[i:i + block] @ b for i in range(0, max(a.shape[0], 1), block)])


def _sigmoid(x):
  return 0.5 * (1.0 + np.tanh(0.5 * x))


def zipf_probabilities(vocab: int, exponent: float) -> np.ndarray:
  """P(rank r) ~ (r + 1) ** -exponent over r in [0, vocab), rank 0 the most frequent."""
  weights = np.arange(1, vocab + 1, dtype=np.float64) ** -float(exponent)
  return weights / weights.sum()


def _alias_table(probs: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Walker's alias table: draw cell k uniformly, keep k with prob[k], else take alias[k]."""
  size = probs.size
  prob = probs * size
  alias = np.arange(size, dtype=np.int64)
  small = list(np.flatnonzero(prob < 1.0))
  large = list(np.flatnonzero(prob >= 1.0))
  while small and large:
    s, l = small.pop(), large.pop()
    alias[s] = l
    prob[l] -= 1.0 - prob[s]
    (small if prob[l] < 1.0 else large).append(l)
  prob[small + large] = 1.0  # leftovers are 1 up to rounding
  return prob, alias


def zipf_rank_of_id(vocab: int, task_seed: int) -> np.ndarray:
  """The fixed random frequency rank of every id (hot ids scattered, as hashed ids are)."""
  return np.random.default_rng([task_seed, _TEACHER, 2, vocab]).permutation(vocab)


@functools.lru_cache(maxsize=32)
def zipf_id_sampler(vocab: int, exponent: float, task_seed: int) -> Tuple[np.ndarray, np.ndarray]:
  """Alias table drawing ids with P(id) ~ (rank_of_id + 1) ** -exponent; tables with the same
  (vocab, exponent, task_seed) share it."""
  probs = zipf_probabilities(vocab, exponent)[zipf_rank_of_id(vocab, task_seed)]
  prob, alias = _alias_table(probs)
  # float32 / int32 halve the cache footprint of the two random gathers per draw.
  prob, alias = prob.astype(np.float32), alias.astype(np.int32)
  prob.setflags(write=False)
  alias.setflags(write=False)
  return prob, alias


def sample_zipf_ids(rng: np.random.Generator, sampler: Tuple[np.ndarray, np.ndarray],
                    shape) -> np.ndarray:
  """int32 ids drawn from an alias table: O(1) per draw."""
  prob, alias = sampler
  vocab = prob.size
  u = rng.random(shape) * vocab  # float64: the fraction keeps >= 29 bits for vocab < 2**24
  cell = np.minimum(u.astype(np.int32), vocab - 1)
  return np.where(u - cell < prob[cell], cell, alias[cell])


def _family_counts(mix: Mapping[str, float], num: int) -> Dict[str, int]:
  """Splits `num` features over the families by largest remainder, in DENSE_FAMILIES order."""
  total = sum(mix.values())
  quotas = {f: num * mix.get(f, 0.0) / total for f in DENSE_FAMILIES}
  counts = {f: int(math.floor(q)) for f, q in quotas.items()}
  order = sorted(DENSE_FAMILIES, key=lambda f: -(quotas[f] - counts[f]))
  for f in order[:num - sum(counts.values())]:
    counts[f] += 1
  return counts


class _Teacher:
  """The hidden labelling network: fixed random weights, then calibrated bias and logit scale."""

  def __init__(self, features: FeatureSpec, spec: SyntheticSpec, dense_scale: np.ndarray):
    rng = np.random.default_rng([spec.task_seed, _TEACHER])
    dim = spec.teacher_embed_dim
    vocab_total = sum(features.vocab_sizes) + (features.seq_vocab if features.num_seq else 0)
    # A power of two, so `& (rows - 1)` maps ids to rows (exactly when the vocabularies fit).
    self.rows = min(1 << max(vocab_total - 1, 1).bit_length(), _MAX_TEACHER_ROWS)
    table = rng.standard_normal((self.rows, dim)).astype(np.float32)
    # Stored transposed (dim x rows), plus a zero last row that padded slots point at.
    self.table_t = np.ascontiguousarray(np.concatenate([table, np.zeros((1, dim), np.float32)]).T)
    self.offsets = (np.cumsum((0,) + features.vocab_sizes)[:-1] % self.rows).astype(np.int32)
    self.seq_offset = np.int32(sum(features.vocab_sizes) % self.rows)
    self.target = rng.standard_normal(dim).astype(np.float32)  # used when there is no table 0
    width = features.num_dense + features.num_sparse * dim
    self.w1 = (rng.standard_normal((max(width, 1), spec.teacher_hidden)) /
               math.sqrt(max(width, 1))).astype(np.float32)[:width]
    self.b1 = (0.5 * rng.standard_normal(spec.teacher_hidden)).astype(np.float32)
    self.w2 = (rng.standard_normal(spec.teacher_hidden) /
               math.sqrt(spec.teacher_hidden)).astype(np.float32)
    self.skip = (rng.standard_normal(width) / math.sqrt(max(width, 1))).astype(np.float32)
    self.features = features
    self.weights = {g: float(spec.teacher_weights.get(g, 0.0)) for g in TEACHER_GROUPS}
    self.dense_scale = dense_scale.astype(np.float32)
    # Calibrated below; identity values let `_components` run during calibration.
    self.dense_mean = np.zeros(features.num_dense, np.float32)
    self.dense_std = np.ones(features.num_dense, np.float32)
    self.moments = {"mlp": (0.0, 1.0), "seq": (0.0, 1.0), "z": (0.0, 1.0)}
    self.bias, self.scale = 0.0, 1.0

  def _pooled(self, ids, mask, offsets):
    """Mean teacher embedding over the real ids of each bag (zero for an empty bag)."""
    rows = np.where(mask, (ids + offsets) & np.int32(self.rows - 1), np.int32(self.rows))
    # Slots first, one gather per component: numpy sums a leading axis far faster than a short
    # trailing one, and each gather reads one cache-sized row of the transposed table.
    rows = np.ascontiguousarray(np.moveaxis(rows, -1, 0)).astype(np.intp, copy=False)
    out = np.empty(ids.shape[:-1] + (self.table_t.shape[0],), np.float32)
    for c, column in enumerate(self.table_t):
      out[..., c] = column[rows].sum(axis=0)
    count = np.maximum(mask.sum(axis=-1, dtype=np.int32), 1).astype(np.float32)
    return out / count[..., None]

  def _dense_input(self, dense):
    x = dense / self.dense_scale
    return np.sign(x) * np.log1p(np.abs(x))  # outliers saturate instead of dominating labels

  def _components(self, batch) -> Tuple[np.ndarray, np.ndarray]:
    """The raw MLP and sequence terms of the teacher logit, one value per example."""
    f, n = self.features, batch["label"].shape[0]
    parts = []
    if f.num_dense:
      dense = (self._dense_input(batch["dense"]) - self.dense_mean) / self.dense_std
      parts.append(self.weights["dense"] * dense)
    pooled = None
    if f.num_sparse:
      pooled = self._pooled(batch["sparse_ids"], batch["sparse_mask"], self.offsets[None, :, None])
      parts.append(self.weights["sparse"] * pooled.reshape(n, -1))
    if parts:
      u = np.concatenate(parts, axis=1).astype(np.float32)
      mlp = _rowwise_matmul(np.tanh(_rowwise_matmul(u, self.w1) + self.b1), self.w2)
      mlp = mlp + _rowwise_matmul(u, self.skip)
    else:
      mlp = np.zeros(n, np.float32)
    if f.num_seq:
      history = self._pooled(batch["seq_ids"][:, 0], batch["seq_mask"], self.seq_offset)
      target = pooled[:, 0] if pooled is not None else self.target
      seq = (history * target).sum(axis=-1)
    else:
      seq = np.zeros(n, np.float32)
    return mlp.astype(np.float64), seq.astype(np.float64)

  def logit(self, batch) -> np.ndarray:
    mlp, seq = self._components(batch)
    z = (mlp - self.moments["mlp"][0]) / self.moments["mlp"][1]
    z = z + self.weights["seq"] * (seq - self.moments["seq"][0]) / self.moments["seq"][1]
    z = (z - self.moments["z"][0]) / self.moments["z"][1]
    return self.bias + self.scale * z

  def calibrate(self, batch, spec: SyntheticSpec):
    """Standardizes each term on a calibration draw, then fits bias (base CTR) and scale (NE)."""
    if self.features.num_dense:
      x = self._dense_input(batch["dense"])
      self.dense_mean = x.mean(axis=0).astype(np.float32)
      self.dense_std = np.maximum(x.std(axis=0), 1e-6).astype(np.float32)
    mlp, seq = self._components(batch)

    def moments(v):
      std = float(v.std())
      return float(v.mean()), (std if std > 1e-9 else 1.0)
    self.moments["mlp"], self.moments["seq"] = moments(mlp), moments(seq)
    self.bias, self.scale = 0.0, 1.0
    z = self.logit(batch)  # with bias 0, scale 1 and identity z moments: the raw direction
    if float(z.std()) < 1e-6:
      raise ValueError("synthetic teacher has no signal: the feature spec has no dense, sparse or "
                       "sequence inputs, or all teacher_weights are 0")
    self.moments["z"] = moments(z)
    z = (z - self.moments["z"][0]) / self.moments["z"][1]
    if spec.teacher_logit_scale is not None:
      self.scale = float(spec.teacher_logit_scale)
      self.bias = _bias_for_ctr(z, self.scale, spec.base_ctr)
      return
    self.scale, self.bias = _scale_for_ne(z, spec.base_ctr, spec.target_oracle_ne)


def _bias_for_ctr(z: np.ndarray, scale: float, ctr: float) -> float:
  """The bias b with mean(sigmoid(b + scale z)) = ctr: safeguarded Newton (the mean rises
  with b, so a bracket keeps every step honest)."""
  lo, hi = -40.0, 40.0
  bias = math.log(ctr / (1 - ctr))
  for _ in range(100):
    p = _sigmoid(bias + scale * z)
    gap = float(p.mean()) - ctr
    if abs(gap) < 1e-9:
      break
    if gap < 0:
      lo = bias
    else:
      hi = bias
    slope = float((p * (1 - p)).mean())
    step = bias - gap / slope if slope > 0 else lo - 1.0
    bias = step if lo < step < hi else 0.5 * (lo + hi)
  return bias


def _scale_for_ne(z: np.ndarray, ctr: float, target_ne: float) -> Tuple[float, float]:
  """Scale and bias whose expected NE (mean entropy / entropy of ctr) equals target_ne."""
  base = float(binary_entropy(ctr))

  def expected_ne(scale):
    bias = _bias_for_ctr(z, scale, ctr)
    return float(binary_entropy(_sigmoid(bias + scale * z)).mean()) / base, bias

  lo, hi = 0.0, 30.0
  if expected_ne(hi)[0] > target_ne:
    raise ValueError(f"synthetic teacher cannot reach target_oracle_ne={target_ne} "
                     f"(best {expected_ne(hi)[0]:.3f}); raise it or set teacher_logit_scale")
  for _ in range(30):  # the scale to ~3e-8: far below the eval set's sampling noise
    mid = 0.5 * (lo + hi)
    if expected_ne(mid)[0] > target_ne:
      lo = mid
    else:
      hi = mid
  scale = 0.5 * (lo + hi)
  return scale, expected_ne(scale)[1]


class SyntheticSource:
  """Synthetic CTR data following `features`, distributed as `spec` says (see SyntheticSpec)."""

  name = "synthetic"

  def __init__(self, features: Optional[FeatureSpec] = None, spec=None, seed: int = 0,
               num_eval: Optional[int] = None, id_policy: str = "error"):
    self.spec = SyntheticSpec.load(spec)
    if self.spec.features is not None:
      features = FeatureSpec.from_dict(self.spec.features)
    self.features = features if features is not None else DEFAULT_FEATURES
    if not isinstance(seed, (int, np.integer)) or seed < 0:
      raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    self.seed = int(seed)
    self.id_policy = id_policy
    self._num_eval = int(num_eval if num_eval is not None else self.spec.num_eval)
    if self._num_eval < 1:
      raise ValueError(f"num_eval must be >= 1, got {self._num_eval}")
    f, s = self.features, self.spec
    rng = np.random.default_rng([s.task_seed, _TEACHER, 1])
    self.dense_families = self._assign_families()
    k = min(s.num_outlier_features, f.num_dense)
    outliers = np.sort(rng.choice(f.num_dense, k, replace=False))
    self.outlier_features = tuple(int(i) for i in outliers)
    self.dense_scale = 10.0 ** (s.dense_log10_scale_std * rng.standard_normal(f.num_dense))
    self.zipf_exponents = self._table_exponents()
    self.bag_length_probs = self._bag_length_probs()
    self.num_multi_hot = (int(math.ceil(s.multi_hot_fraction * f.num_sparse))
                          if f.bag_size > 1 else 0)
    self._seq_sampler = (zipf_id_sampler(f.seq_vocab, float(s.seq_zipf_exponent), s.task_seed)
                         if f.num_seq else None)
    self._seq_categories = [
        rng.integers(0, min(s.seq_category_vocab, f.seq_vocab), f.seq_vocab).astype(np.int32)
        for _ in range(max(f.num_seq - 1, 0))]
    if f.num_seq and s.seq_min_length > f.seq_len:
      raise ValueError(f"synthetic spec: seq_min_length={s.seq_min_length} exceeds "
                       f"seq_len={f.seq_len} of the feature spec")
    self._teacher = _Teacher(f, s, self.dense_scale)
    calib_rng = np.random.default_rng([s.task_seed, _CALIBRATION])
    self._teacher.calibrate(self._features_only(calib_rng, s.calibration_examples), s)
    self._eval: Optional[Dict[str, np.ndarray]] = None
    self._eval_probs: Optional[np.ndarray] = None

  # ---- layout of the fixed task --------------------------------------------------------------
  def _assign_families(self) -> Tuple[str, ...]:
    f, s = self.features, self.spec
    if s.dense_families is not None:
      if len(s.dense_families) != f.num_dense:
        raise ValueError(f"synthetic spec: dense_families has {len(s.dense_families)} entries, "
                         f"the feature spec has num_dense={f.num_dense}")
      return tuple(s.dense_families)
    counts = _family_counts(s.dense_mix, f.num_dense)
    return tuple(fam for fam in DENSE_FAMILIES for _ in range(counts[fam]))

  def _table_exponents(self) -> Tuple[float, ...]:
    exps, n = self.spec.zipf_exponent, self.features.num_sparse
    if isinstance(exps, tuple):
      if len(exps) != n:
        raise ValueError(f"synthetic spec: zipf_exponent lists {len(exps)} values, the feature "
                         f"spec has {n} sparse tables")
      return tuple(float(e) for e in exps)
    return (float(exps),) * n

  def _bag_length_probs(self) -> np.ndarray:
    bag, s = self.features.bag_size, self.spec
    if s.bag_length_probs is not None:
      w = np.zeros(bag)
      given = np.asarray(s.bag_length_probs[:bag], np.float64)
      w[:len(given)] = given
      if w.sum() <= 0:
        raise ValueError(f"synthetic spec: bag_length_probs {s.bag_length_probs} give no weight "
                         f"to lengths 1..{bag} (bag_size={bag})")
    else:
      w = s.bag_length_decay ** np.arange(bag, dtype=np.float64)
    return w / w.sum()

  # ---- sampling -------------------------------------------------------------------------------
  def _dense(self, rng, n):
    f, s = self.features, self.spec
    out = np.empty((n, f.num_dense), np.float64)
    fams = np.array(self.dense_families)
    for fam in DENSE_FAMILIES:
      cols = np.flatnonzero(fams == fam)
      if not cols.size:
        continue
      shape = (n, cols.size)
      if fam == "normal":
        out[:, cols] = rng.standard_normal(shape)
      elif fam == "lognormal":
        out[:, cols] = np.exp(s.lognormal_sigma * rng.standard_normal(shape))
      else:
        out[:, cols] = rng.standard_t(s.student_t_df, shape)
    if self.outlier_features:
      cols = np.array(self.outlier_features)
      hit = rng.random((n, cols.size)) < s.outlier_prob
      base = out[:, cols]
      huge = np.where(base < 0, -1.0, 1.0) * s.outlier_scale * (1.0 + np.abs(base))
      out[:, cols] = np.where(hit, huge, base)
    return (out * self.dense_scale).astype(np.float32)

  def _sparse(self, rng, n):
    f, s = self.features, self.spec
    bag, t = f.bag_size, f.num_sparse
    lengths = np.ones((n, t), np.int64)
    if self.num_multi_hot:
      cdf = np.cumsum(self.bag_length_probs)
      u = rng.random((n, self.num_multi_hot))
      drawn = np.minimum(np.searchsorted(cdf, u, side="right"), bag - 1) + 1
      lengths[:, :self.num_multi_hot] = drawn
    if s.empty_bag_prob > 0:
      lengths = np.where(rng.random((n, t)) < s.empty_bag_prob, 0, lengths)
    mask = np.arange(bag)[None, None, :] < lengths[..., None]
    ids = np.zeros((n, t, bag), np.int32)
    groups: Dict[Tuple[int, float, bool], list] = {}
    for table, (vocab, exponent) in enumerate(zip(f.vocab_sizes, self.zipf_exponents)):
      groups.setdefault((vocab, exponent, table < self.num_multi_hot), []).append(table)
    for (vocab, exponent, multi_hot), tables in groups.items():
      width = bag if multi_hot else 1  # single-hot tables only fill slot 0
      sampler = zipf_id_sampler(vocab, exponent, s.task_seed)
      ids[:, np.array(tables), :width] = sample_zipf_ids(rng, sampler, (n, len(tables), width))
    return np.where(mask, ids, 0), mask

  def _sequence(self, rng, n):
    f, s = self.features, self.spec
    lengths = rng.integers(s.seq_min_length, f.seq_len + 1, n)
    # Right-aligned: the most recent event sits at position seq_len - 1, padding comes first.
    mask = np.arange(f.seq_len)[None, :] >= (f.seq_len - lengths)[:, None]
    items = np.where(mask, sample_zipf_ids(rng, self._seq_sampler, (n, f.seq_len)), 0)
    seq = np.empty((n, f.num_seq, f.seq_len), np.int32)
    seq[:, 0] = items
    for j, categories in enumerate(self._seq_categories, start=1):
      seq[:, j] = np.where(mask, categories[items], 0)
    return seq, mask

  def _features_only(self, rng, n) -> Dict[str, np.ndarray]:
    f = self.features
    batch = {"dense": self._dense(rng, n)}
    batch["sparse_ids"], batch["sparse_mask"] = self._sparse(rng, n)
    if f.num_seq:
      batch["seq_ids"], batch["seq_mask"] = self._sequence(rng, n)
    batch["label"] = np.zeros(n, np.float32)
    return batch

  def _draw(self, rng, n) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    batch = self._features_only(rng, n)
    probs = _sigmoid(self._teacher.logit(batch))
    batch["label"] = (rng.random(n) < probs).astype(np.float32)
    return batch, probs

  # ---- the DataSource protocol ------------------------------------------------------------------
  def teacher_probs(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """The hidden teacher's click probability for each example of a batch of this source."""
    return _sigmoid(self._teacher.logit(batch))

  def train_batch(self, step: int, batch_size: int) -> Dict[str, np.ndarray]:
    if step < 0 or batch_size < 1:
      raise ValueError(f"train_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
    key = [self.spec.task_seed, _TRAIN, self.seed, int(step), int(batch_size)]
    rng = np.random.default_rng(key)
    batch, _ = self._draw(rng, int(batch_size))
    return validate_batch(batch, self.features, self.id_policy)

  def _eval_set(self) -> Dict[str, np.ndarray]:
    if self._eval is None:
      parts, probs = [], []
      for chunk in range(-(-self._num_eval // _EVAL_CHUNK)):
        rng = np.random.default_rng([self.spec.task_seed, _EVAL, chunk])
        batch, p = self._draw(rng, _EVAL_CHUNK)
        parts.append(batch)
        probs.append(p)
      full = {k: np.concatenate([b[k] for b in parts])[:self._num_eval] for k in parts[0]}
      full = validate_batch(full, self.features, self.id_policy)
      for value in full.values():
        value.setflags(write=False)  # shared by every eval pass: callers must not mutate it
      self._eval = full
      self._eval_probs = np.concatenate(probs)[:self._num_eval]
    return self._eval

  def eval_batches(self, batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
    """Full batches of the fixed eval set; the last partial batch is dropped."""
    if batch_size < 1:
      raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
    data = self._eval_set()
    for start in range(0, self._num_eval - batch_size + 1, batch_size):
      yield {k: v[start:start + batch_size] for k, v in data.items()}

  def num_eval_examples(self) -> int:
    return self._num_eval

  @property
  def oracle_ne(self) -> float:
    """NE of the teacher's own probabilities on the (whole) eval set: the best reachable NE."""
    data = self._eval_set()
    return normalized_entropy(data["label"], self._eval_probs)
