"""Bytes the sharded step moves per step, per device: a model of its collectives
(step.py, embedding.py, collectives.py) computed from shapes alone, for any tower, preset,
mesh and payload, to set against measured interconnect traffic.

Per collective of one step it gives the operand bytes one device hands the collective calls
(`payload`: values, FP8 block scales and padding; `hlo_collectives` reads the same from a
compiled step) and the bytes one device sends (`wire`), for a group of n devices:
  all-reduce (fp32, bf16)   ring: 2 (n-1)/n x payload
  all-reduce (fp8)          an all-to-all of n chunks, then an all-gather of one chunk
                            (payload (n + 1) x chunk): 2 (n-1) x chunk
  reduce-scatter            (n-1)/n x payload (fp8: an all-to-all, the same bytes)
  all-gather                (n-1) x payload (each device's piece goes to the n-1 others)
The collectives of one step:
  grads/dense       dense gradients, all-reduced over every device, in buckets (`BUCKET_ELEMENTS`)
  grads/tables      table-shard gradients (rows / M, padded), all-reduced over `data` (N > 1)
  exchange/fwd      pooled partial bags [B/N, F, d] (and sequences [B/N, A, T, d]),
                    reduce-scattered over `model` (M > 1)
  exchange/bwd      their gradients [B/(NM), F, d], all-gathered over `model` (M > 1)
  fp8_meta          delayed-scaling state, max-reduced over every device (fp32, any mode)
The loss, gradient norm and global-amax values are left out (4 bytes each).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import jax
import numpy as np

from loka_jax.kernels import FP8_META
from loka_jax.models.embedding import EMBEDDINGS
from loka_jax.parallel import collectives
from loka_jax.parallel.step import ParallelConfig, padded_rows

VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
SCALE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the step: what it moves, over how many devices, and its bytes."""
  name: str           # grads/dense, grads/tables, exchange/fwd, exchange/bwd, fp8_meta
  op: str             # all_reduce, reduce_scatter, all_gather
  mode: str           # fp32, bf16, fp8
  group: int          # devices taking part
  elements: int       # values it moves (before padding)
  payload: int        # operand bytes per device (values + scales + padding)
  wire: int           # bytes one device sends

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


