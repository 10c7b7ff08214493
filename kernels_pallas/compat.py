"""Pallas API shims (jax 0.10 on CPU machines, 0.11 on the GPU host) and the interpret switch."""
from __future__ import annotations

import contextlib
import contextvars

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


@contextlib.contextmanager
def compiled_kernels():
  """Traces kernels for the Triton backend even on the CPU, e.g. to lower them for 'cuda'
  (checks the Triton lowering without a GPU); running them then needs a GPU."""
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
