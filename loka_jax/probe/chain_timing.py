"""Timings of the fused-epilogue kernels (`probe.chains`), beside every other kernel's.

A fused-epilogue kernel is timed in context: the whole chain (GEMM, bias, BlockNorm,
activation) forward alone, and forward and backward as one vjp call (both gradients), in one
interleaving with the bf16 chain timed the same two ways (`chains.bf16_chain`: XLA's bf16
product, then the epilogue in jnp), on the site's shapes with random normal operands and no
bias. The cache and the committed tables file them like any kernel's, the backward under
both gradient passes with `time_scope` "grad_lhs+grad_rhs" as a fused op's, and the bf16
chain under `baseline_name(kernel)`; every speedup of the kernel is over that bf16 chain, so
`eligibility.site_times` of the kernel reads the whole chain, forward and backward.

`measure_site`, `site_timings` and `table_timings` take what `kernel_timing`'s take and hand
every other kernel to them.
"""
from __future__ import annotations

from typing import Dict, List, Mapping

import jax
import jax.numpy as jnp

from loka_jax.kernels import PASSES
from loka_jax.probe import chains, kernel_timing, timing_table
from loka_jax.probe.candidates import BASELINE
from loka_jax.probe.eligibility import FUSED_SCOPE

SPEEDUP_VS = "the bf16 chain (XLA's product, BlockNorm, activation), forward and backward"


def baseline_name(kernel_name: str) -> str:
  """The name the bf16 chain of a fused-epilogue kernel's epilogue is filed under."""
  return f"{BASELINE}_chain:{kernel_name}"


def _split(kernels):
  chained = [k for k in kernels if chains.is_chain_kernel(k)]
  return chained, [k for k in kernels if not chains.is_chain_kernel(k)]


def _passes(kernel, unsupported: Mapping[str, Mapping[str, str]]) -> List[str]:
  return [p for p in PASSES if kernel.name not in unsupported.get(p, {})]


def _key(name: str, layout, pass_name: str, dtype: str) -> str:
  return kernel_timing.cache_key(name, pass_name, *kernel_timing.pass_problem(layout, pass_name),
                                 dtype)


def _variants(fn, layout, dtype, backward: bool) -> Dict[str, tuple]:
  x, w, g = kernel_timing._operands((layout.lhs.shape, layout.rhs.shape, layout.grad.shape),
                                    dtype, seed=2)

  def fwdbwd(a, b, dy):
    out, vjp = jax.vjp(fn, a, b)
    return vjp(dy.astype(out.dtype))

  out = {"fwd": (fn, [x, w])}
  if backward:
    out[kernel_timing.FUSED_BWD] = (fwdbwd, [x, w, g])
  return out


def _measure_chains(layout, kernels, dtype: str, cache, unsupported, repeats: int,
                    compile_workers: int) -> List[Dict]:
  todo = []
  for kernel in kernels:
    passes = _passes(kernel, unsupported)
    names = (kernel.name, baseline_name(kernel.name))
    if passes and any(cache.get(_key(n, layout, p, dtype), kernel.revision) is None
                      for n in names for p in passes):
      todo.append((kernel, passes))
  if not todo:
    return []
  jdt = jnp.dtype(dtype)
  variants: Dict[str, tuple] = {}
  for kernel, passes in todo:
    chain = chains.kernel_chain(kernel)
    fns = {kernel.name: lambda a, b, k=kernel, c=chain: chains.run(k, a, b, c, jdt),
           baseline_name(kernel.name): lambda a, b, c=chain: chains.bf16_chain(a, b, c, jdt)}
    for name, fn in fns.items():
      for part, variant in _variants(fn, layout, jdt, passes != ["fwd"]).items():
        variants[f"{name}|{part}"] = variant
  flops = layout.spec.flops(layout.lhs.shape, layout.rhs.shape)
  measured = kernel_timing._time_interleaved(variants, repeats=repeats,
                                             short=flops < kernel_timing.SHORT_FLOPS,
                                             compile_workers=compile_workers)
  entries = []
  for kernel, passes in todo:
    for name in (kernel.name, baseline_name(kernel.name)):
      for p in passes:
        spec, a, b = kernel_timing.pass_problem(layout, p)
        m = measured[f"{name}|{'fwd' if p == 'fwd' else kernel_timing.FUSED_BWD}"]
        e = (kernel_timing._error_entry(name, p, spec, a, b, dtype, m["error"]) if "error" in m
             else kernel_timing._entry(name, p, spec, a, b, dtype, m["seconds"], m["backend"],
                                       m["inner"], m["unroll"],
                                       None if p == "fwd" else FUSED_SCOPE, m.get("floor_us")))
        e["revision"] = kernel.revision
        cache.put(kernel_timing.cache_key(name, p, spec, a, b, dtype), e)
        entries.append(e)
  cache.save()
  return entries


