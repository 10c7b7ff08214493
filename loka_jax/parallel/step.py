"""The sharded train step: data-parallel dense towers, row-sharded tables, chosen collectives.

The whole step (forward, backward, gradient reduction, optimizer) runs inside one
`shard_map` over the (data, model) mesh, so every GEMM site sees its device's slice of the
batch: kernels that are opaque to the SPMD partitioner (Pallas calls) run unchanged, and
nothing gathers a tower activation. Layout per device (N = data size, M = model size):
  dense features, labels: B / (N M) examples;  ids and masks: the B / N examples of its data
  shard (replicated over `model`, see embedding.py);  dense parameters and their optimizer
  state: replicated;  embedding tables and their optimizer state: rows / M rows.
Gradients: the dense ones are all-reduced over both axes, the tables' over `data`, through
the configured codec (collectives.py); the loss is the global batch mean.

FP8 scales: an amax inside `shard_map` is the shard's own (no communication). With
`global_amax=True` every tensorwise amax is max-reduced over the mesh first, which costs one
small all-reduce per quantized operand but gives the scales of the single-device step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.tree_util import DictKey

from loka_jax.kernels import FP8_META
from loka_jax.models.embedding import EMBEDDINGS
from loka_jax.parallel import collectives
from loka_jax.parallel import embedding as embedding_lib
from loka_jax.parallel.mesh import (BATCH_AXES, DATA, MODEL, MeshSpecError, axis_size,
                                    shard_map)
from loka_jax.precision import scaling
from loka_jax.train import metrics as metrics_lib
from loka_jax.train.state import TrainState, initial_state

ID_FIELDS = ("sparse_ids", "sparse_mask", "seq_ids", "seq_mask")  # split over `data` only
GRAD_SCOPE = "loka_grad_reduce"      # named scope of the gradient collectives (HLO)
_TABLE = re.compile(r"^(sparse|seq)_\d+$")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How the sharded step communicates (hashable: part of the compiled step's identity)."""
  collectives: str = "bf16"            # gradient all-reduce: 'fp32' | 'bf16' | 'fp8'
  embedding_collectives: Optional[str] = None  # embedding exchange; None: as `collectives`
  fp8_format: str = "e4m3"             # FP8 payload format (block scales keep e4m3 safe)
  block: int = 128                     # elements per FP8 scale
  global_amax: bool = False            # tensorwise FP8 amax over the mesh, not per shard

  def __post_init__(self):
    self.grad_codec()
    self.embedding_codec()

  def grad_codec(self) -> collectives.Codec:
    return collectives.Codec(self.collectives, self.fp8_format, self.block)

  def embedding_codec(self) -> collectives.Codec:
    return collectives.Codec(self.embedding_collectives or self.collectives, self.fp8_format,
                             self.block)


# ----------------------------------------------------------------------------- layouts

def batch_partition_specs(batch: Mapping[str, Any]) -> Dict[str, P]:
  """Ids and masks split over `data`; every other field over both axes."""
  return {k: P(DATA) if k in ID_FIELDS else P(BATCH_AXES) for k in batch}


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  devices = mesh.shape[DATA] * mesh.shape[MODEL]
  if batch_size % devices:
    raise MeshSpecError(f"batch size {batch_size} does not split over the {devices} devices of "
                        f"mesh {dict(mesh.shape)}; use a multiple of {devices}")


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> Dict[str, jax.Array]:
  """Global host batch -> device arrays laid out for the sharded step. Every process passes
  the same global batch (sources are pure functions of the step) and keeps its own slices."""
  sizes = {k: np.shape(v)[0] for k, v in batch.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"batch fields disagree on the batch size: {sizes}")
  check_batch_size(next(iter(sizes.values())), mesh)
  out = {}
  for key, spec in batch_partition_specs(batch).items():
    value = np.asarray(batch[key])
    out[key] = jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                            lambda index, v=value: v[index])
  return out


def _table_rows(params) -> Dict[str, int]:
  tables = params.get(EMBEDDINGS, {}) if isinstance(params, Mapping) else {}
  return {name: int(np.shape(t)[0]) for name, t in tables.items()}


def _table_of(path) -> Optional[str]:
  """The table a state leaf belongs to (its path runs through `embeddings/<table>`), or None."""
  keys = [k.key for k in path if isinstance(k, DictKey)]
  if EMBEDDINGS not in keys:
    return None
  names = [k for k in keys[keys.index(EMBEDDINGS) + 1:] if isinstance(k, str) and _TABLE.match(k)]
  return names[0] if names else None


