"""The kernel registry: name -> Kernel. XLA kernels register on import; Pallas ones from
kernels_pallas/ (imported lazily so a missing Triton never breaks the XLA path)."""
from __future__ import annotations

import importlib
import logging
from typing import Dict, List

from loka_jax.kernels.base import Kernel

_REGISTRY: Dict[str, Kernel] = {}
_PLUGINS = ("kernels_pallas",)
_plugins_loaded = False


def register(kernel: Kernel, *, replace: bool = False) -> Kernel:
  if kernel.name in _REGISTRY and not replace:
    raise ValueError(f"kernel {kernel.name!r} is already registered")
  _REGISTRY[kernel.name] = kernel
  return kernel


def unregister(name: str) -> None:
  """Removes a kernel (test-only kernels must not outlive their test module)."""
  if _REGISTRY.pop(name, None) is None:
    raise KeyError(f"kernel {name!r} is not registered")


def _load_plugins() -> None:
  global _plugins_loaded
  if _plugins_loaded:
    return
  _plugins_loaded = True
  for module in _PLUGINS:
    try:
      importlib.import_module(module)
    except ImportError as e:  # Only a missing package is tolerated, never a broken kernel.
      if getattr(e, "name", None) != module:
        raise
      logging.info("kernel plugin %s not importable: %s", module, e)


def get(name: str) -> Kernel:
  _load_plugins()
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"unknown kernel {name!r}; registered: {', '.join(names())}") from None


def names() -> List[str]:
  _load_plugins()
  return sorted(_REGISTRY)


def quantizes(name: str, pass_name: str) -> bool:
  """Whether the registered kernel `name` runs `pass_name` in FP8 (`Kernel.quantizes`); False
  for a name not registered here (a plan or report from a checkout with other kernels)."""
  return name in _REGISTRY and get(name).quantizes(pass_name)


def all_kernels() -> List[Kernel]:
  return [get(n) for n in names()]
