"""Per-site kernel timings on the actual device, following the benchmark protocol.

All kernels and passes of one site shape (spec, lhs shape, rhs shape) form one interleaved
group with the xla_bf16 baseline, timed with quantization and scaling included, on random
normal operands (never zeros). Short products run as a chain of UNROLL calls in one program
on a GPU (`timing.ChainSampler`: each call's operands depend on the previous result, and the
same chain of a one-element call, the floor, is timed beside it and subtracted); the backend
is read from the compiled HLO. Results are cached on disk per device kind, keyed by (kernel,
pass, spec, shapes, dtype): a rerun measures only what is missing, and kernels that run
identical code for a pass share one measurement. A speedup no timing resolves (K = 1; a
chained call under MIN_RESOLVED_US) is `unresolved`. Caches side by side: `timing_caches`.

Fused-op kernels (Flax's delayed scaling) own all passes: their forward is timed alone and
their backward as one vjp call returning both gradients (XLA drops the unused forward
product; the quantization the backward needs stays in: an upper bound), reported under both
gradient passes with `"time_scope": "grad_lhs+grad_rhs"`. It is compared with the baseline's
backward timed the same way, one vjp call, in the same interleaving (cache pass
`grad_lhs+grad_rhs`, `baseline_bwd_key`): the baseline's two gradient passes timed apart each
pay a call's fixed cost and share nothing: against them the delayed forward's bf16 backward
read 1.28-1.61x faster than bf16's at DHEN `small`'s 48 sites, against bf16's one-call
backward 0.89-1.04x (H200).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax import _compat, jsonio
from loka_jax import timing as timing_lib
from loka_jax.kernels import FUSED_OP, PASSES, EinsumSpec, registry
from loka_jax.kernels.backend import backend_from_hlo
from loka_jax.kernels.flax_delayed import FP8_META, merge_fp8_meta
from loka_jax.probe.candidates import BASELINE
from loka_jax.probe.eligibility import FUSED_SCOPE, UNRESOLVED
from loka_jax.probe import timing_table
from loka_jax.probe.layout import SiteLayout

CACHE_SCHEMA = "loka.timing_cache/1"
FUSED_BWD = "fwdbwd"


class TimingCacheError(ValueError):
  """An unreadable timing cache file (the message says which and what to do)."""


def pass_problem(layout: SiteLayout, pass_name: str):
  """(pass spec, a shape, b shape) of one pass at the site's full shapes."""
  a, b = layout.pass_operands(pass_name)
  return (str(layout.spec.for_pass(pass_name)), layout.operand(a).shape,
          layout.operand(b).shape)


def cache_key(kernel: str, pass_name: str, spec: str, lhs_shape, rhs_shape, dtype: str) -> str:
  return json.dumps([kernel, pass_name, spec, list(lhs_shape), list(rhs_shape), dtype])


def baseline_bwd_key(layout: SiteLayout, dtype: str) -> str:
  """Cache key of the baseline's backward timed as one call (keyed by the grad_lhs problem)."""
  spec, a, b = pass_problem(layout, "grad_lhs")
  return cache_key(BASELINE, FUSED_SCOPE, spec, a, b, dtype)