def padded_rows(rows: int, model_size: int) -> int:
  """`rows` rounded up to a multiple of `model_size`: every shard gets rows / M of them."""
  return -(-rows // model_size) * model_size


@dataclasses.dataclass(frozen=True)
class TableLayout:
  """How a state's tables lie on a mesh: each table's own rows (`rows`, the vocabulary after
  any cap) padded with zero rows up to a multiple of the `model` size M, so that every shard
  holds the same number of consecutive rows. Ids map to rows below `rows` only
  (`models.embedding.row_index`), so no padding row is ever looked up: its gradient, and so
  its optimizer state (zero from the start) and its value (zero) never change. Checkpoints
  and `unshard_state` hold the tables without padding."""
  rows: Tuple[Tuple[str, int], ...]
  model_size: int

  @classmethod
  def of(cls, params, model_size: int) -> "TableLayout":
    """The layout of unpadded `params` (arrays or shapes) over `model_size` shards."""
    return cls(tuple(sorted(_table_rows(params).items())), int(model_size))

  def padded(self, name: str) -> int:
    return padded_rows(dict(self.rows)[name], self.model_size)

  def padding(self) -> Dict[str, int]:
    """{table: padding rows} of the tables that need any."""
    return {n: self.padded(n) - r for n, r in self.rows if self.padded(n) != r}

  def _map(self, tree, fn):
    rows = dict(self.rows)

    def leaf(path, x):
      name = _table_of(path)
      if name is None or name not in rows or not np.ndim(x):
        return x
      return fn(x, rows[name], self.padded(name))
    return jax.tree_util.tree_map_with_path(leaf, tree)

  def pad(self, tree):
    """`tree` (a state or params, unpadded) with zero rows appended to every table leaf."""
    def pad_leaf(x, rows, padded):
      if np.shape(x)[0] != rows or padded == rows:
        return x
      return jnp.pad(x, [(0, padded - rows)] + [(0, 0)] * (np.ndim(x) - 1))
    return self._map(tree, pad_leaf)

  def unpad(self, tree):
    """`tree` (padded) without its padding rows."""
    return self._map(tree, lambda x, rows, padded: x[:rows] if np.shape(x)[0] == padded else x)

  def unpadded_specs(self, tree):
    """Partition specs of the unpadded `tree`: a table leaf whose rows divide by M keeps
    P(MODEL); one that does not is replicated (JAX arrays shard evenly only)."""
    rows = dict(self.rows)

    def spec(path, x):
      name = _table_of(path)
      shape = np.shape(x)
      if name in rows and shape and shape[0] == rows[name] and rows[name] == self.padded(name):
        return P(MODEL)
      return P()
    return jax.tree_util.tree_map_with_path(spec, tree)

  def abstract_unpadded(self, template):
    """ShapeDtypeStructs of `template` (padded, with shardings) without padding rows, laid
    out on the template's mesh as `unpadded_specs` says."""
    rows = dict(self.rows)

    def leaf(path, x):
      name = _table_of(path)
      shape, sharding = tuple(x.shape), x.sharding
      if name in rows and shape and shape[0] == self.padded(name):
        shape = (rows[name],) + shape[1:]
        if rows[name] != self.padded(name):
          sharding = NamedSharding(sharding.mesh, P())
      return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(leaf, template)


def state_partition_specs(state: TrainState) -> TrainState:
  """P(MODEL) on the rows of every embedding table and of its optimizer state, P() else."""
  rows = _table_rows(state.params)

  def spec(path, leaf):
    name = _table_of(path)
    shape = np.shape(leaf)
    if name is not None and len(shape) >= 1 and shape[0] == rows.get(name):
      return P(MODEL)
    return P()

  return jax.tree_util.tree_map_with_path(spec, state)


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), state_partition_specs(state))


def check_padded(params, mesh: Mesh) -> None:
  """A state handed to the sharded step must be laid out for `mesh` (tables padded)."""
  m = mesh.shape[MODEL]
  bad = {n: r for n, r in _table_rows(params).items() if r % m}
  if bad:
    listed = ", ".join(f"{n} ({r} rows)" for n, r in sorted(bad.items()))
    raise MeshSpecError(f"the state is not laid out for {MODEL}:{m}: {listed} not padded to a "
                        f"multiple of {m}; make it with init_sharded_state or shard_state")


def table_layout(model, tx: optax.GradientTransformation, example_batch, mesh: Mesh
                 ) -> TableLayout:
  """The TableLayout of `model`'s tables on `mesh` (shapes only, nothing is allocated)."""
  abstract = jax.eval_shape(lambda: initial_state(model, tx, _one(example_batch), 0))
  return TableLayout.of(abstract.params, mesh.shape[MODEL])


def _one(batch):
  return jax.tree.map(lambda x: x[:1], batch)


