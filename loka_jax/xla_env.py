"""XLA flags our scripts set through `XLA_FLAGS`.

XLA reads `XLA_FLAGS` once, when JAX starts its first backend; a flag added after that is
ignored without a word. `add_xla_flags` refuses instead, so a script that sets one too late
fails at once rather than measuring without it.
"""
from __future__ import annotations

import os
# Deterministic GPU ops: scatter-adds (the embeddings' backward) in a fixed order, autotuning
# among deterministic algorithms only. Two runs of one program then match bit for bit. On an
# H200, two DCNv2 `large` training runs of the same seed, plan and recipe differ enough
# without it to flip a verdict of validation's check from initialization. It slows the
# embeddings' backward, so timed runs keep it off.
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
# cuBLAS for every GEMM fusion: XLA then autotunes no Triton GEMM configurations, which is
# most of the cold compile of a plan's FP8 step on an H200 (a faster start-up, a slightly
# slower step: RESULTS, "Speed where the user sees it").
NO_TRITON_GEMM = "--xla_gpu_enable_triton_gemm=false"


def add_xla_flags(*flags: str) -> str:
  """Appends `flags` to `XLA_FLAGS` and returns its new value.

  Raises:
    RuntimeError: JAX has started a backend in this process, so XLA would ignore them.
  """
  from jax._src import xla_bridge  # private, but stable across the jax releases we support
  if xla_bridge.backends_are_initialized():
    raise RuntimeError(f"XLA flags {' '.join(flags)} must be set before JAX starts its "
                       "backend (XLA reads XLA_FLAGS once); set them at the start of the "
                       "script, before any computation")
  value = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), *flags) if f).strip()
  os.environ["XLA_FLAGS"] = value
  return value


def in_effect(flag: str) -> bool:
  """Whether `XLA_FLAGS` holds `flag` (name and value, as written)."""
  return flag in os.environ.get("XLA_FLAGS", "").split()


def autotune_flag(path: str) -> str:
  """The flag that persists XLA's GPU autotuning in `path`: load it when it exists, so a later
  process compiles with the first one's choices, else dump to it."""
  return (f"--xla_gpu_load_autotune_results_from={path}" if os.path.exists(path)
          else f"--xla_gpu_dump_autotune_results_to={path}")
