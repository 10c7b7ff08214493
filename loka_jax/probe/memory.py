"""Whether a probe's standing memory fits the card before anything compiles.

The probe holds the model's training state (parameters, optimizer state) and its statistics
(Welford moments, covariance factors, reservoirs) on the device for the whole run; the
training step's activations and the statistics pass's operands come on top. When those two
alone do not fit what JAX's allocator may take of the card (`bytes_limit`: 75% of its memory
by default, `XLA_PYTHON_CLIENT_MEM_FRACTION` sets it), the run cannot succeed and is stopped
at once; when they take most of it, the run is warned, since what comes on top may not fit
(Wukong `large` at batch 4096 holds 36.6 GB of training state and 18.7 GB of statistics; on
an H100, whose allocator takes about 63 GB, measuring its statistics pass ran out of memory).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax

from loka_jax.probe.options import ProbeSetupError

# Above this share of the allocator's limit the standing memory leaves little for the step.
WARN_SHARE = 0.8
# What lets JAX's allocator take more of the card, for any state that does not fit it.
MORE_OF_THE_CARD = "raise XLA_PYTHON_CLIENT_MEM_FRACTION (JAX takes 0.75 of the card by default)"
REMEDY = (f"{MORE_OF_THE_CARD} or shrink the statistics (ProbeConfig.reservoir_elements, "
          "max_full_width)")


def device_memory() -> Optional[Dict[str, int]]:
  """The first device's allocator statistics (`bytes_limit`, `bytes_in_use`, ...); None where
  the backend keeps none (the CPU)."""
  return jax.devices()[0].memory_stats()


def device_limit() -> Optional[Tuple[str, int]]:
  """(device kind, bytes JAX's allocator may take) of the first device; None where the
  backend does not say (the CPU)."""
  limit = (device_memory() or {}).get("bytes_limit")
  return (jax.devices()[0].device_kind, int(limit)) if limit else None


def standing_memory_note(state_bytes: int, statistics_bytes: int,
                         limit: Optional[Tuple[str, int]]) -> Optional[str]:
  """A warning when the training state and statistics take more than `WARN_SHARE` of the
  allocator's limit, None when they take less or the limit is unknown. Raises
  ProbeSetupError, saying what to change, when they exceed it."""
  if limit is None:
    return None
  device, limit_bytes = limit
  total = state_bytes + statistics_bytes
  share = total / limit_bytes
  said = (f"training state {state_bytes / 1e9:.1f} GB + statistics "
          f"{statistics_bytes / 1e9:.1f} GB = {total / 1e9:.1f} GB of the "
          f"{limit_bytes / 1e9:.1f} GB JAX may take of {device} ({share:.0%})")
  if share > 1:
    raise ProbeSetupError(f"the probe cannot fit: {said}; {REMEDY}")
  if share > WARN_SHARE:
    return (f"memory: {said}; the step's activations and the statistics pass come on top "
            f"and may not fit: if it runs out, {REMEDY}")
  return None