def init_sharded_state(model, tx: optax.GradientTransformation, example_batch, seed: int,
                       mesh: Mesh) -> TrainState:
  """The state `create_train_state` makes (same keys, same values), tables padded for `mesh`
  (TableLayout), created directly in its sharded layout."""
  make = lambda: initial_state(model, tx, example_batch, seed)  # noqa: E731

  abstract = jax.eval_shape(make)
  layout = TableLayout.of(abstract.params, mesh.shape[MODEL])
  padded = jax.eval_shape(lambda: layout.pad(make()))
  return jax.jit(lambda: layout.pad(make()), out_shardings=state_shardings(padded, mesh))()


def shard_state(state: TrainState, mesh: Mesh) -> TrainState:
  """An existing (unpadded) state padded and copied to the sharded layout of `mesh` (never
  aliasing `state`'s buffers: the sharded step donates its state argument)."""
  layout = TableLayout.of(state.params, mesh.shape[MODEL])
  padded = jax.eval_shape(layout.pad, state)
  shardings = state_shardings(padded, mesh)
  placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                               layout.unpadded_specs(state)))
  # jnp.copy: padding is a no-op for tables that need none, and device_put may alias a
  # replicated leaf's buffer, while the step's output must own its buffers.
  return jax.jit(lambda s: jax.tree.map(jnp.copy, layout.pad(s)), out_shardings=shardings)(placed)


def unshard_state(state: TrainState, layout: TableLayout) -> TrainState:
  """The state without padding rows, on the same mesh (tables that do not divide by M
  replicated): what checkpoints hold and what the single-device model applies."""
  abstract = jax.eval_shape(layout.unpad, state)
  mesh = next(x.sharding.mesh for x in jax.tree.leaves(state)
              if isinstance(getattr(x, "sharding", None), NamedSharding))
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.unpadded_specs(abstract))
  return jax.jit(layout.unpad, out_shardings=shardings)(state)


# ----------------------------------------------------------------------------- the step

@contextlib.contextmanager
def global_tensorwise_amax(axes=BATCH_AXES):
  """Within this context (while tracing under shard_map) tensorwise amaxes span the mesh."""
  hook = lambda amax: lax.pmax(amax, axes)
  scaling.TENSORWISE_AMAX_HOOKS.append(hook)
  try:
    yield
  finally:
    scaling.TENSORWISE_AMAX_HOOKS.remove(hook)


def _split_tables(tree):
  """(dense part, embedding tables) of a params-shaped tree."""
  dense = {k: v for k, v in tree.items() if k != EMBEDDINGS}
  return dense, tree.get(EMBEDDINGS, {})


def _local_loss_and_grads(model, config: ParallelConfig, global_batch: int, params, fp8_meta,
                          batch, rng):
  """This device's share of the loss (sum / global batch) and its unreduced gradients."""
  m = axis_size(MODEL)
  index = lax.axis_index(MODEL)
  local = batch["label"].shape[0]
  ids = {k: batch[k] for k in ID_FIELDS if k in batch}
  if ids["sparse_ids"].shape[0] != local * m:
    raise ValueError(f"ids cover {ids['sparse_ids'].shape[0]} examples per data shard, "
                     f"expected {local * m}: lay the batch out with shard_batch()")
  # The tower sees only this device's examples; the lookup sees the whole data shard.
  tower_batch = {k: lax.dynamic_slice_in_dim(v, index * local, local, 0) if k in ids else v
                 for k, v in batch.items()}
  device = lax.axis_index(DATA) * m + index
  dropout = jax.random.fold_in(rng, device)  # independent dropout masks per device

  def loss_fn(params, fp8_meta):
    dense, tables = _split_tables(params)
    variables = {"params": dense}
    if fp8_meta:
      variables[FP8_META] = fp8_meta
    lookup = embedding_lib.ShardedLookup(tables, ids, config.embedding_codec())
    with embedding_lib.sharded_embeddings(lookup):
      logits = model.apply(variables, tower_batch, train=True, rngs={"dropout": dropout})
    per_example = metrics_lib.bce_with_logits(logits, tower_batch["label"])
    return jnp.sum(per_example) / global_batch

  amax = global_tensorwise_amax() if config.global_amax else contextlib.nullcontext()
  with amax:
    loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_meta)
  return loss, grads, fp8_grads


def _reduce(mesh: Mesh, config: ParallelConfig, loss, grads, fp8_grads):
  """Global loss, gradients and fp8 state; the gradient norm over the whole model."""
  codec = config.grad_codec()
  with jax.named_scope(GRAD_SCOPE):
    loss = lax.psum(loss, BATCH_AXES)
    dense, tables = _split_tables(grads)
    if mesh.shape[DATA] * mesh.shape[MODEL] > 1:
      dense = collectives.tree_all_reduce(dense, BATCH_AXES, codec)
    if mesh.shape[DATA] > 1:  # each data shard holds a replica of the same rows
      tables = collectives.tree_all_reduce(tables, DATA, codec)
    fp8_grads = jax.tree.map(lambda g: lax.pmax(g, BATCH_AXES), fp8_grads)
  squares = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(dense))
  table_squares = sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                      for g in jax.tree.leaves(tables))
  norm = jnp.sqrt(squares + lax.psum(table_squares, MODEL))
  merged = dict(dense)
  if tables:
    merged[EMBEDDINGS] = tables
  return loss, merged, fp8_grads, norm


