"""Which registered kernels the probe evaluates, and which of them compute the same thing.

Default candidates: every kernel that can compute a plain site product (per-pass kernels and
fused ops with passes) and the fused-epilogue kernels (`ChainKernel`: GEMM + BlockNorm +
activation), except the fp32 reference arm (never faster than xla_bf16) and, on a CPU, the
Pallas kernels (interpret mode is slow; name them among the candidates to include them). A
fused-epilogue kernel is judged only at sites whose fused Mods chain has its epilogue
(`probe.chains`); at every other site it is unsupported, with the reason.
Kernels whose code for a pass is identical share one evaluation and one timing of that pass:
the XLA FP8 variants differ only in which passes accumulate fast, and the delayed-scaling fused
ops only in their backward (they share one timing of the forward).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from loka_jax import kernels as kernels_lib
from loka_jax.kernels.base import FUSED_OP, ChainKernel, Kernel

BASELINE = "xla_bf16"
REFERENCE_ARM = "xla_fp32"


def candidate_kernels(names: Optional[Sequence[str]] = None, platform: str = "cpu"
                      ) -> Tuple[List[Kernel], Dict[str, str]]:
  """(kernels to evaluate, {excluded name: why}); the baseline always comes first."""
  excluded: Dict[str, str] = {}
  if names:
    unknown = [n for n in names if n not in kernels_lib.names()]
    if unknown:
      raise ValueError(f"unknown kernel(s) {unknown}; registered: {', '.join(kernels_lib.names())}")
    chosen = [kernels_lib.get(n) for n in dict.fromkeys(names)]
    for k in chosen:
      if k.sort == FUSED_OP and not k.passes and not isinstance(k, ChainKernel):
        raise ValueError(f"kernel {k.name} computes no plain site product (it fuses an "
                         "epilogue); it cannot be probed per site")
    for n in kernels_lib.names():
      if n not in names:
        excluded[n] = "not among the named candidates"
  else:
    chosen = []
    for k in kernels_lib.all_kernels():
      if k.name == REFERENCE_ARM:
        excluded[k.name] = "fp32 reference arm: never faster than xla_bf16"
      elif k.sort == FUSED_OP and not k.passes and not isinstance(k, ChainKernel):
        excluded[k.name] = "computes no plain site product and no chain a site can run"
      elif k.backend.startswith("pallas_") and platform == "cpu":
        excluded[k.name] = ("Pallas kernel: interpret mode on the CPU is slow; name it among "
                            "the candidate kernels to include it")
      else:
        chosen.append(k)
  if BASELINE not in [k.name for k in chosen]:
    chosen.insert(0, kernels_lib.get(BASELINE))
    excluded.pop(BASELINE, None)
  chosen.sort(key=lambda k: (k.name != BASELINE, k.name))
  return chosen, excluded


def granularity_of(kernel: Kernel) -> Optional[str]:
  """The scaling granularity a kernel quantizes activations with (None: not FP8)."""
  if not kernel.fp8:
    return None
  if hasattr(kernel, "granularity"):
    return kernel.granularity
  mode = getattr(kernel, "mode", None)
  if mode == "blockwise":
    return "block_1x128"
  if mode == "rowwise":
    return "rowwise"
  if kernel.stateful:
    return "tensorwise"  # delayed scaling keeps one amax history per tensor
  return None