class TimingCache:
  """JSON file of measured timings for one device kind (atomic writes)."""

  def __init__(self, path: str, device_kind: str):
    self.path = path
    self.device_kind = device_kind
    self.entries: Dict[str, Dict] = {}
    if os.path.exists(path):
      try:
        with open(path) as f:
          data = json.load(f)
      except json.JSONDecodeError as e:
        raise TimingCacheError(f"timing cache {path} is not valid JSON ({e}); delete it to "
                         "measure again") from e
      if data.get("schema") != CACHE_SCHEMA or data.get("device_kind") != device_kind:
        raise TimingCacheError(f"timing cache {path} holds {data.get('schema')!r} for "
                         f"{data.get('device_kind')!r}; expected {CACHE_SCHEMA!r} for "
                         f"{device_kind!r}")
      self.entries = dict(data.get("entries", {}))

  def get(self, key: str, revision: int = 1) -> Optional[Dict]:
    """The entry, or None when missing or stale, so it is measured again: timed for another
    `revision` of its kernel (the kernel's computation changed; entries from before
    revisions count as 1), or a product timed as several calls a sample before `LOOP` (no
    `loop`): its calls passed through optimization barriers XLA removed, so its time is short
    by up to the calls lost."""
    entry = self.entries.get(key)
    if entry is None or entry.get("revision", 1) != revision:
      return None
    if entry.get("inner", 1) > 1 and entry.get("loop") != LOOP:
      return None
    return entry

  def put(self, key: str, entry: Dict) -> None:
    self.entries[key] = entry

  def save(self) -> None:
    jsonio.write_json_atomic(self.path, {"schema": CACHE_SCHEMA, "device_kind": self.device_kind,
                                         "entries": self.entries}, indent=None)


def default_cache_path(directory: str, device_kind: str) -> str:
  safe = "".join(c if c.isalnum() else "_" for c in device_kind)
  return os.path.join(directory, f"{safe}.json")


# ----------------------------------------------------------------------------- variants


# Calls of a short product chained per dispatch (one call a device-loop iteration floored
# every product at DCNv2 `small`'s shapes at ~30 us on the H200; a fused op's backward, both
# gradients in one call, then looked up to 1.6x faster than the baseline's two gradient
# passes there). One call on a CPU (`loop_unroll`).
UNROLL = timing_lib.UNROLL


# How a sample of several calls was timed, recorded in every such entry: `one_chain` = a short
# product's sample is one straight-line chain of calls whose operands depend on the previous
# result (`timing.depend_on`), less the same chain of `timing.floor_fn`; a long product's,
# single calls back to back. Entries without it (or with another value) are measured again:
# the first kind passed operands through optimization barriers, which XLA removed (on the
# H200 16 unrolled calls of a [16384,4096]x[4096,4096] bf16 product ran as one), and `chain`
# subtracted several chains' floors, which undercut kernels of 1.5-3 us by 36-96%.
LOOP = "one_chain"


def _operands(shapes: Sequence[Tuple[int, ...]], dtype, seed: int):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return [timing_lib.random_normal(k, s, dtype) for k, s in zip(keys, shapes)]


def _per_pass_variant(kernel, layout: SiteLayout, pass_name: str, dtype):
  spec, a_shape, b_shape = pass_problem(layout, pass_name)
  parsed = EinsumSpec.parse(spec)
  fn = lambda a, b: kernel.einsum(parsed, a, b, pass_name=pass_name, out_dtype=dtype)
  return fn, _operands((a_shape, b_shape), dtype, seed=1)


def _fused_variants(kernel, layout: SiteLayout, dtype):
  """{'fwd': (fn, args), FUSED_BWD: (fn, args)} with state warmed on the same operands."""
  spec = str(layout.spec)
  lhs, rhs, grad = _operands((layout.lhs.shape, layout.rhs.shape, layout.grad.shape), dtype, 2)
  module = kernel.make_module(name=None)
  variables = module.init(jax.random.PRNGKey(0), spec, lhs, rhs)
  apply = lambda v, a, b: module.apply(v, spec, a, b)
  for _ in range(3):  # delayed scaling starts at scale 1: warm its state first
    out, vjp = jax.vjp(apply, variables, lhs, rhs)
    d_vars, _, _ = vjp(grad.astype(out.dtype))
    variables = {FP8_META: merge_fp8_meta(d_vars[FP8_META])}

  def fwdbwd(v, a, b, g):
    out, vjp = jax.vjp(lambda x, y: apply(v, x, y), a, b)
    return vjp(g.astype(out.dtype))

  return {"fwd": (apply, [variables, lhs, rhs]), FUSED_BWD: (fwdbwd, [variables, lhs, rhs, grad])}