def _specs(mesh: Mesh, state: TrainState, batch):
  check_padded(state.params, mesh)
  return state_partition_specs(state), batch_partition_specs(batch)


def make_loss_and_grads(model, mesh: Mesh, state: TrainState, batch,
                        config: ParallelConfig = ParallelConfig()) -> Callable:
  """jitted (params, fp8_meta, batch, rng) -> (global mean loss, reduced gradients, new fp8
  state); gradients keep the parameters' layout. For tests and diagnosis."""
  state_specs, batch_specs = _specs(mesh, state, batch)
  global_batch = int(np.shape(batch["label"])[0])

  def body(params, fp8_meta, batch, rng):
    loss, grads, fp8_grads = _local_loss_and_grads(model, config, global_batch, params,
                                                   fp8_meta, batch, rng)
    loss, grads, fp8_grads, _ = _reduce(mesh, config, loss, grads, fp8_grads)
    return loss, grads, fp8_grads

  fn = shard_map(body, mesh,
                 in_specs=(state_specs.params, state_specs.fp8_meta, batch_specs, P()),
                 out_specs=(P(), state_specs.params, state_specs.fp8_meta))
  return jax.jit(fn)


def make_train_step(model, tx: optax.GradientTransformation, mesh: Mesh, state: TrainState,
                    batch, config: ParallelConfig = ParallelConfig(),
                    nan_policy: str = "stop") -> Callable:
  """jitted (state, batch) -> (state, {"loss", "ok", "grad_norm"}), the sharded twin of the
  training loop's step (same loss, same never-apply-a-non-finite-update rule). `state` and
  `batch` (arrays or shapes) fix the layout; the state argument is donated."""
  state_specs, batch_specs = _specs(mesh, state, batch)
  global_batch = int(np.shape(batch["label"])[0])
  check_batch_size(global_batch, mesh)
  bad_step = 0 if nan_policy == "stop" else 1

  def body(state: TrainState, batch):
    rng = jax.random.fold_in(state.rng, state.step)
    loss, grads, fp8_grads = _local_loss_and_grads(model, config, global_batch, state.params,
                                                   state.fp8_meta, batch, rng)
    loss, grads, fp8_grads, norm = _reduce(mesh, config, loss, grads, fp8_grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(norm)  # global values: every device agrees
    new = lax.cond(ok, lambda s: s.apply_gradients(tx, grads, fp8_grads),
                   lambda s: s.replace(step=s.step + bad_step), state)
    return new, {"loss": loss, "ok": ok, "grad_norm": norm}

  fn = shard_map(body, mesh, in_specs=(state_specs, batch_specs),
                 out_specs=(state_specs, {"loss": P(), "ok": P(), "grad_norm": P()}))
  return jax.jit(fn, donate_argnums=0)


# ----------------------------------------------------------------------------- HLO checks

_ALL_GATHER = re.compile(
    r"=\s*(?P<type>\(?[a-z0-9]+\[[0-9,]*\][^ ]*)\s+all-gather(?:-start)?\((?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def all_gathers(hlo_text: str) -> List[Dict[str, Any]]:
  """Every all-gather of a compiled module: {"dtype", "shape", "op_name", "line"}."""
  found = []
  for line in hlo_text.splitlines():
    match = _ALL_GATHER.search(line)
    if not match:
      continue
    dtype, dims = _SHAPE.search(match.group("type")).groups()
    op_name = _OP_NAME.search(line)
    found.append({"dtype": dtype, "shape": tuple(int(d) for d in dims.split(",") if d),
                  "op_name": op_name.group(1) if op_name else "", "line": line.strip()})
  return found


def unexpected_all_gathers(hlo_text: str,
                           allowed_scopes: Sequence[str] = (embedding_lib.EXCHANGE_SCOPE,
                                                            GRAD_SCOPE)
                           ) -> List[Dict[str, Any]]:
  """All-gathers the sharded step did not ask for: any outside the embedding exchange's
  backward and the FP8 gradient all-reduce. The partitioner inserts such gathers when an
  activation must be replicated (an opaque kernel outside shard_map, a layout mismatch)."""
  return [g for g in all_gathers(hlo_text)
          if not any(scope in g["op_name"] for scope in allowed_scopes)]


def compiled_text(step: Callable, *args) -> str:
  return step.lower(*args).compile().as_text()
