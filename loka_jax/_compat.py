"""Version shims: jax 0.10.x on the CPU machines (Python 3.11), 0.11.x on the GPU host."""
from __future__ import annotations

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def make_mesh(axis_shapes, axis_names, devices=None):
  """jax.make_mesh with explicit axis types (their default changed between releases)."""
  kwargs = {}
  axis_type = getattr(jax.sharding, "AxisType", None)
  if axis_type is not None:
    kwargs["axis_types"] = (axis_type.Explicit,) * len(axis_names)
  if devices is not None:
    kwargs["devices"] = devices
  return jax.make_mesh(tuple(axis_shapes), tuple(axis_names), **kwargs)


def device_kind() -> str:
  """A filesystem-safe device kind, e.g. 'NVIDIA_H100_80GB_HBM3' or 'cpu'."""
  dev = jax.devices()[0]
  kind = dev.device_kind if dev.platform != "cpu" else "cpu"
  return "".join(c if c.isalnum() else "_" for c in kind)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def triton_compiler_params(num_warps: int, num_stages: int):
  """Pallas Triton backend compiler params (without them pallas_call lowers to Mosaic GPU)."""
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
