"""Optimizers: (row-wise) Adagrad for the embedding tables, Adam(W) for everything else.

Embedding rows are touched by few examples per step and with very different frequencies, so
they get an Adagrad-style per-row step size (the usual choice for recommendation models);
the dense towers get Adam(W). The split is by the top-level `embeddings` submodule, where
every model keeps its tables. The `fp8_meta` collection never reaches the optimizer: the
training step overwrites it with its "gradient" (see `TrainState.apply_gradients`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

EMBEDDINGS = "embeddings"        # top-level submodule holding every embedding table
EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "adagrad")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Optimizer settings (hashable, so a config can key a cache of compiled steps)."""
  learning_rate: float = 1e-3            # Adam(W), dense towers
  embedding_learning_rate: float = 0.05  # (row-wise) Adagrad, embedding tables
  embedding_optimizer: str = "rowwise_adagrad"
  warmup_steps: int = 0                  # linear warmup of both rates from 0
  # A linear cooldown of both rates from step `cooldown_start`, reaching 0 at step
  # `cooldown_start + cooldown_steps` and staying there (0 steps: none). Ending a fixed-step
  # run at a rate of 0 settles its last iterate, where a constant rate leaves it moving.
  cooldown_start: int = 0
  cooldown_steps: int = 0
  weight_decay: float = 0.0              # AdamW decoupled decay (dense only)
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  adagrad_initial_accumulator: float = 0.0
  adagrad_eps: float = 1e-8
  clip_norm: Optional[float] = None      # global-norm clipping of the dense gradients

  def __post_init__(self):
    if self.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
      raise ValueError(f"embedding_optimizer={self.embedding_optimizer!r}; use one of "
                       f"{EMBEDDING_OPTIMIZERS}")
    if self.warmup_steps < 0:
      raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm must be > 0 or None, got {self.clip_norm}")
    if self.cooldown_steps < 0:
      raise ValueError(f"cooldown_steps must be >= 0, got {self.cooldown_steps}")
    if self.cooldown_steps and self.cooldown_start < self.warmup_steps:
      raise ValueError(f"cooldown_start={self.cooldown_start} is inside the warm-up "
                       f"(warmup_steps={self.warmup_steps}); start the cooldown after it")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "OptimConfig":
    """From a dict or ConfigDict; unknown keys are an error naming them."""
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown optimizer setting(s) {unknown}; known: {sorted(known)}")
    return cls(**d)


class RowwiseAdagradState(NamedTuple):
  """Per-row (leading axes) sum of mean squared gradients."""
  sum_of_squares: Any


def _row_mean_square(g):
  g = g.astype(jnp.float32)
  return jnp.mean(g * g, axis=-1) if g.ndim >= 2 else g * g


def scale_by_rowwise_adagrad(initial_accumulator_value: float = 0.0,
                             eps: float = 1e-8) -> optax.GradientTransformation:
  """Adagrad with one accumulator per table row (mean of the row's squared gradient).

  Tables [V, d] keep V accumulators instead of V*d; vectors keep one per element.
  Rows with no gradient this step keep their accumulator and get a zero update.
  """

  def init_fn(params):
    return RowwiseAdagradState(jax.tree.map(
        lambda p: jnp.full(p.shape[:-1] if p.ndim >= 2 else p.shape, initial_accumulator_value,
                           jnp.float32), params))

  def update_fn(updates, state, params=None):
    del params
    sums = jax.tree.map(lambda g, s: s + _row_mean_square(g), updates, state.sum_of_squares)

    def scale(g, s):
      denom = jnp.sqrt(s) + eps
      denom = denom[..., None] if g.ndim >= 2 else denom
      return (g.astype(jnp.float32) / denom).astype(g.dtype)

    return jax.tree.map(scale, updates, sums), RowwiseAdagradState(sums)

  return optax.GradientTransformation(init_fn, update_fn)


def learning_rate_schedule(peak: float, warmup_steps: int, cooldown_start: int = 0,
                           cooldown_steps: int = 0) -> optax.Schedule:
  """Linear warmup from 0 to `peak` over `warmup_steps`, then constant; with
  `cooldown_steps`, from step `cooldown_start` a linear decay to 0 over that many steps, and 0
  after it."""
  pieces, boundaries = [], []
  if warmup_steps:
    pieces.append(optax.linear_schedule(0.0, peak, warmup_steps))
    boundaries.append(warmup_steps)
  pieces.append(optax.constant_schedule(peak))
  if cooldown_steps:
    pieces.append(optax.linear_schedule(peak, 0.0, cooldown_steps))
    boundaries.append(cooldown_start)
  return pieces[0] if len(pieces) == 1 else optax.join_schedules(pieces, boundaries)


def cooldown_at_end(steps: int, cooldown_steps: int, warmup_steps: int = 0) -> Dict[str, int]:
  """OptimConfig's cooldown fields for a decay over the last `cooldown_steps` of a run of
  `steps` (none for 0); ValueError where they do not fit after the warm-up."""
  if not 0 <= cooldown_steps <= steps - warmup_steps:
    raise ValueError(f"cooldown_steps must be in [0, steps - warmup_steps = "
                     f"{steps - warmup_steps}], got {cooldown_steps}")
  return {"cooldown_start": steps - cooldown_steps if cooldown_steps else 0,
          "cooldown_steps": cooldown_steps}


def restart_schedules(opt_state) -> Any:
  """`opt_state` with every learning-rate schedule's step count back at 0 and nothing else
  changed: a run continued from it under a warm-up warms both rates up again from 0, while
  Adam's moments and bias-correction count and Adagrad's accumulators keep what they learned.
  Validation's shadow check uses it to switch a trained state to a plan the way a run would
  switch kernels mid-training, with a warm-up after the switch
  (`ValidationConfig.shadow_warmup_steps`)."""
  is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
  if not found:
    raise ValueError("the optimizer state has no learning-rate schedule to restart (it was "
                     "not made by make_optimizer)")
  return jax.tree.map(
      lambda s: s._replace(count=jnp.zeros_like(s.count)) if is_schedule(s) else s,
      opt_state, is_leaf=is_schedule)


def param_labels(params) -> Any:
  """'embeddings' for leaves under the top-level `embeddings` submodule, else 'dense'."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a dict of submodules, got {type(params).__name__}")
  return {k: jax.tree.map(lambda _, k=k: "embeddings" if k == EMBEDDINGS else "dense", v)
          for k, v in params.items()}


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
  """The multi_transform: embeddings -> (row-wise) Adagrad, the rest -> Adam(W)."""
  cooldown = (config.cooldown_start, config.cooldown_steps)
  dense_lr = learning_rate_schedule(config.learning_rate, config.warmup_steps, *cooldown)
  embed_lr = learning_rate_schedule(config.embedding_learning_rate, config.warmup_steps,
                                    *cooldown)
  dense = optax.adamw(dense_lr, b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay)
  if config.clip_norm is not None:
    dense = optax.chain(optax.clip_by_global_norm(config.clip_norm), dense)
  if config.embedding_optimizer == "rowwise_adagrad":
    embed = optax.chain(
        scale_by_rowwise_adagrad(config.adagrad_initial_accumulator, config.adagrad_eps),
        optax.scale_by_learning_rate(embed_lr))
  else:
    embed = optax.adagrad(embed_lr, initial_accumulator_value=config.adagrad_initial_accumulator,
                          eps=config.adagrad_eps)
  return optax.multi_transform({"dense": dense, "embeddings": embed}, param_labels)
