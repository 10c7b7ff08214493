"""Collectives with a payload codec: fp32 (reference), bf16, or FP8 with block scales.

Call these inside `shard_map`. fp32 and bf16 use XLA's own collectives on values of that
dtype (bf16 sums in bf16, as a bf16 training stack does). FP8 never sums in FP8:
  reduce-scatter = quantize each destination's chunk -> all-to-all -> dequantize -> fp32 sum;
  all-gather     = quantize -> all-gather (data and scales) -> dequantize;
  all-reduce     = FP8 reduce-scatter -> fp32 local sum -> FP8 all-gather.
FP8 payloads carry one fp32 scale per block of `block` elements along the last axis (the
whole last axis when it is not a multiple of `block`), so one large gradient or embedding
row cannot flush everyone else's values to zero.

`measure` gives a collective's error against the fp32 one with the kernel metrics.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from loka_jax.parallel import mesh as mesh_lib
from loka_jax.precision import formats, metrics
from loka_jax.precision.scaling import finite_abs, quantize_with_scale, scale_from_amax

MODES = ("fp32", "bf16", "fp8")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Codec:
  """How a collective's payload travels: 'fp32', 'bf16' or 'fp8' (`fmt` with block scales)."""
  mode: str = "fp32"
  fmt: str = "e4m3"
  block: int = 128

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown collective mode {self.mode!r}; use one of {', '.join(MODES)}")
    formats.get_format(self.fmt)
    if self.block < 1:
      raise ValueError(f"FP8 scale block must be >= 1 element, got {self.block}")

  def _block(self, length: int) -> int:
    return self.block if length % self.block == 0 else length

  def encode(self, x: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """(payload, scales); scales are a dummy scalar except in fp8 mode."""
    if self.mode == "fp32":
      return x.astype(jnp.float32), jnp.ones((), jnp.float32)
    if self.mode == "bf16":
      return x.astype(jnp.bfloat16), jnp.ones((), jnp.float32)
    length = x.shape[-1]
    b = self._block(length)
    blocks = x.astype(jnp.float32).reshape(x.shape[:-1] + (length // b, b))
    scale = scale_from_amax(jnp.max(finite_abs(blocks), axis=-1, keepdims=True), self.fmt)
    data = quantize_with_scale(blocks, scale, self.fmt)
    return data.reshape(x.shape), scale[..., 0]

  def decode(self, payload: jax.Array, scale: jax.Array) -> jax.Array:
    """fp32 values of an encoded payload."""
    if self.mode != "fp8":
      return payload.astype(jnp.float32)
    length = payload.shape[-1]
    b = self._block(length)
    blocks = payload.astype(jnp.float32).reshape(payload.shape[:-1] + (length // b, b))
    return (blocks * scale[..., None]).reshape(payload.shape)


def _as_bytes(data: jax.Array) -> jax.Array:
  """FP8 travels as raw bytes: every backend moves uint8, and none widens it on the wire."""
  return lax.bitcast_convert_type(data, jnp.uint8) if data.dtype.itemsize == 1 else data


def _from_bytes(data: jax.Array, like: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(data, like.dtype) if like.dtype.itemsize == 1 else data


def all_to_all(x: jax.Array, axis_name, codec: Codec) -> jax.Array:
  """x [n, ...] (chunk i goes to device i) -> [n, ...] (chunk i came from device i), fp32."""
  data, scale = codec.encode(x)
  moved = lax.all_to_all(_as_bytes(data), axis_name, 0, 0, tiled=True)
  if codec.mode == "fp8":
    scale = lax.all_to_all(scale, axis_name, 0, 0, tiled=True)
  return codec.decode(_from_bytes(moved, data), scale)


def reduce_scatter(x: jax.Array, axis_name, codec: Codec) -> jax.Array:
  """x [n, ...] summed over devices; device i keeps chunk i: -> [...] in fp32."""
  if codec.mode == "fp8":
    return jnp.sum(all_to_all(x, axis_name, codec), axis=0)
  data, _ = codec.encode(x)
  return lax.psum_scatter(data, axis_name, scatter_dimension=0, tiled=False).astype(jnp.float32)


def all_gather(x: jax.Array, axis_name, codec: Codec) -> jax.Array:
  """x [...] from every device -> [n, ...] in fp32 (every device decodes the same bytes)."""
  data, scale = codec.encode(x)
  gathered = lax.all_gather(_as_bytes(data), axis_name, axis=0, tiled=False)
  if codec.mode == "fp8":
    scale = lax.all_gather(scale, axis_name, axis=0, tiled=False)
  return codec.decode(_from_bytes(gathered, data), scale)


def all_reduce(x: jax.Array, axis_name, codec: Codec) -> jax.Array:
  """Sum of x over devices, in fp32, identical on every device."""
  if codec.mode != "fp8":
    data, _ = codec.encode(x)
    return lax.psum(data, axis_name).astype(jnp.float32)
  n = mesh_lib.axis_size(axis_name)
  flat = x.astype(jnp.float32).ravel()
  # Every device's chunk is a whole number of scale blocks.
  chunk = -(-flat.size // (n * codec.block)) * codec.block
  flat = jnp.pad(flat, (0, n * chunk - flat.size))
  mine = reduce_scatter(flat.reshape(n, chunk), axis_name, codec)  # [chunk], fp32 sum
  full = all_gather(mine, axis_name, codec).reshape(-1)
  return full[:x.size].reshape(x.shape)


BUCKET_ELEMENTS = 1 << 26  # 64 Mi values (256 MB in fp32) per fused gradient collective


def tree_all_reduce(tree, axis_name, codec: Codec, bucket_elements: int = BUCKET_ELEMENTS):
  """all_reduce of every leaf: consecutive leaves share one flat buffer (one collective, or
  one reduce-scatter + all-gather) up to `bucket_elements` values, so small biases do not
  each pay a collective's latency and a 3 B-parameter tower is not copied into one buffer."""
  leaves, treedef = jax.tree.flatten(tree)
  buckets, current, size = [], [], 0
  for i, leaf in enumerate(leaves):
    if current and size + leaf.size > bucket_elements:
      buckets.append(current)
      current, size = [], 0
    current.append(i)
    size += leaf.size
  if current:
    buckets.append(current)
  out = list(leaves)
  for bucket in buckets:
    flat = jnp.concatenate([jnp.ravel(leaves[i]).astype(jnp.float32) for i in bucket])
    summed = all_reduce(flat, axis_name, codec)
    start = 0
    for i in bucket:
      out[i] = summed[start:start + leaves[i].size].reshape(leaves[i].shape).astype(
          leaves[i].dtype)
      start += leaves[i].size
  return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------- error bounds

def rounding_bound(codec: Codec) -> Tuple[float, float]:
  """(relative, absolute-per-unit-scale) error of one encode: |x~ - x| <= rel |x| + abs * s,
  with s the block's dequantization scale (fp8) or 0."""
  if codec.mode == "fp32":
    return 0.0, 0.0
  if codec.mode == "bf16":
    return 2.0 ** -8, 0.0  # round to nearest with 8 significand bits (7 stored)
  fmt = formats.get_format(codec.fmt)
  return fmt.epsilon / 2, fmt.min_subnormal / 2


# ----------------------------------------------------------------------------- measurement

def _run(mesh: Mesh, axis, op: str, codec: Codec, x: jax.Array) -> jax.Array:
  """`op` of the per-device slices x[i] (x: [n, ...]) -> what device 0 ends up with."""
  def body(local):
    local = local[0]
    if op == "all_reduce":
      out = all_reduce(local, axis, codec)
    elif op == "reduce_scatter":
      out = reduce_scatter(local, axis, codec)
    elif op == "all_gather":
      out = all_gather(local, axis, codec)
    else:
      out = all_to_all(local, axis, codec)
    return out[None]
  fn = mesh_lib.shard_map(body, mesh, in_specs=P(axis), out_specs=P(axis))
  return jax.jit(fn)(x)


def measure(op: str, mode: str, x: jax.Array, mesh: Mesh, axis=mesh_lib.BATCH_AXES,
            fmt: str = "e4m3", block: int = 128) -> Dict[str, float]:
  """Error of `op` in `mode` against the same op in fp32, like a kernel's: SQNR (dB),
  rel_fro, MERE, median relative error. x is [devices, ...]: row i is device i's input."""
  if op not in OPS:
    raise ValueError(f"unknown collective {op!r}; use one of {', '.join(OPS)}")
  out = _run(mesh, axis, op, Codec(mode, fmt, block), x)
  ref = _run(mesh, axis, op, Codec("fp32"), x)
  return {k: float(v) for k, v in metrics.product_errors(out, ref).items()}


def payload_bytes(op: str, codec: Codec, elements: int) -> int:
  """Bytes one device sends for `elements` values (scales included)."""
  per = {"fp32": 4, "bf16": 2, "fp8": 1}[codec.mode]
  scales = 0 if codec.mode != "fp8" else 4 * -(-elements // codec.block)
  factor = 2 if op == "all_reduce" else 1  # a reduce-scatter then an all-gather
  return factor * (per * elements + scales)


__all__ = ["Codec", "MODES", "OPS", "all_gather", "all_reduce", "all_to_all", "measure",
           "payload_bytes", "reduce_scatter", "rounding_bound", "tree_all_reduce"]