def _baseline_bwd_variant(kernel, layout: SiteLayout, dtype):
  """(fn, args): the baseline's two gradients from one vjp call, as a fused op's backward is
  timed (`_fused_variants`), on the same operands. The baseline's product is the plain one JAX
  differentiates (`site_product.per_pass_product` builds the bf16 site the same way)."""
  lhs, rhs, grad = _operands((layout.lhs.shape, layout.rhs.shape, layout.grad.shape), dtype, 2)
  product = lambda a, b: kernel.einsum(layout.spec, a, b, pass_name="fwd", out_dtype=dtype)

  def bwd(a, b, g):
    out, vjp = jax.vjp(product, a, b)
    return vjp(g.astype(out.dtype))

  return bwd, [lhs, rhs, grad]


# Site products of fewer FLOPs are short on any GPU (under 30 us at H100's bf16 peak): a
# sample is one chain of UNROLL calls less its floor. Longer products are dispatched one call
# at a time, back to back, which keeps the device busy without touching their operands. On
# the H200 (2026-11-27, against the profiler's kernel times): one chain read
# [4096,1024]x[1024,1024] 16.4-16.6 us (kernel 12.6-13.5 us) and kernels of 1.5-3 us 10-170%
# long; 20 ms of single calls back to back read 808 us for
# [16384,4096]x[4096,4096] (795-798 us back to back unblocked) and 99.9 us for
# [8192,2048]x[2048,2048] (kernel 86-91 us), where one blocked call had read 983 us.
SHORT_FLOPS = 1e10
LONG_SAMPLE_SECONDS = 0.02


def _compile_ahead(variants: Mapping[str, Tuple[Callable, Sequence]], calls: int,
                   workers: int) -> Dict[str, object]:
  """{name: `timing.compile_chain`'s executables, or the exception its compile raised}, the
  compiles spread over `workers` threads; {} for one worker (each sampler compiles its own,
  in turn). Nearly all of a shape's timing is compiles: 46 kernel passes of DCNv2 `large`'s
  4096x13 . 13x1024 took 114 s on the H200, where their samples are 20 chains of
  microsecond kernels each. The GPU autotunes each compile's GEMMs on the device, and
  compiles run side by side autotune against each other's measurements: with 8 workers on
  an H200 XLA's autotuner timed out in its delay kernel and every kernel then read slower
  (median 1.068x), so the default is one worker
  and more are for compiles that do not autotune (the CPU)."""
  if workers <= 1 or not variants:
    return {}
  with concurrent.futures.ThreadPoolExecutor(min(workers, len(variants)),
                                             thread_name_prefix="loka-timing-compile") as pool:
    futures = {name: pool.submit(timing_lib.compile_chain, fn, args, calls)
               for name, (fn, args) in variants.items()}
  out = {}  # (leaving the pool waited for every compile)
  for name, future in futures.items():
    error = future.exception()
    out[name] = error if error is not None else future.result()
  return out


