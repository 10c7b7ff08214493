"""Pallas API shims (jax 0.10 on CPU machines, 0.11 on the GPU host) and the interpret switch."""
from __future__ import annotations

import contextlib
import contextvars
import os

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from loka_jax import _compat

# `dot` lives in the Triton module on 0.11 (it left `pl`); 0.10 has it in both.
dot = getattr(pltriton, "dot", None) or getattr(pl, "dot")
# Masked loads/stores: the only way to keep tail tiles in bounds on the Triton backend.
load = pltriton.load
store = pltriton.store


_FORCE_COMPILED = contextvars.ContextVar("loka_pallas_force_compiled", default=False)


def use_interpret() -> bool:
  """Interpret mode on the CPU (tests, CI); compiled Triton kernels on a GPU."""
  return jax.default_backend() == "cpu" and not _FORCE_COMPILED.get()


_TRACER = getattr(jax.core, "Tracer", None)


def concrete(*values) -> bool:
  """Whether none of `values` is a tracer: only eager (concrete) calls can feed the tile
  tuner, which runs the kernel."""
  return _TRACER is not None and not any(isinstance(x, _TRACER) for x in values)


def mosaic_interpret():
  """GPU interpret-mode parameters for Mosaic GPU kernels on the CPU (None: compile them).

  jax's GPU interpret mode simulates shared memory, TMA copies, barriers and wgmma on the
  CPU; its parameters class is not exported by `jax.experimental.pallas.mosaic_gpu`."""
  if not use_interpret():
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


@contextlib.contextmanager
def compiled_kernels():
  """Traces Pallas kernels compiled (Triton or Mosaic GPU) even on the CPU, e.g. to lower them
  for 'cuda' (checks their lowering without a GPU); running them then needs a GPU."""
  token = _FORCE_COMPILED.set(True)
  try:
    yield
  finally:
    _FORCE_COMPILED.reset(token)


def compiler_params(num_warps: int, num_stages: int):
  """Triton compiler params; without them pallas_call would lower to Mosaic GPU."""
  return _compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- FP8 dot accumulation

ENV_IMPRECISE_ACC = "LOKA_PALLAS_FP8_IMPRECISE_ACC"
_IMPRECISE_ACC = contextvars.ContextVar("loka_pallas_fp8_imprecise_acc", default=None)


def fp8_imprecise_acc() -> int:
  """How many K elements an FP8 Pallas dot may accumulate at the tensor core's own precision
  before promoting the partial sum to f32; 0 (the default) promotes at every step.

  jax's Pallas Triton lowering leaves Triton's `maxNumImpreciseAcc` at 0, and Triton only picks
  Hopper's FP8 wgmma for a dot with an f32 accumulator when it is >= 32: every Pallas FP8 GEMM
  then runs f16 `mma.sync` on upcast operands (read from the compiled kernels on an H200). A value
  of 32 or more (e.g. 128, or 2**30 for Triton's own `tl.dot` default) lets Triton use wgmma,
  trading accumulation precision for speed: the probe measures that error like any kernel's.
  Set it with $LOKA_PALLAS_FP8_IMPRECISE_ACC or `fp8_accumulation(n)`; it applies to kernels
  lowered while it is set (a function already compiled keeps its kernels).
  """
  value = _IMPRECISE_ACC.get()
  if value is None:
    raw = os.environ.get(ENV_IMPRECISE_ACC, "0").strip() or "0"
    try:
      value = int(raw)
    except ValueError:
      raise ValueError(f"${ENV_IMPRECISE_ACC}={raw!r} is not an integer") from None
  if value < 0:
    raise ValueError(f"FP8 imprecise accumulation must be >= 0 K elements, got {value}")
  return value


@contextlib.contextmanager
def fp8_accumulation(max_num_imprecise_acc: int):
  """Lowers the Pallas FP8 dots traced inside with this `maxNumImpreciseAcc`."""
  if max_num_imprecise_acc < 0:
    raise ValueError(f"max_num_imprecise_acc must be >= 0, got {max_num_imprecise_acc}")
  install_fp8_dot_hook()
  token = _IMPRECISE_ACC.set(int(max_num_imprecise_acc))
  try:
    yield
  finally:
    _IMPRECISE_ACC.reset(token)


def install_fp8_dot_hook() -> None:
  """Routes the Triton dialect's `tt.dot` builder through `fp8_imprecise_acc()` (idempotent).

  The hook adds the attribute only to dots of 8-bit float operands and only while the setting
  is non-zero, so every other Triton dot, and every FP8 dot by default, lowers as before.
  """
  from jax._src.pallas.triton import lowering as triton_lowering  # the builder jax calls
  dialect = triton_lowering.tt_dialect
  if getattr(dialect.dot, "_loka_hook", False):
    return
  build = dialect.dot

  def dot(a, b, c, **kwargs):
    n = fp8_imprecise_acc()
    if n and kwargs.get("max_num_imprecise_acc") is None and _is_fp8(a):
      kwargs["max_num_imprecise_acc"] = n
    return build(a, b, c, **kwargs)

  dot._loka_hook = True
  dialect.dot = dot


def _is_fp8(value) -> bool:
  from jax._src.lib.mlir import ir
  return str(ir.RankedTensorType(value.type).element_type).startswith("f8")


def triton_modules(fn, *args):
  """[(Triton IR text, grid size)] of every Pallas Triton kernel in `fn(*args)`, lowered for
  'cuda' without running (no GPU needed; args may be ShapeDtypeStructs). For inspecting what
  Triton receives: tile shapes, the dot's attributes, the grid."""
  from jax._src.pallas.triton import lowering as triton_lowering
  captured = []
  lower = triton_lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    result = lower(*a, **k)
    captured.append(result)
    return result

  triton_lowering.lower_jaxpr_to_triton_module = capture
  try:
    for _ in range(2):  # a cached lowering calls nothing: clear the caches and retry once
      with compiled_kernels(), _compat.abstract_gpu():
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
      if captured:
        break
      jax.clear_caches()
  finally:
    triton_lowering.lower_jaxpr_to_triton_module = lower
  out = []
  for result in captured:
    grid = 1
    for g in result.grid:
      grid *= int(g)
    out.append((result.module.operation.get_asm(), grid))
  return out
