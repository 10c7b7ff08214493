"""A jittable reservoir of paired slices (Algorithm R), seeded.

Every slice offered is kept with probability capacity / (slices seen so far), as in
Vitter's Algorithm R: item t (0-based, over the whole stream) fills slot t while the
reservoir is not full, else draws j uniform in [0, t] and replaces slot j if j < capacity.
A batch of items is processed at once: each draws its own j, and where several items of one
batch hit one slot the latest wins (a scatter-max of item indices), which is exactly the state
the sequential algorithm leaves. All operands of one item share its slot, so an input slice
and the output-gradient slice of the same example stay paired.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp


def init(capacity: int, slice_shapes: Mapping[str, Tuple[int, ...]], dtype=jnp.bfloat16
         ) -> Dict[str, jax.Array]:
  """An empty reservoir of `capacity` slots, one buffer per operand name."""
  if capacity < 1:
    raise ValueError(f"reservoir capacity must be >= 1, got {capacity}")
  state = {"seen": jnp.zeros((), jnp.int32)}
  for name, shape in slice_shapes.items():
    state[name] = jnp.zeros((capacity,) + tuple(shape), dtype)
  return state


def operand_names(state) -> Sequence[str]:
  return sorted(k for k in state if k != "seen")


def capacity(state) -> int:
  name = operand_names(state)[0]
  return state[name].shape[0]


def update(state, items: Mapping[str, jax.Array], key) -> Dict[str, jax.Array]:
  """Offers a batch of items (leading axis = items, same length for every operand)."""
  names = operand_names(state)
  if sorted(items) != names:
    raise ValueError(f"reservoir holds operands {names}, offered {sorted(items)}")
  m = {items[n].shape[0] for n in names}
  if len(m) != 1:
    raise ValueError(f"paired operands must offer the same number of slices, got "
                     f"{ {n: items[n].shape[0] for n in names} }")
  m = m.pop()
  cap = capacity(state)
  index = jnp.arange(m, dtype=jnp.int32)
  t = state["seen"] + index                      # position of each item in the stream
  # j uniform in [0, t]: floor(u (t + 1)), clipped against float rounding at the top.
  u = jax.random.uniform(key, (m,), jnp.float32)
  draw = jnp.minimum((u * (t + 1).astype(jnp.float32)).astype(jnp.int32), t)
  slot = jnp.where(t < cap, t, draw)
  accepted = slot < cap
  winner = jnp.full((cap,), -1, jnp.int32).at[jnp.where(accepted, slot, cap)].max(
      index, mode="drop")
  take = jnp.maximum(winner, 0)
  out = {"seen": state["seen"] + m}
  for n in names:
    chosen = jnp.take(items[n].astype(state[n].dtype), take, axis=0)
    keep = (winner >= 0).reshape((cap,) + (1,) * (chosen.ndim - 1))
    out[n] = jnp.where(keep, chosen, state[n])
  return out


def filled(state) -> jax.Array:
  """How many slots hold items."""
  return jnp.minimum(state["seen"], capacity(state))