def _time_interleaved(variants: Mapping[str, Tuple[Callable, Sequence]], *, repeats: int,
                      warmup: int = 3, min_call_seconds: float = 1e-3, max_inner: int = 1000,
                      short: bool = False, compile_workers: int = 1) -> Dict[str, Dict]:
  """{name: {'seconds': per-call seconds [repeats], 'inner', 'backend', 'unroll',
  'floor_us'}}, interleaved. `short` (`SHORT_FLOPS`): a sample is one chain of
  `timing.loop_unroll()` calls less its floor (`timing.ChainSampler`), since one short call a
  dispatch would time the host's dispatch, not the kernel. One dispatch, not several back to
  back: the floor's chain of one-element kernels is bound by the host's launches where the
  product's is bound by the device, so subtracting several of them undercut kernels of 1.5-3
  us by 36-96% on the H200, where one dispatch overstates them by 10-170%: the conservative
  side, which shrinks a speedup rather than inventing one. Otherwise single calls dispatched
  back to back, as many as fill LONG_SAMPLE_SECONDS (at least LONG_DISPATCHES), so a
  dispatch's latency (200-300 us from call to result on the H200) is shared by enough device
  time. Where nothing is chained (`loop_unroll()` is 1: a CPU) a short product's sample is
  one device loop of as many calls as fill `min_call_seconds` (`ChainSampler.set_calls`).
  `compile_workers` > 1 compiles every variant first, that many at a time (`_compile_ahead`);
  the timing itself is the same either way."""
  platform = jax.default_backend()
  calls = timing_lib.loop_unroll() if short else 1
  ahead = _compile_ahead(variants, calls, compile_workers)
  prepared, failed = {}, {}
  for name, (fn, args) in variants.items():
    try:
      built = ahead.get(name)
      if isinstance(built, BaseException):
        raise built
      sampler = timing_lib.ChainSampler(fn, args, calls, warmup, executables=built)
      backend = backend_from_hlo(sampler.compiled.as_text(), platform)
      if short and sampler.calls == 1:  # nothing to chain (a CPU): one loop of calls
        sampler.set_calls(timing_lib.calls_for(sampler.one_dispatch, min_call_seconds,
                                               max_inner))
      elif not short:
        sampler.dispatches = max(timing_lib.LONG_DISPATCHES, timing_lib.calls_for(
            sampler.one_dispatch, LONG_SAMPLE_SECONDS, max_inner))
    except Exception as e:  # a kernel that fails to build or run is reported, not timed
      failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
      continue
    prepared[name] = (sampler, backend)
  samples = {name: [] for name in prepared}
  for name in timing_lib.interleaved(prepared, repeats):
    samples[name].append(prepared[name][0].sample())
  out = {name: {"seconds": samples[name], "inner": sampler.inner, "backend": backend,
                "unroll": sampler.unroll, "floor_us": sampler.floor_us}
         for name, (sampler, backend) in prepared.items()}
  out.update({name: {"error": message} for name, message in failed.items()})
  return out


def _entry(kernel: str, pass_name: str, spec: str, a_shape, b_shape, dtype: str,
           seconds: Sequence[float], backend: str, inner: int, unroll: int,
           scope: Optional[str] = None, floor_us: Optional[float] = None) -> Dict:
  t = timing_lib.Timing(kernel, np.asarray(seconds, np.float64), inner)
  lo, hi = t.ci_us(np.random.default_rng(0))
  entry = {"kernel": kernel, "pass": pass_name, "spec": spec, "lhs_shape": list(a_shape),
           "rhs_shape": list(b_shape), "dtype": dtype, "median_us": t.median_us,
           "ci_us": [lo, hi], "seconds": [float(s) for s in seconds], "repeats": len(seconds),
           "inner": inner, "unroll": unroll, "backend": backend, "jax": jax.__version__,
           "date": datetime.date.today().isoformat()}
  if inner > 1:  # floor_us: the chain's own time per call, already out of `seconds`
    entry.update(loop=LOOP, floor_us=floor_us)
  if scope:
    entry["time_scope"] = scope
  return entry


# ----------------------------------------------------------------------------- per site


def _site_keys(layout: SiteLayout, kernels, dtype: str, unsupported) -> Dict[Tuple, str]:
  """{(kernel, pass): cache key} of every (kernel, pass) this site needs."""
  keys = {}
  for kernel in kernels:
    for p in PASSES:
      if kernel.name in unsupported.get(p, {}):
        continue
      spec, a, b = pass_problem(layout, p)
      keys[(kernel.name, p)] = cache_key(kernel.name, p, spec, a, b, dtype)
  return keys


