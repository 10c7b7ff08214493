"""Device meshes: parse `data:N,model:M`, build a `jax.sharding.Mesh`, start multi-host JAX.

The mesh always has the two axes DATA and MODEL (a missing one has size 1): dense towers are
data-parallel over every device (the batch is split over both axes) and embedding tables are
row-sharded over MODEL (see embedding.py).
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)
BATCH_AXES = (DATA, MODEL)  # the batch of the dense towers is split over every device

# Multi-host settings, read from the environment when no flag gives them.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class MeshSpecError(ValueError):
  """A mesh spec ('data:2,model:2') that cannot describe this process's devices."""


def parse_mesh_spec(text: str) -> Tuple[Tuple[str, int], ...]:
  """'data:4,model:2' -> (('data', 4), ('model', 2)); a missing axis gets size 1."""
  if not isinstance(text, str) or not text.strip():
    raise MeshSpecError(f"empty mesh spec {text!r}; write e.g. 'data:2,model:1'")
  sizes = {}
  for part in text.split(","):
    name, sep, size = part.strip().partition(":")
    name = name.strip()
    if not sep:
      raise MeshSpecError(f"mesh spec {text!r}: {part!r} is not AXIS:SIZE "
                          f"(axes: {', '.join(AXES)}), e.g. 'data:2,model:2'")
    if name not in AXES:
      raise MeshSpecError(f"mesh spec {text!r}: unknown axis {name!r}; the axes are "
                          f"{', '.join(AXES)}")
    if name in sizes:
      raise MeshSpecError(f"mesh spec {text!r}: axis {name!r} is given twice")
    try:
      value = int(size)
    except ValueError:
      raise MeshSpecError(f"mesh spec {text!r}: size {size!r} of axis {name!r} is not an "
                          "integer") from None
    if value < 1:
      raise MeshSpecError(f"mesh spec {text!r}: axis {name!r} has size {value}; sizes are >= 1")
    sizes[name] = value
  return tuple((axis, sizes.get(axis, 1)) for axis in AXES)


def format_mesh_spec(mesh: Mesh) -> str:
  """The mesh spec text of `mesh`, e.g. 'data:2,model:2'."""
  return ",".join(f"{axis}:{mesh.shape[axis]}" for axis in AXES)


def build_mesh(spec: str, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """The (data, model) mesh of `spec` over `devices` (default: every device of every host).

  The product of the axis sizes must equal the number of devices: a mesh that leaves devices
  idle, or asks for more than exist, is an error naming both counts.
  """
  axes = parse_mesh_spec(spec)
  shape = tuple(size for _, size in axes)
  chosen = list(jax.devices() if devices is None else devices)
  if math.prod(shape) != len(chosen):
    raise MeshSpecError(
        f"mesh spec {spec!r} needs {math.prod(shape)} devices ({' x '.join(map(str, shape))}) "
        f"but {len(chosen)} are {'available' if devices is None else 'given'} "
        f"({chosen[0].platform}); make the sizes multiply to {len(chosen)}")
  if devices is None:
    # jax.make_mesh orders devices by the interconnect topology (NVLink islands, hosts).
    kwargs = {}
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:  # explicit Auto: shard_map and jit shardings, no typed sharding
      kwargs["axis_types"] = (axis_type.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, **kwargs)
  return Mesh(np.asarray(chosen, dtype=object).reshape(shape), AXES)


def default_mesh_spec(num_devices: Optional[int] = None) -> str:
  """Every device on the data axis: plain data parallelism, tables replicated."""
  return f"{DATA}:{num_devices or jax.device_count()},{MODEL}:1"


def distributed_settings(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                         process_id: Optional[int] = None,
                         env: Optional[Mapping[str, str]] = None):
  """(coordinator, num_processes, process_id) from the arguments or the JAX_* environment
  variables, or None for a single-host run; a partial setting is an error naming the rest."""
  env = os.environ if env is None else env
  coordinator = coordinator or env.get(ENV_COORDINATOR) or None
  if num_processes is None and env.get(ENV_NUM_PROCESSES):
    num_processes = int(env[ENV_NUM_PROCESSES])
  if process_id is None and env.get(ENV_PROCESS_ID):
    process_id = int(env[ENV_PROCESS_ID])
  given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
  if all(v is None for v in given.values()):
    return None
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise MeshSpecError(
        f"multi-host settings are incomplete: {', '.join(missing)} missing (set "
        f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}, or the flags, on every "
        "host)")
  if not 0 <= process_id < num_processes:
    raise MeshSpecError(f"process_id {process_id} is outside [0, {num_processes})")
  return coordinator, num_processes, process_id


def initialize_distributed(coordinator: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
  """Starts multi-host JAX when settings are given (before any other JAX call); True if so."""
  settings = distributed_settings(coordinator, num_processes, process_id)
  if settings is None:
    return False
  address, count, index = settings
  jax.distributed.initialize(coordinator_address=address, num_processes=count,
                             process_id=index)
  return True


def axis_size(name) -> int:
  """Static size of a mesh axis (or tuple of axes) inside shard_map."""
  names = name if isinstance(name, (tuple, list)) else (name,)
  size = getattr(jax.lax, "axis_size", None)
  return math.prod(size(n) if size else jax.lax.psum(1, n) for n in names)


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
  """`jax.shard_map` (jax >= 0.7) or the older `jax.experimental.shard_map`, with the
  replication check off: collectives here are explicit and their transposes hand-written."""
  new = getattr(jax, "shard_map", None)
  if new is not None:
    return new(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map as old  # pylint: disable=g-import-not-at-top
  return old(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