def _scales(values: int, codec: collectives.Codec, last: int) -> int:
  """fp32 scale bytes of `values` encoded with rows of length `last` (block scales)."""
  if codec.mode != "fp8":
    return 0
  block = codec.block if last % codec.block == 0 else last
  return SCALE_BYTES * (values // block)


def all_reduce_bytes(elements: int, n: int, codec: collectives.Codec):
  """(payload, wire) of `collectives.all_reduce` of `elements` values over n devices."""
  if codec.mode != "fp8":
    payload = VALUE_BYTES[codec.mode] * elements
    return payload, 2 * (n - 1) * payload // n
  # Chunks of whole scale blocks, padded to n of them (collectives.all_reduce).
  chunk = -(-elements // (n * codec.block)) * codec.block
  piece = chunk + SCALE_BYTES * (chunk // codec.block)
  return (n + 1) * piece, 2 * (n - 1) * piece


def tree_all_reduce(sizes: Sequence[int], n: int, codec: collectives.Codec,
                    bucket_elements: int = collectives.BUCKET_ELEMENTS):
  """(payload, wire) of `collectives.tree_all_reduce` of leaves of `sizes` values: bucketed
  exactly as it buckets them, each bucket one all-reduce."""
  buckets, current = [], 0
  for size in sizes:
    if current and current + size > bucket_elements:
      buckets.append(current)
      current = 0
    current += size
  if current:
    buckets.append(current)
  totals = [all_reduce_bytes(b, n, codec) for b in buckets]
  return sum(t[0] for t in totals), sum(t[1] for t in totals)


def _exchange(name_shape: Sequence[int], m: int, codec: collectives.Codec) -> List[tuple]:
  """(op, elements, payload, wire) of the forward reduce-scatter and backward all-gather of
  one exchanged tensor [B/N, ..., d] over m model shards."""
  elements = int(np.prod(name_shape))
  last = int(name_shape[-1])
  fwd = VALUE_BYTES[codec.mode] * elements + _scales(elements, codec, last)
  piece_elements = elements // m
  bwd = VALUE_BYTES[codec.mode] * piece_elements + _scales(piece_elements, codec, last)
  return [("reduce_scatter", elements, fwd, (m - 1) * fwd // m),
          ("all_gather", piece_elements, bwd, (m - 1) * bwd)]


def step_collectives(params: Mapping, fp8_meta: Mapping, batch: Mapping, data: int, model: int,
                     config: ParallelConfig = ParallelConfig()) -> List[Collective]:
  """Every collective of one sharded step on a data:`data`,model:`model` mesh.

  params, fp8_meta: the model's unpadded variables (arrays or ShapeDtypeStructs); batch: one
  global batch (arrays or shapes; its `label` field gives the batch size B), which must
  split over the mesh's devices, as the step's does (ValueError otherwise).
  """
  n = data * model
  batch_size = int(np.shape(batch["label"])[0])
  if batch_size % n:
    raise ValueError(f"batch size {batch_size} does not split over the {n} devices of mesh "
                     f"data:{data},model:{model}; use a multiple of {n}")
  grad, embed = config.grad_codec(), config.embedding_codec()
  tables = dict(params.get(EMBEDDINGS, {}))
  dense = {k: v for k, v in params.items() if k != EMBEDDINGS}
  out: List[Collective] = []

  def add(name, op, codec, group, elements, payload, wire):
    out.append(Collective(name, op, codec.mode, group, int(elements), int(payload), int(wire)))

  if n > 1:
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(dense)]
    add("grads/dense", "all_reduce", grad, n, sum(sizes), *tree_all_reduce(sizes, n, grad))
  if data > 1 and tables:
    sizes = [padded_rows(int(np.shape(t)[0]), model) // model * int(np.prod(np.shape(t)[1:]))
             for t in jax.tree.leaves(tables)]
    add("grads/tables", "all_reduce", grad, data, sum(sizes),
        *tree_all_reduce(sizes, data, grad))
  if model > 1 and tables:
    b_d = batch_size // data
    width = int(np.shape(next(iter(tables.values())))[1])
    shapes = [(b_d, int(np.shape(batch["sparse_ids"])[1]), width)]
    if "seq_ids" in batch and any(k.startswith("seq_") for k in tables):
      _, attrs, steps = (int(s) for s in np.shape(batch["seq_ids"]))
      shapes.append((b_d, attrs, steps, width))
    for shape in shapes:
      for op, elements, payload, wire in _exchange(shape, model, embed):
        name = "exchange/fwd" if op == "reduce_scatter" else "exchange/bwd"
        add(name, op, embed, model, elements, payload, wire)
  meta = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(fp8_meta)]
  if n > 1 and meta:
    fp32 = collectives.Codec("fp32")
    add("fp8_meta", "all_reduce", fp32, n, sum(meta),
        sum(all_reduce_bytes(s, n, fp32)[0] for s in meta),
        sum(all_reduce_bytes(s, n, fp32)[1] for s in meta))
  return _merge(out)


def _merge(rows: List[Collective]) -> List[Collective]:
  """One row per (name, op): the sequence exchange adds to the bags' row."""
  merged: Dict[tuple, Collective] = {}
  for r in rows:
    key = (r.name, r.op)
    if key in merged:
      m = merged[key]
      r = dataclasses.replace(m, elements=m.elements + r.elements, payload=m.payload + r.payload,
                              wire=m.wire + r.wire)
    merged[key] = r
  return list(merged.values())


def model_collectives(model, example_batch, batch_size: int, data: int, model_size: int,
                      config: ParallelConfig = ParallelConfig()) -> List[Collective]:
  """`step_collectives` of a Flax tower training global batches of `batch_size` examples
  shaped like `example_batch` (any batch size), from shapes only (nothing is allocated)."""
  one = jax.tree.map(lambda x: np.asarray(x)[:1], example_batch)
  variables = jax.eval_shape(lambda: model.init(
      {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, one, train=False))
  shapes = {k: jax.ShapeDtypeStruct((batch_size,) + v.shape[1:], v.dtype)
            for k, v in one.items()}
  return step_collectives(variables["params"], variables.get(FP8_META, {}), shapes, data,
                          model_size, config)


def totals(rows: Sequence[Collective]) -> Dict[str, int]:
  """{'payload', 'wire'} summed over a step's collectives."""
  return {"payload": sum(r.payload for r in rows), "wire": sum(r.wire for r in rows)}


def table(rows_by_mode: Mapping[str, Sequence[Collective]], title: Optional[str] = None) -> str:
  """Text table of one step's bytes per collective, a column pair per payload mode."""
  modes = list(rows_by_mode)
  names = []
  for rows in rows_by_mode.values():
    names += [(r.name, r.op) for r in rows if (r.name, r.op) not in names]
  head = f"{'collective':<14} {'op':<15} {'group':>5} {'values':>12}" + "".join(
      f" {m + ' payload':>14} {m + ' wire':>12}" for m in modes)
  lines = ([title] if title else []) + [head]
  for name, op in names + [("total", "")]:
    found = {m: [r for r in rows_by_mode[m] if (name == "total" or (r.name, r.op) == (name, op))]
             for m in modes}
    any_rows = next((rs for rs in found.values() if rs), [])
    group = any_rows[0].group if any_rows and name != "total" else ""
    values = sum(r.elements for r in any_rows) if name != "total" else ""
    line = f"{name:<14} {op:<15} {group!s:>5} {values!s:>12}"
    for m in modes:
      t = totals(found[m])
      line += f" {t['payload']:>14,} {t['wire']:>12,}"
    lines.append(line)
  return "\n".join(lines)


# ----------------------------------------------------------------------------- compiled steps

_COLLECTIVE = re.compile(r"=\s*(?P<type>\(.*?\)|[a-z0-9]+\[[0-9,]*\]\S*)\s+(?P<op>all-reduce|"
                         r"all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")
# An array type with its layout: f32[4,16]{1,0}, s4[64]{0:E(4)} (E(bits): packed values).
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_GROUPS = re.compile(r"replica_groups=(\{\}|\{\{[0-9,{}]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\])")
# The mesh form of replica groups (the XLA of jax 0.12 prints it for a shard_map's
# collectives): the mesh's axes with their sizes, its device order when that is no iota, and
# the axes a group spans, each whole or a sub-axis 'name':(pre-size)size:
# replica_groups=mesh['data'=2,'model'=2] {'model'},
# replica_groups=mesh['x'=4,'y'=2], device_ids=(...) {'x':(1)2,'y'}.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<mesh>[^\]]*)\](?:,\s*device_ids=\([^)]*\))?"
                          r"\s*\{(?P<axes>[^}]*)\}")
_MESH_AXIS = re.compile(r"'?(?P<name>[^'=,\s]+)'?=(?P<size>[0-9]+)")
_GROUP_AXIS = re.compile(r"'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>[0-9]+)\)(?P<size>[0-9]+))?")
# An XLA primitive type's HLO name: pred; s, u (integers), f, bf (floats) or c (complex) and
# its width in bits, a float's exponent and mantissa bits (and flags) after it: s16, u4, f32,
# f8e5m2fnuz, f4e2m1fn, f8e4m3b11fnuz, c64.
_PRIMITIVE = re.compile(r"(?:pred|(?:s|u|bf|c)(?P<int>[0-9]+)|f(?P<float>[0-9]+)(?:e[0-9]+m[0-9]+"
                        r"[a-z0-9]*)?)")
_MODULE_COUNTS = re.compile(r"\b(replica_count|num_partitions)=([0-9]+)")


def dtype_bits(name: str) -> int:
  """Bits of one value of the XLA primitive type named `name` in HLO text (pred: 8, as
  XLA stores it); ValueError for a name of no array type."""
  found = _PRIMITIVE.fullmatch(name)
  if not found:
    raise ValueError(f"unknown XLA primitive type {name!r} in a collective's operand (known: "
                     "pred, s/u/f/bf/c with a width in bits, e.g. s16, f8e5m2fnuz, c64)")
  return int(found.group("int") or found.group("float") or 8)


def array_bytes(dtype: str, count: int, layout: str = "") -> int:
  """Bytes of `count` values of `dtype` in memory: a value narrower than a byte takes a byte
  unless the layout packs it (`E(bits)`, e.g. {0:E(4)})."""
  bits = dtype_bits(dtype)
  packed = re.search(r"E\(([0-9]+)\)", layout or "")
  if packed:
    return -(-count * int(packed.group(1)) // 8)
  return count * -(-bits // 8)


def _module_devices(hlo_text: str) -> Dict[str, int]:
  """The module's replica_count and num_partitions (1 when its header leaves one out)."""
  header = next((line for line in hlo_text.splitlines() if line.startswith("HloModule")), "")
  counts = {"replica_count": 1, "num_partitions": 1}
  counts.update((k, int(v)) for k, v in _MODULE_COUNTS.findall(header))
  return counts


def _mesh_group_size(mesh: str, axes: str, line: str) -> int:
  """Devices in one group of the mesh form: the product of the sizes of the axes it names,
  a sub-axis by its own size. ValueError for an axis the mesh does not have."""
  sizes = {m.group("name"): int(m.group("size")) for m in _MESH_AXIS.finditer(mesh)}
  size = 1
  for part in filter(None, (p.strip() for p in axes.split(","))):
    axis = _GROUP_AXIS.fullmatch(part)
    if not axis or axis.group("name") not in sizes:
      raise ValueError(f"replica group axis {part} is no axis of mesh[{mesh}]: {line.strip()}")
    size *= int(axis.group("size") or sizes[axis.group("name")])
  return size


def _group_size(line: str, op: str, replicas: int = 1, partitions: int = 1) -> int:
  """Devices taking part in one collective of a module of `replicas` x `partitions`, by
  XLA's group modes: without channel_id the groups hold replicas; with channel_id and
  use_global_device_ids they hold global device ids; with channel_id alone, an all-to-all's
  or permute's hold partitions, and the other collectives' hold replicas, each with every
  partition. Empty groups (`replica_groups={}`) are all of them; a group in the mesh form
  holds the product of the sizes of the mesh axes (or sub-axes) it names."""
  mesh_form = _MESH_GROUPS.search(line)
  found = None if mesh_form else _GROUPS.search(line)
  if not mesh_form and not found:
    return 1   # collective-permute: pairs of devices
  channel = re.search(r"\bchannel_id=", line) is not None
  flattened = "use_global_device_ids=true" in line
  if not channel:
    everyone, per_member = replicas, 1
  elif flattened:
    everyone, per_member = replicas * partitions, 1
  elif op in ("all-to-all", "collective-permute"):
    everyone, per_member = partitions, 1
  else:
    everyone, per_member = replicas, partitions
  if mesh_form:
    size = _mesh_group_size(mesh_form.group("mesh"), mesh_form.group("axes"), line)
  elif found.group(1) == "{}":
    size = everyone
  elif found.group(1).startswith("{{"):
    size = len(found.group(1)[2:].split("}")[0].split(","))
  else:
    size = int(found.group(1)[1:].split("]")[0].split(",")[-1])   # [groups, size]<=[devices]
  return size * per_member


def hlo_collectives(hlo_text: str) -> List[Dict[str, Any]]:
  """Every collective of a compiled module: {"op", "dtypes", "group", "payload"} with
  `payload` its operand bytes per device, comparable to `Collective.payload`. Rank-0 arrays
  (the loss, the gradient norm, global amaxes) are left out, also when XLA combined them
  with others. ValueError for an operand of a type that is not an XLA array type."""
  devices = _module_devices(hlo_text)
  found = []
  for line in hlo_text.splitlines():
    match = _COLLECTIVE.search(line)
    if not match:
      continue
    arrays = [(d, int(np.prod([int(x) for x in dims.split(",")])), layout)
              for d, dims, layout in _ARRAY.findall(match.group("type")) if dims]
    if not arrays:
      continue
    out_bytes = sum(array_bytes(d, n, layout) for d, n, layout in arrays)
    op = match.group("op")
    group = _group_size(line, op, devices["replica_count"], devices["num_partitions"])
    payload = (out_bytes // group if op == "all-gather" else
               out_bytes * group if op == "reduce-scatter" else out_bytes)
    found.append({"op": op, "dtypes": sorted({d for d, _, _ in arrays}), "group": group,
                  "payload": payload})
  return found


__all__ = ["Collective", "all_reduce_bytes", "array_bytes", "dtype_bits", "hlo_collectives",
           "model_collectives", "step_collectives", "table", "totals", "tree_all_reduce"]