def measure_site(layout: SiteLayout, kernels, dtype: str, cache: TimingCache, *,
                 unsupported: Mapping[str, Mapping[str, str]], repeats: int = 20,
                 compile_workers: int = 1) -> List[Dict]:
  """Times every (kernel, pass) of this site shape missing from `cache` (and the baseline,
  again, whenever something is measured; with the fused ops, the baseline's one-call
  backward); returns the new entries. `compile_workers`: threads compiling the shape's
  programs before any is timed (`_time_interleaved`)."""
  keys = _site_keys(layout, kernels, dtype, unsupported)
  by_name = {k.name: k for k in kernels}
  fused = sorted({name for name, _ in keys if by_name[name].sort == FUSED_OP})
  bwd_key = baseline_bwd_key(layout, dtype) if fused and BASELINE in by_name else None
  missing = [kp for kp, key in keys.items()
             if cache.get(key, by_name[kp[0]].revision) is None]
  if bwd_key is not None and cache.get(bwd_key, by_name[BASELINE].revision) is None:
    # A fused op timed before its baseline backward was: time it again beside that backward.
    missing += [kp for kp in keys if kp[0] in fused and kp not in missing]
  if not missing:
    return []
  jdt = jnp.dtype(dtype)
  variants: Dict[str, Tuple] = {}
  first_of: Dict[Tuple, str] = {}
  alias: Dict[Tuple[str, str], str] = {}
  wanted = set(missing) | {(BASELINE, p) for p in PASSES if (BASELINE, p) in keys}
  for name, p in sorted(wanted, key=lambda kp: (kp[0] != BASELINE, kp)):
    kernel = by_name[name]
    if kernel.sort == FUSED_OP:
      if f"{name}|{FUSED_BWD}" not in variants:
        ops = _fused_variants(kernel, layout, jdt)
        variants[f"{name}|{FUSED_BWD}"] = ops[FUSED_BWD]
        ck = kernel.pass_numerics("fwd")
        if ck in first_of:  # the same forward as a fused op timed here already
          alias[(name, "fwd")] = first_of[ck]
        else:
          first_of[ck] = f"{name}|fwd"
          variants[f"{name}|fwd"] = ops["fwd"]
      continue
    ck = kernel.pass_numerics(p)
    if ck in first_of:
      alias[(name, p)] = first_of[ck]
      continue
    first_of[ck] = f"{name}|{p}"
    variants[f"{name}|{p}"] = _per_pass_variant(kernel, layout, p, jdt)
  time_bwd = bwd_key is not None and any(name in fused for name, _ in wanted)
  if time_bwd:
    variants[f"{BASELINE}|{FUSED_BWD}"] = _baseline_bwd_variant(by_name[BASELINE], layout, jdt)
  flops = layout.spec.flops(layout.lhs.shape, layout.rhs.shape)
  measured = _time_interleaved(variants, repeats=repeats, short=flops < SHORT_FLOPS,
                               compile_workers=compile_workers)
  entries = []
  for name, p in sorted(wanted):
    kernel = by_name[name]
    spec, a, b = pass_problem(layout, p)
    fwd_source = alias.get((name, "fwd"), f"{name}|fwd")
    sources = ([fwd_source, f"{name}|{FUSED_BWD}"] if kernel.sort == FUSED_OP
               else [alias.get((name, p), f"{name}|{p}")])
    errors = [measured[v]["error"] for v in sources if "error" in measured[v]]
    if errors:
      entries.append(_error_entry(name, p, spec, a, b, dtype, errors[0]))
      continue
    if kernel.sort == FUSED_OP:
      fwd = measured[fwd_source]
      if p == "fwd":
        m, scope = fwd, None
      else:
        # Both gradients from one vjp call: XLA drops the unused forward product, so this is
        # the backward plus whatever forward work it needs (an upper bound: pessimistic).
        m, scope = measured[f"{name}|{FUSED_BWD}"], FUSED_SCOPE
      entries.append(_entry(name, p, spec, a, b, dtype, m["seconds"], fwd["backend"],
                            m["inner"], m["unroll"], scope, m.get("floor_us")))
      continue
    source = alias.get((name, p), f"{name}|{p}")
    m = measured[source]
    entries.append(_entry(name, p, spec, a, b, dtype, m["seconds"], m["backend"], m["inner"],
                          m["unroll"], floor_us=m.get("floor_us")))
  if time_bwd:
    spec, a, b = pass_problem(layout, "grad_lhs")
    m = measured[f"{BASELINE}|{FUSED_BWD}"]
    entries.append(_error_entry(BASELINE, FUSED_SCOPE, spec, a, b, dtype, m["error"])
                   if "error" in m else
                   _entry(BASELINE, FUSED_SCOPE, spec, a, b, dtype, m["seconds"], m["backend"],
                          m["inner"], m["unroll"], FUSED_SCOPE, m.get("floor_us")))
  for e in entries:
    e["revision"] = by_name[e["kernel"]].revision
    cache.put(cache_key(e["kernel"], e["pass"], e["spec"], e["lhs_shape"], e["rhs_shape"],
                        dtype), e)
  cache.save()
  return entries


