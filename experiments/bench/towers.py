"""MLP towers for the benchmark: `depth` x (Site -> Norm -> activation) at one width, then a
1-wide head, on dense inputs of that width with labels from a hidden teacher.

The tower is a model in the sense of the training loop (`__call__(batch, *, train)` -> float32
logits [B]), so the same train/eval steps, the probe and Dispatch work on it unchanged.
Without Mods a layer is Linear(+bias) -> LayerNorm -> ReLU (the towers the peers are measured on);
with Mods it is No Bias -> BlockNorm(256) -> Hard Swish.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Dict, Iterator, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.data.spec import FeatureSpec
from loka_jax.models.layers import MLP, TowerOptions
from loka_jax.models.presets import parse_mods
from loka_jax.models.site import SiteConfig

BLOCK_SIZE = 256
# B x width x depth of the headline towers.
TOWER_SHAPES = ("4096x256x8", "4096x512x8", "8192x1024x8", "8192x2048x8", "16384x4096x4")
_TEACHER, _TRAIN, _EVAL = 1, 3, 4
_TEACHER_HIDDEN = 64


@dataclasses.dataclass(frozen=True)
class TowerShape:
  """B x width x depth; `name` is how rows, targets.only and tables spell it."""
  batch: int
  width: int
  depth: int

  @classmethod
  def parse(cls, text: str) -> "TowerShape":
    try:
      b, w, d = (int(p) for p in text.lower().split("x"))
    except ValueError:
      raise ValueError(f"tower shape {text!r}: expected BxWIDTHxDEPTH, e.g. 4096x256x8") from None
    if min(b, w, d) < 1:
      raise ValueError(f"tower shape {text!r}: every dimension must be >= 1")
    return cls(b, w, d)

  @property
  def name(self) -> str:
    return f"{self.batch}x{self.width}x{self.depth}"

  def flops_per_example(self) -> int:
    """Forward FLOPs per example of every GEMM site (2 per multiply-add)."""
    return 2 * self.width * self.width * self.depth + 2 * self.width


def tower_options(site: SiteConfig, mods: Sequence[str], width: int,
                  depth: Optional[int] = None) -> TowerOptions:
  """Linear -> LayerNorm -> ReLU, or with Mods No Bias -> BlockNorm -> Hard Swish; No Bias's
  `keep_bias:` patterns are globs over the hidden sites `mlp/dense_<i>`, i < depth (checked
  when `depth` is given: one that matches none is an error; the head `mlp/dense_<depth>` has
  its bias anyway)."""
  mods, keep = parse_mods(mods)
  if keep and depth is not None:
    sites = [f"mlp/dense_{i}" for i in range(depth)]
    missing = [p for p in keep if not any(fnmatch.fnmatchcase(s, p) for s in sites)]
    if missing:
      raise ValueError(f"keep_bias pattern(s) {missing} match no hidden site of the tower "
                       f"({', '.join(sites)}; its head mlp/dense_{depth} has a bias anyway)")
  return TowerOptions(site=site, activation="hard_swish" if "hard_swish" in mods else "relu",
                      norm="blocknorm" if "blocknorm" in mods else "layernorm",
                      block_size=min(BLOCK_SIZE, width), use_bias="no_bias" not in mods,
                      keep_bias=keep)  # parse_mods refuses patterns without No Bias


class Tower(nn.Module):
  """`depth` hidden layers of `width` over batch['dense'] [B, width], then the head."""
  width: int
  depth: int
  opts: TowerOptions

  @nn.compact
  def __call__(self, batch, *, train: bool = False):
    del train  # no dropout
    x = jnp.asarray(batch["dense"]).astype(self.opts.policy.compute_dtype)
    if x.shape[-1] != self.width:
      raise ValueError(f"tower of width {self.width} got dense features of width {x.shape[-1]}")
    y = MLP((self.width,) * self.depth + (1,), self.opts, norm_hidden=True, final_bias=True,
            name="mlp")(x)
    return y[..., 0].astype(jnp.float32)


def build_tower(shape: TowerShape, site: SiteConfig, mods: Sequence[str] = ()) -> Tower:
  return Tower(shape.width, shape.depth, tower_options(site, mods, shape.width, shape.depth))


_T_DOF = 5  # Student-t degrees of freedom of the dense inputs


@functools.partial(jax.jit, static_argnums=(4,))
def _draw_on_device(key, scale, w1, w2, n: int):
  """n rows of t(5) inputs times per-channel scales, and Bernoulli labels from the teacher.

  Drawn where JAX runs (the GPU in a benchmark): at 16384x4096 NumPy's sampler took ~4 s a
  batch on the host, so 200-step shadow runs spent minutes drawing data for a 20 ms step.
  t(5) is built as z0 / sqrt(mean of 5 squared normals): plain normals, no rejection loop.
  """
  keys = jax.random.split(key, _T_DOF + 2)
  shape = (n, scale.shape[0])
  chi2 = sum(jnp.square(jax.random.normal(k, shape, jnp.float32)) for k in keys[1:-1])
  t = jax.random.normal(keys[0], shape, jnp.float32) * jax.lax.rsqrt(chi2 / _T_DOF)
  hidden = jnp.tanh(jnp.dot(t, w1, precision=jax.lax.Precision.HIGHEST))
  logit = jnp.dot(hidden, w2, precision=jax.lax.Precision.HIGHEST) * 0.5
  label = jax.random.uniform(keys[-1], (n,)) < jax.nn.sigmoid(logit)
  return t * scale, label.astype(jnp.float32)


class TowerSource:
  """Dense heavy-tailed inputs, labels from a fixed random teacher; a DataSource.

  A training batch is a pure function of (task_seed, seed, step); the teacher and the
  held-out set depend on task_seed alone, so every seed and arm sees the same eval set.
  Batches are drawn on the default JAX device and returned as NumPy arrays, like every source.
  """
  name = "tower_teacher"

  def __init__(self, width: int, seed: int = 0, num_eval: int = 8192, task_seed: int = 0):
    self.width, self.seed, self.task_seed = int(width), int(seed), int(task_seed)
    self._num_eval = int(num_eval)
    self.features = FeatureSpec(num_dense=self.width, vocab_sizes=(), bag_size=1)
    rng = np.random.default_rng([task_seed, _TEACHER])
    # Per-channel scales spread over two decades: a few loud channels, as in real features.
    self._scale = np.exp(rng.normal(0.0, 1.0, self.width)).astype(np.float32)
    self._w1 = (rng.normal(size=(self.width, _TEACHER_HIDDEN)) / np.sqrt(self.width)
                ).astype(np.float32)
    self._w2 = rng.normal(size=_TEACHER_HIDDEN).astype(np.float32)
    self._on_device = None  # the scales and teacher, put on the device at the first draw

  def _draw(self, stream: Sequence[int], n: int) -> Dict[str, np.ndarray]:
    key = jax.random.key(self.task_seed)
    for part in stream:
      key = jax.random.fold_in(key, part)
    if self._on_device is None:
      self._on_device = jax.device_put((self._scale, self._w1, self._w2))
    dense, label = jax.device_get(_draw_on_device(key, *self._on_device, n))
    return {"dense": np.asarray(dense), "label": np.asarray(label)}

  def train_batch(self, step: int, batch_size: int) -> Dict[str, np.ndarray]:
    return self._draw((_TRAIN, self.seed, step), batch_size)

  def eval_batches(self, batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
    for i, start in enumerate(range(0, self._num_eval - batch_size + 1, batch_size)):
      yield self._draw((_EVAL, batch_size, i), batch_size)

  def num_eval_examples(self) -> int:
    return self._num_eval


def shapes_from(names: Sequence[str]) -> Tuple[TowerShape, ...]:
  return tuple(TowerShape.parse(n) for n in names)