def measure_site(layout, kernels, dtype: str, cache, *,
                 unsupported: Mapping[str, Mapping[str, str]], repeats: int = 20,
                 compile_workers: int = 1) -> List[Dict]:
  """`kernel_timing.measure_site`, the fused-epilogue kernels timed on their chains beside
  the bf16 chain (each with its own, in one interleaving)."""
  chained, others = _split(kernels)
  entries = kernel_timing.measure_site(layout, others, dtype, cache, unsupported=unsupported,
                                       repeats=repeats, compile_workers=compile_workers)
  return entries + _measure_chains(layout, chained, dtype, cache, unsupported, repeats,
                                   compile_workers)


def site_timings(layout, kernels, dtype: str, cache, *,
                 unsupported: Mapping[str, Mapping[str, str]], source: str = "measured"
                 ) -> Dict[str, Dict[str, Dict]]:
  """`kernel_timing.site_timings`, the fused-epilogue kernels' speedups over the bf16 chain."""
  chained, others = _split(kernels)
  out = kernel_timing.site_timings(layout, others, dtype, cache, unsupported=unsupported,
                                   source=source)
  for kernel in chained:
    for p in _passes(kernel, unsupported):
      e = cache.get(_key(kernel.name, layout, p, dtype), kernel.revision)
      base = cache.get(_key(baseline_name(kernel.name), layout, p, dtype), kernel.revision)
      if not kernel_timing.usable(e):
        info = {"time_us": None, "speedup": None, "backend": None,
                "timing": "missing" if e is None else "failed"}
        if e is not None:
          info["timing_error"] = e["error"]
      else:
        lo, hi = e["ci_us"]
        info = {"time_us": [lo, e["median_us"], hi], "backend": e["backend"], "timing": source,
                "speedup": None, "speedup_vs": SPEEDUP_VS}
        if p != "fwd":
          info["time_scope"] = FUSED_SCOPE
        if kernel_timing.usable(base):
          info["speedup"] = kernel_timing._speedup(base, e)
          info["baseline_us"] = [base["ci_us"][0], base["median_us"], base["ci_us"][1]]
        kernel_timing.mark_unresolved(info, kernel_timing.unresolved_reason(
            layout, p, e["median_us"], base["median_us"] if kernel_timing.usable(base) else None,
            whole_backward=p != "fwd", chained=e.get("unroll", 1) > 1))
      out.setdefault(p, {})[kernel.name] = info
  return out


def table_timings(layout, kernels, dtype: str, table: Mapping, *,
                  unsupported: Mapping[str, Mapping[str, str]]) -> Dict[str, Dict[str, Dict]]:
  """`kernel_timing.table_timings`, the fused-epilogue kernels' from their entries beside the
  bf16 chain's (entries of another revision left out)."""
  chained, others = _split(kernels)
  out = kernel_timing.table_timings(layout, others, dtype, table, unsupported=unsupported)
  for kernel in chained:
    names = (kernel.name, baseline_name(kernel.name))
    mine = {**table, "entries": [e for e in table["entries"] if e["kernel"] in names
                                 and e.get("revision", 1) == kernel.revision]}
    for p in _passes(kernel, unsupported):
      spec, a, b = kernel_timing.pass_problem(layout, p)
      hit = timing_table.lookup(mine, kernel.name, p, spec, a, b, dtype, baseline=names[1])
      if hit is None:
        info = {"time_us": None, "speedup": None, "backend": None, "timing": "missing"}
      else:
        lo, hi = hit["ci_us"]
        info = {"time_us": [lo, hit["time_us"], hi], "speedup": hit["speedup_range"],
                "backend": hit["backend"], "speedup_vs": SPEEDUP_VS,
                "timing": "estimated" if hit["estimated"] else "table"}
        if hit["estimated"]:
          info["estimated_from"] = hit["from"]
        if p != "fwd":
          info["time_scope"] = FUSED_SCOPE
        kernel_timing.mark_unresolved(info, kernel_timing.unresolved_reason(
            layout, p, None, None, whole_backward=p != "fwd", chained=False))
      out.setdefault(p, {})[kernel.name] = info
  return out


def exact_baseline(kernel_name: str) -> str:
  """The baseline a committed entry of `kernel_name` is timed beside (`timing_needs`)."""
  from loka_jax.kernels import registry
  return (baseline_name(kernel_name) if chains.is_chain_kernel(registry.get(kernel_name))
          else BASELINE)