def _error_entry(kernel: str, pass_name: str, spec: str, a_shape, b_shape, dtype: str,
                 error: str) -> Dict:
  return {"kernel": kernel, "pass": pass_name, "spec": spec, "lhs_shape": list(a_shape),
          "rhs_shape": list(b_shape), "dtype": dtype, "error": error,
          "jax": jax.__version__, "date": datetime.date.today().isoformat()}


def _speedup(base: Dict, entry: Dict) -> Optional[List[float]]:
  """[lo, mid, hi] of baseline time / kernel time (bootstrap over both sample sets)."""
  b = timing_lib.Timing(BASELINE, np.asarray(base["seconds"], np.float64))
  k = timing_lib.Timing(entry["kernel"], np.asarray(entry["seconds"], np.float64))
  mid, lo, hi = timing_lib.speedup_ci(b, k)
  return [lo, mid, hi]


def _sum_timing(a: Dict, b: Dict) -> Dict:
  """Per-repeat sum of two interleaved timings (the baseline's two gradient passes)."""
  return {"kernel": BASELINE, "seconds": [x + y for x, y in zip(a["seconds"], b["seconds"])]}


def usable(entry: Optional[Dict]) -> bool:
  return entry is not None and "error" not in entry


# Speeds that no timing of a product resolves. A product summing over one element (K = 1, an
# outer product) is no GEMM: XLA's algebraic simplifier makes it a broadcast multiply that
# fuses into its neighbours, so its time reads how well it fused. And a chained GPU sample of
# under MIN_RESOLVED_US a call is less than any kernel of its own costs in a chain (the
# one-element floor kernels read 5-18 us a call on the H200): the product ran inside another
# kernel. DLRM `small`'s top_mlp/dense_4 grad_lhs ([4096,1] . [1,256]) read 0.33 us with
# xla_fp8_rowwise against bf16's 5.5 us, a "16.97x" that selection took and validation, timing
# the whole step at 1.00x, sent back (H200).
MIN_RESOLVED_US = 1.0


def contraction_size(layout: SiteLayout, pass_name: str) -> int:
  """Elements a pass's product sums over (its K)."""
  _, a, _ = pass_problem(layout, pass_name)
  axes = layout.spec.for_pass(pass_name).contracting_axes("lhs")
  return int(np.prod([a[i] for i in axes], dtype=np.int64))


