"""Version shims: jax 0.10.x on the CPU machines (Python 3.11), 0.11.x on the GPU host."""
from __future__ import annotations

import contextlib

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


# The GPU the kernels are lowered for when no GPU is present: the GPU host's (compute
# capability 9.0, the same one jax 0.10 falls back to; FP8 casts in Triton need >= 8.9).
ABSTRACT_GPU_KIND = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def abstract_gpu(device_kind: str = ABSTRACT_GPU_KIND):
  """Traces under an abstract GPU, so Pallas Triton kernels can be lowered for 'cuda' without one.

  jax 0.10's Triton lowering falls back to compute capability 9.0 when no GPU is present;
  jax 0.11's (pallas/triton/pallas_call_registration.py: pallas_call_lowering ->
  gpu_info.get_gpu_info) takes it from the abstract mesh's AbstractDevice or the default
  device, and raises "No supported GPU devices found" on a CPU-only process. The mesh has no
  axes, so shardings are untouched. It must be active while tracing (`jit(f).trace(...)`): the
  lowering uses the abstract mesh captured then. A real GPU, if present, stays the target.
  """
  if jax.default_backend() == "gpu":
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield
