"""Selection of fused-epilogue kernels (`probe.chains`): a site's whole chain in one kernel.

A fused-epilogue kernel replaces a site's choice (per-pass kernels, or a fused op) when the
report's site is a fused Mods layer with the kernel's epilogue (its entry's `chain`), it is
eligible, as a fused op is (`eligibility.assess_fused`: safe in every pass of its chain, and
the whole chain, forward and backward, faster than the bf16 chain by `min_speedup` at the
pessimistic end), and it saves more time than that choice: the bf16 chain's time less the
kernel's, against what the choice saves over bf16 (`eligibility.choice_savings_us`, both
pessimistic). The plan then names it in every pass, which `models.fused.FusedDenseNormAct`
runs as one kernel with its per-pass equivalent (`chains.backward_of`) for dgrad and wgrad.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

from loka_jax.kernels import PASSES, registry
from loka_jax.probe import chains, eligibility
from loka_jax.probe.eligibility import Criteria


def is_chain_kernel(name: str) -> bool:
  try:
    return chains.is_chain_kernel(registry.get(name))
  except KeyError:
    return False


def timed(kernel) -> bool:
  """Whether a report's timings of `kernel` are looked up per pass: a kernel of plain site
  passes, or a fused-epilogue kernel (timed on its chain)."""
  return bool(kernel.passes) or chains.is_chain_kernel(kernel)


def _sqnr(v) -> str:
  return "SQNR -" if v.sqnr_lo is None else f"{v.sqnr_lo:.1f} dB"


def consider_chains(out: Dict[str, Dict[str, Any]], site: Mapping, verdicts: Mapping,
                    criteria: Criteria) -> None:
  """Swaps the site's choice `out` ({pass: {"kernel", "reason", ...}}) for the eligible
  fused-epilogue kernel that saves the most, where it saves more (module docstring)."""
  passes = site["passes"]
  chain = site.get("chain") or {}
  # Only kernels of the site's own epilogue: a report claiming another is not believed.
  names = sorted(k for k in {k for ks in passes.values() for k in ks} if is_chain_kernel(k)
                 and chains.kernel_chain(registry.get(k)).epilogue == (
                     chain.get("block_size"), chain.get("activation"),
                     chain.get("quantize_output")))
  if not names:
    return
  current = eligibility.choice_savings_us(passes, {p: out[p]["kernel"] for p in PASSES})
  best = None
  for name in names:
    vs = [verdicts.get(p, {}).get(name) for p in PASSES]
    if not all(v is not None and v.eligible for v in vs):
      continue
    times = eligibility.site_times(passes, name)
    if times is None or current is None:
      continue
    saved = times[0] - times[1]
    if saved > current and (best is None or saved > best[1]):
      best = (name, saved, times)
  if best is None:
    return
  name, saved, (chain_us, kernel_us) = best
  for p in PASSES:
    v, e = verdicts[p][name], passes[p][name]
    out[p] = {"kernel": name,
              "reason": f"fused chain safe in every pass and faster: the chain {kernel_us:.1f} "
                        f"us vs bf16's {chain_us:.1f} us ({chain_us / kernel_us:.2f}x, "
                        f"pessimistic), saving {saved:.1f} us where the site's other choice "
                        f"saves {current:.1f} us; {p} {_sqnr(v)}",
              "speedup": e.get("speedup"), "timing": e.get("timing"),
              "sqnr_db_lo": v.sqnr_lo, "mere_hi": v.mere_hi, "underflow_hi": v.underflow_hi}