def unresolved_reason(layout: SiteLayout, pass_name: str, kernel_us: Optional[float],
                      baseline_us: Optional[float], *, whole_backward: bool = False,
                      chained: bool = True) -> Optional[str]:
  """Why a kernel's speedup at this pass cannot be told from its timing, or None. Times are
  per call (us); `chained`: GPU samples of chained calls (a CPU's are not judged by time)."""
  if not whole_backward and contraction_size(layout, pass_name) == 1:
    return ("an outer product (K = 1) is no GEMM: XLA fuses it into its neighbours, so its "
            "time is not a kernel's")
  if chained:
    for what, us in (("kernel", kernel_us), ("bf16 baseline", baseline_us)):
      if us is not None and us < MIN_RESOLVED_US:
        return (f"the {what} timed {us:.2f} us a call, under the {MIN_RESOLVED_US:g} us a "
                "kernel of its own costs: it ran inside a neighbour")
  return None


def mark_unresolved(info: Dict, reason: Optional[str]) -> None:
  """Drops `info`'s speedup where `reason` (`unresolved_reason`) says no timing resolves it."""
  if reason:
    info.update(speedup=None, timing=UNRESOLVED, timing_note=reason)


def _whole_bwd_speedup(entry: Dict, bwd: Optional[Dict], grad_lhs: Optional[Dict],
                       grad_rhs: Optional[Dict]) -> Dict:
  """{speedup, baseline_us, speedup_vs} of a backward timed as one call: against the
  baseline's backward timed the same way when the cache has it, else (a cache from before
  it was timed) against the baseline's two gradient passes summed, which favours the op."""
  if usable(bwd):
    lo, hi = bwd["ci_us"]
    return {"speedup": _speedup(bwd, entry), "baseline_us": [lo, bwd["median_us"], hi],
            "speedup_vs": "baseline backward, one call"}
  if usable(grad_lhs) and usable(grad_rhs):
    return {"speedup": _speedup(_sum_timing(grad_lhs, grad_rhs), entry),
            "speedup_vs": "baseline grad_lhs + grad_rhs, timed apart"}
  return {}


def site_timings(layout: SiteLayout, kernels, dtype: str, cache: TimingCache, *,
                 unsupported: Mapping[str, Mapping[str, str]], source: str = "measured"
                 ) -> Dict[str, Dict[str, Dict]]:
  """{pass: {kernel: {time_us, speedup, backend, timing}}} from the cache (None = missing)."""
  keys = _site_keys(layout, kernels, dtype, unsupported)
  by_name = {k.name: k for k in kernels}
  got = {kp: cache.get(key, by_name[kp[0]].revision) for kp, key in keys.items()}
  bwd = cache.get(baseline_bwd_key(layout, dtype), registry.get(BASELINE).revision)
  out: Dict[str, Dict[str, Dict]] = {}
  for (name, p), e in got.items():
    if e is None or "error" in e:
      info = {"time_us": None, "speedup": None, "backend": None,
              "timing": "missing" if e is None else "failed"}
      if e is not None:
        info["timing_error"] = e["error"]
      out.setdefault(p, {})[name] = info
      continue
    lo, hi = e["ci_us"]
    per_call = 1e6 * np.asarray(e["seconds"], np.float64)
    info = {"time_us": [lo, e["median_us"], hi], "backend": e["backend"], "timing": source,
            "speedup": None,
            # The spread of single repeats (the CI above is the median's).
            "time_iqr_us": [float(np.percentile(per_call, 25)),
                            float(np.percentile(per_call, 75))]}
    chained = e.get("unroll", 1) > 1
    if e.get("time_scope"):
      info["time_scope"] = e["time_scope"]
      info.update(_whole_bwd_speedup(e, bwd, got.get((BASELINE, "grad_lhs")),
                                     got.get((BASELINE, "grad_rhs"))))
      base_us = bwd["median_us"] if usable(bwd) else None
    else:
      base = got.get((BASELINE, p))
      base_us = base["median_us"] if usable(base) else None
      if usable(base):
        info["speedup"] = _speedup(base, e)
    if name != BASELINE:
      mark_unresolved(info, unresolved_reason(
          layout, p, e["median_us"], base_us, whole_backward=bool(e.get("time_scope")),
          chained=chained))
    out.setdefault(p, {})[name] = info
  return out


def table_timings(layout: SiteLayout, kernels, dtype: str, table: Mapping, *,
                  unsupported: Mapping[str, Mapping[str, str]]) -> Dict[str, Dict[str, Dict]]:
  """The same shape of result from a committed timing table (a CPU-made report's fallback).
  Entries measured for another revision of their kernel are left out."""
  revisions = {k.name: k.revision for k in kernels}
  table = {**table, "entries": [e for e in table["entries"]
                                if e.get("revision", 1) == revisions.get(e["kernel"],
                                                                         e.get("revision", 1))]}
  out: Dict[str, Dict[str, Dict]] = {}
  for kernel in kernels:
    for p in PASSES:
      if kernel.name in unsupported.get(p, {}):
        continue
      spec, a, b = pass_problem(layout, p)
      hit = timing_table.lookup(table, kernel.name, p, spec, a, b, dtype)
      if hit is None:
        info = {"time_us": None, "speedup": None, "backend": None, "timing": "missing"}
      else:
        lo, hi = hit["ci_us"]
        info = {"time_us": [lo, hit["time_us"], hi], "speedup": hit["speedup_range"],
                "backend": hit["backend"],
                "timing": "estimated" if hit["estimated"] else "table"}
        if hit["estimated"]:
          info["estimated_from"] = hit["from"]
        whole_backward = kernel.sort == FUSED_OP and p != "fwd"
        if whole_backward:
          info["time_scope"] = FUSED_SCOPE
          info.update(_table_whole_bwd_speedup(table, kernel.name, layout, dtype,
                                               hit["time_us"]))
        if kernel.name != BASELINE:  # times scaled from another shape: judged by K alone
          mark_unresolved(info, unresolved_reason(layout, p, None, None,
                                                   whole_backward=whole_backward,
                                                   chained=False))
      out.setdefault(p, {})[kernel.name] = info
  return out


def _table_whole_bwd_speedup(table: Mapping, kernel: str, layout: SiteLayout, dtype: str,
                             op_us: float) -> Dict:
  """`_whole_bwd_speedup` from a committed table. Every baseline is taken beside the fused op
  at the same (nearest) problem, where one run timed both (a baseline looked up on its own
  could come from another run): the baseline's one-call backward when that run timed it,
  else its two gradient passes."""
  pair = [timing_table.lookup(table, kernel, q, *pass_problem(layout, q), dtype)
          for q in ("grad_lhs", "grad_rhs")]
  if not all(pair):
    return {}
  bwd = timing_table.lookup(table, BASELINE, FUSED_SCOPE, *pass_problem(layout, "grad_lhs"),
                            dtype, baseline=BASELINE)
  if bwd is not None and bwd["from"] == pair[0]["from"]:
    s = bwd["time_us"] / op_us
    lo, hi = bwd["ci_us"]
    return {"speedup": [s, s, s], "baseline_us": [lo, bwd["time_us"], hi],
            "speedup_vs": "baseline backward, one call"}
  s = sum(h["time_us"] * h["speedup"] for h in pair) / op_us
  return {"speedup": [s, s, s], "speedup_vs": "baseline grad_lhs + grad_rhs, timed apart"}


def table_entries(entries: Sequence[Mapping]) -> List[Dict]:
  """Cache entries -> committed-table entries (raw samples left out)."""
  fields = ("kernel", "pass", "spec", "lhs_shape", "rhs_shape", "dtype", "median_us", "ci_us",
            "backend", "repeats", "jax", "date", "time_scope", "revision")
  return [{f: e[f] for f in fields if f in e} for e in entries if "error" not in e]


def device_kind() -> str:
  """The human-readable device kind ('cpu' on the CPU)."""
  dev = jax.devices()[0]
  return dev.device_kind if dev.platform != "cpu" else "cpu"


def on_gpu() -> bool:
  return _compat.on_gpu()
