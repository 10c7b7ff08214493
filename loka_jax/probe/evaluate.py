"""Per-site error of every candidate kernel, every pass, on operands drawn two ways:

  gaussian   lhs / grad rows (and act x act rhs rows) from the learned Gaussians, the weight
             of an act x weight site from its matrix normal: what the distributions expose;
  reservoir  real paired slices of lhs and output gradient (and act x act rhs) from the
             reservoir, with the latest weight snapshot: heavy tails, and the x-g
             correlation wgrad depends on.

Each sample has the site's real shapes, except that operands larger than `max_eval_elements`
are subsampled along the slice index (recorded). Every kernel's output is compared with
reference (a): the float32 HIGHEST product of the original (unquantized) operands. The
evaluation is vmapped over samples in fixed-size chunks and each kernel's passes share one
function, so each (site shape, kernel) compiles once and serves every site of that shape;
`compile_jobs` lists a site's functions so that `executables.Precompiler` can compile them
ahead, while earlier sites evaluate.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.kernels import FUSED_OP, PASSES, EinsumSpec, reference_einsum
from loka_jax.kernels import registry
from loka_jax.kernels.flax_delayed import FP8_META, merge_fp8_meta
from loka_jax.kernels.spec import ACT_WEIGHT
from loka_jax.precision import flush_fractions
from loka_jax.precision import metrics as metrics_lib
from loka_jax.probe import chains, executables, gaussian, matrix_normal
from loka_jax.probe.collector import SiteProbe
from loka_jax.probe.layout import SiteLayout

GAUSSIAN = "gaussian"
RESERVOIR = "reservoir"
SOURCES = (GAUSSIAN, RESERVOIR)
METRICS = ("sqnr_db", "rel_fro", "mere", "median_rel")
DELAYED_WARMUP = 3
# The evaluation's version, part of every cached evaluation's key: 2 since delayed-scaling
# ops warm on other samples only (`fused_chunk_floor`); evaluations before it are made again.
EVALUATOR_VERSION = 2
PASS_OPERANDS = {"fwd": ("lhs", "rhs"), "grad_lhs": ("grad", "rhs"), "grad_rhs": ("lhs", "grad")}

# Evaluation measures error, not speed. On the GPU most of a site's compile time is GEMM
# autotuning (each vmapped product tries cuBLAS algorithms and Triton tilings), which picks
# how a product is tiled, not what it quantizes or how it accumulates: those are explicit
# in each kernel's HLO. Turning it off cuts a site's evaluation compile several-fold.
EVAL_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def _eval_jit(fn):
  return jax.jit(fn, compiler_options=EVAL_COMPILER_OPTIONS)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """How operands are drawn and how many."""
  samples: int = 100                      # draws from the learned distributions
  reservoir_samples: Optional[int] = None  # draws from the reservoir (None: `samples`)
  max_eval_elements: int = 1 << 22        # per operand: larger ones are row-subsampled
  chunk_elements: int = 1 << 28           # operand elements vmapped at once (memory bound)
  jitter: float = 1e-6
  seed: int = 0

  @property
  def num_reservoir(self) -> int:
    return self.samples if self.reservoir_samples is None else self.reservoir_samples

  def to_dict(self):
    return dataclasses.asdict(self)


def eval_slices(site: SiteProbe, config: EvalConfig) -> int:
  """Entries along the slice index used for evaluation (all, unless the operands are big)."""
  layout = site.layout
  if not layout.slice_label:
    return 0
  per_slice = max(math.prod(layout.slice_shape(op)) for op in layout.sliced_operands())
  return int(min(layout.num_slices, max(1, config.max_eval_elements // max(per_slice, 1))))


def _chunk_size(layout: SiteLayout, samples: int, config: EvalConfig) -> int:
  per_sample = sum(math.prod(layout.operand(op).shape) for op in ("lhs", "rhs", "grad"))
  # Operands, their compute-dtype copies, outputs and references live at once: ~4x.
  return int(max(1, min(samples, config.chunk_elements // max(4 * per_sample, 1))))


# ----------------------------------------------------------------------------- operands


def _factors(kind: str, state, jitter: float):
  lhs = gaussian.sampler_factors(state["lhs"], jitter)
  grad = gaussian.sampler_factors(state["grad"], jitter)
  rhs = (matrix_normal.sampler_factors(state["rhs"], jitter) if kind == ACT_WEIGHT
         else gaussian.sampler_factors(state["rhs"], jitter))
  return lhs, rhs, grad


@functools.lru_cache(maxsize=None)
def _gaussian_sampler(layout: SiteLayout, jitter: float):
  """jit(keys, state) -> (lhs, rhs, grad) [samples, ...] from the learned distributions."""
  def one(key, lhs_f, rhs_f, grad_f):
    k1, k2, k3 = jax.random.split(key, 3)
    lhs = layout.lhs.from_rows(gaussian.sample_rows(k1, lhs_f, layout.lhs.num_rows))
    if layout.kind == ACT_WEIGHT:
      rhs = layout.rhs.from_rows(matrix_normal.sample(k2, rhs_f))
    else:
      rhs = layout.rhs.from_rows(gaussian.sample_rows(k2, rhs_f, layout.rhs.num_rows))
    grad = layout.grad.from_rows(gaussian.sample_rows(k3, grad_f, layout.grad.num_rows))
    return lhs, rhs, grad

  def draw(keys, state):
    factors = _factors(layout.kind, state, jitter)
    return jax.vmap(one, in_axes=(0, None, None, None))(keys, *factors)
  return _eval_jit(draw)


@functools.lru_cache(maxsize=None)
def _reservoir_sampler(layout: SiteLayout, capacity: int, slices: int):
  replace = capacity < slices

  def one(key, res, weight):
    idx = jax.random.choice(key, capacity, (slices,), replace=replace)
    # fp32 like the Gaussian draws: both sources then share every compiled evaluator.
    ops = {op: jnp.moveaxis(jnp.take(res[op], idx, axis=0), 0,
                            layout.slice_axis(op)).astype(jnp.float32)
           for op in layout.sliced_operands()}
    rhs = weight if layout.kind == ACT_WEIGHT else ops["rhs"]
    return ops["lhs"], rhs.astype(jnp.float32), ops["grad"]
  return _eval_jit(jax.vmap(one, in_axes=(0, None, None)))


# ----------------------------------------------------------------------------- kernels


def _deq_underflow(x, deq):
  xf = x.astype(jnp.float32)
  nonzero = jnp.isfinite(xf) & (xf != 0)
  return jnp.sum(nonzero & (deq == 0)) / jnp.maximum(jnp.sum(nonzero), 1)


def _operand_flush(kernel, spec, pass_name, a, b):
  """(underflow_a, underflow_b, saturation_a, saturation_b); NaN where not measurable."""
  nan = jnp.float32(jnp.nan)
  if not kernel.fp8:
    return nan, nan, nan, nan
  qa, qb = kernel.quantized_operands(spec, a, b, pass_name=pass_name)
  if qa is not None or qb is not None:
    ua, sa = flush_fractions(a, qa) if qa is not None else (nan, nan)
    ub, sb = flush_fractions(b, qb) if qb is not None else (nan, nan)
    return ua, ub, sa, sb
  mode, quantizer = getattr(kernel, "mode", None), getattr(kernel, "quantizer", None)
  if mode is not None and quantizer is not None:  # a Pallas per-pass kernel
    from kernels_pallas import products  # the plugin that registered this kernel
    da, db = products.dequantized_operands(spec, a, b, mode=mode, pass_name=pass_name,
                                           quantize=quantizer)
    return _deq_underflow(a, da), _deq_underflow(b, db), nan, nan
  return nan, nan, nan, nan


MEDIAN_ELEMENTS = 1 << 16


def _errors(out, ref):
  """Output metrics of one sample. The median relative error is taken over at most
  MEDIAN_ELEMENTS evenly strided elements (a sort of every output element costs more than
  the product itself at large shapes)."""
  out = out.astype(jnp.float32)
  errs = {"sqnr_db": metrics_lib.sqnr_db(out, ref), "rel_fro": metrics_lib.rel_fro(out, ref),
          "mere": metrics_lib.mere(out, ref)}
  flat_out, flat_ref = out.ravel(), ref.ravel()
  stride = max(1, flat_out.size // MEDIAN_ELEMENTS)
  rms = jnp.sqrt(jnp.mean(flat_ref * flat_ref))
  rel = (jnp.abs(flat_out[::stride] - flat_ref[::stride])
         / (jnp.abs(flat_ref[::stride]) + metrics_lib.MERE_FLOOR * rms))
  errs["median_rel"] = jnp.median(rel)
  errs["finite"] = jnp.all(jnp.isfinite(out))
  return errs


@functools.lru_cache(maxsize=None)
def references(spec: str):
  """jit(vmap(...)): reference (a) of every pass, computed once per chunk for all kernels."""
  parsed = EinsumSpec.parse(spec)

  def one(lhs, rhs, grad):
    operands = {"lhs": lhs, "rhs": rhs, "grad": grad}
    return {p: reference_einsum(parsed.for_pass(p), *(operands[n] for n in PASS_OPERANDS[p]))
            for p in PASSES}
  return _eval_jit(jax.vmap(one))


@functools.lru_cache(maxsize=None)
def kernel_evaluator(kernel_name: str, passes: Tuple[str, ...], spec: str, compute_dtype: str):
  """jit(vmap(...)): per-sample errors of one per-pass kernel on `passes`, all in one
  compiled function per (site shape, kernel), shared by every site of that shape."""
  kernel = registry.get(kernel_name)
  parsed = EinsumSpec.parse(spec)
  dt = jnp.dtype(compute_dtype)

  def one(lhs, rhs, grad, refs):
    operands = {"lhs": lhs, "rhs": rhs, "grad": grad}
    results = {}
    for p in passes:
      spec_p = parsed.for_pass(p)
      a, b = (operands[n] for n in PASS_OPERANDS[p])
      a_c, b_c = a.astype(dt), b.astype(dt)
      out = kernel.einsum(spec_p, a_c, b_c, pass_name=p, out_dtype=dt)
      errs = _errors(out, refs[p])
      ua, ub, sa, sb = _operand_flush(kernel, spec_p, p, a_c, b_c)
      errs.update(underflow_a=ua, underflow_b=ub, saturation_a=sa, saturation_b=sb)
      results[p] = errs
    return results
  return _eval_jit(jax.vmap(one))


def _delayed_products(kernel, spec: str, lhs, rhs, grad, warm):
  """Flax's delayed op on (lhs, rhs, grad) after updating its state on `warm` operands."""
  module = kernel.make_module(name=None)
  variables = module.init(jax.random.PRNGKey(0), spec, lhs, rhs)
  apply = lambda v, a, b: module.apply(v, spec, a, b)
  for wl, wr, wg in warm:
    out, vjp = jax.vjp(apply, variables, wl, wr)
    d_vars, _, _ = vjp(wg.astype(out.dtype))
    variables = {FP8_META: merge_fp8_meta(d_vars[FP8_META])}
  out, vjp = jax.vjp(apply, variables, lhs, rhs)
  _, d_lhs, d_rhs = vjp(grad.astype(out.dtype))
  return out, d_lhs, d_rhs


@functools.lru_cache(maxsize=None)
def fused_evaluator(kernel_name: str, spec: str, compute_dtype: str):
  """jit(...): per-sample errors of a fused-op kernel's three passes. Its state (delayed
  scaling) is warmed on the DELAYED_WARMUP preceding samples of the chunk, so scales come
  from other tensors of the same distribution, as in training (a chunk holds at least
  DELAYED_WARMUP + 1 samples where one is evaluated: `fused_chunk_floor`)."""
  kernel = registry.get(kernel_name)
  dt = jnp.dtype(compute_dtype)

  def one(lhs, rhs, grad, refs, warm_l, warm_r, warm_g):
    warm = [(warm_l[i].astype(dt), warm_r[i].astype(dt), warm_g[i].astype(dt))
            for i in range(DELAYED_WARMUP)]
    out, d_lhs, d_rhs = _delayed_products(kernel, spec, lhs.astype(dt), rhs.astype(dt),
                                          grad.astype(dt), warm)
    results = {}
    for p, value in (("fwd", out), ("grad_lhs", d_lhs), ("grad_rhs", d_rhs)):
      errs = _errors(value, refs[p])
      nan = jnp.float32(jnp.nan)
      errs.update(underflow_a=nan, underflow_b=nan, saturation_a=nan, saturation_b=nan)
      results[p] = errs
    return results

  def chunk(lhs, rhs, grad, refs):
    rolled = lambda x: jnp.stack([jnp.roll(x, s, axis=0) for s in range(DELAYED_WARMUP, 0, -1)],
                                 axis=1)
    return jax.vmap(one)(lhs, rhs, grad, refs, rolled(lhs), rolled(rhs), rolled(grad))
  return _eval_jit(chunk)


@functools.lru_cache(maxsize=None)
def chain_evaluator(kernel_name: str, passes: Tuple[str, ...], spec: str, compute_dtype: str,
                    chain):
  """jit(vmap(...)): per-sample errors of a fused-epilogue kernel on the site's `chain`
  (`probe.chains`): its output and the gradients its backward computes, against the chain in
  float32 on the original operands (the gradients' epilogue backward at the kernel's own
  pre-norm value). The operands' flush is that of the e4m3 rowwise products it runs
  (its backward's, `chains.backward_of`)."""
  kernel = registry.get(kernel_name)
  rowwise = registry.get(chains.backward_of(kernel))
  parsed = EinsumSpec.parse(spec)
  dt = jnp.dtype(compute_dtype)

  def one(lhs, rhs, grad, refs):
    del refs  # the product's references; the chain has its own
    x, w = lhs.astype(dt), rhs.astype(dt)
    pre = chains.pre_norm(kernel, x, w, chain)
    y_ref, d_lhs_ref, d_rhs_ref, dz = chains.reference(lhs, rhs, grad, chain, pre)
    run = lambda a, b: chains.run(kernel, a, b, chain, dt)
    if passes == ("fwd",):
      outs = {"fwd": run(x, w)}
    else:
      y, vjp = jax.vjp(run, x, w)
      d_lhs, d_rhs = vjp(grad.astype(y.dtype))
      outs = {"fwd": y, "grad_lhs": d_lhs, "grad_rhs": d_rhs}
    refs = {"fwd": y_ref, "grad_lhs": d_lhs_ref, "grad_rhs": d_rhs_ref}
    g = dz.astype(dt)
    operands = {"fwd": (x, w), "grad_lhs": (g, w), "grad_rhs": (x, g)}
    results = {}
    for p in passes:
      errs = _errors(outs[p], refs[p])
      ua, ub, sa, sb = _operand_flush(rowwise, parsed.for_pass(p), p, *operands[p])
      errs.update(underflow_a=ua, underflow_b=ub, saturation_a=sa, saturation_b=sb)
      results[p] = errs
    return results
  return _eval_jit(jax.vmap(one))


# ----------------------------------------------------------------------------- per site


@dataclasses.dataclass
class SiteEvaluation:
  """Per-sample metrics: results[source][pass][kernel] = {metric: np.ndarray [samples]}."""
  site: str
  layout: SiteLayout                 # the evaluated (possibly subsampled) layout
  slices: int
  results: Dict[str, Dict[str, Dict[str, Dict[str, np.ndarray]]]]
  unsupported: Dict[str, Dict[str, str]]   # pass -> kernel -> reason
  errors: Dict[str, str]                   # kernel -> exception text
  reservoir: Dict[str, object]
  chunk: int = 0                           # samples a chunk held (fused ops warm within it)


def _chunks(total: int, size: int):
  start = 0
  while start < total:
    yield start, min(size, total - start)
    start += size


def _fetch(outputs: Mapping[str, Any], errors: Dict[str, str]) -> Dict[str, Any]:
  """The kernels' metrics on the host, in one transfer; where that fails (an error a
  kernel's execution raises only when its result is read), kernel by kernel, each failure
  recorded in `errors` as a kernel that failed to evaluate."""
  try:
    return jax.device_get(dict(outputs))
  except Exception:  # noqa: BLE001 - find the kernel(s) at fault
    fetched = {}
    for name, out in outputs.items():
      try:
        fetched[name] = jax.device_get(out)
      except Exception as e:  # noqa: BLE001 - a broken kernel is reported, the probe goes on
        errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
    return fetched


def _append(store, key_path, values: Mapping[str, jax.Array], count: int):
  node = store
  for k in key_path[:-1]:
    node = node.setdefault(k, {})
  leaf = node.setdefault(key_path[-1], {})
  for name, v in values.items():
    arr = np.asarray(v)[:count]
    leaf[name] = np.concatenate([leaf[name], arr]) if name in leaf else arr


def unsupported_passes(layout, kernels, chain=None) -> Dict[str, Dict[str, str]]:
  """{pass: {kernel: reason}} of the passes a kernel does not support at this site (its kind,
  spec and shapes; for a fused-epilogue kernel, the site's `chain`: `chains`); decided before
  any operand is drawn."""
  out: Dict[str, Dict[str, str]] = {p: {} for p in PASSES}
  for kernel in kernels:
    for p in PASSES:
      if chains.is_chain_kernel(kernel):
        reason = chains.unsupported_reason(kernel, chain, layout.spec, p, layout.lhs.shape,
                                           layout.rhs.shape)
        if reason:
          out[p][kernel.name] = reason
        continue
      reason = kernel.unsupported_reason(layout.spec.for_pass(p), p, layout.kind,
                                         layout.lhs.shape, layout.rhs.shape)
      if reason:
        out[p][kernel.name] = reason
  return out


@dataclasses.dataclass(frozen=True)
class _SitePlan:
  """What evaluating a site runs, decided before any operand is drawn; `evaluate_site` and
  `compile_jobs` share it, so the functions compiled ahead are the ones called."""
  layout: SiteLayout                       # the evaluated (possibly subsampled) layout
  slices: int
  spec: str
  unsupported: Dict[str, Dict[str, str]]
  calls: Tuple                             # (kernel, passes it computes), in candidate order
  aliases: Dict[Tuple[str, str], str]      # (pass, kernel) -> the kernel whose code it shares
  draws: Dict[str, int]                    # source -> samples
  size: int                                # samples per vmapped chunk (every chunk, both sources)
  reservoir: Dict[str, object]
  jitter: float
  chain: Any = None                        # the site's fused Mods chain (`SiteProbe.chain`)


def _site_plan(site: SiteProbe, has_reservoir: bool, kernels: Sequence,
               config: EvalConfig) -> _SitePlan:
  full = site.layout
  slices = eval_slices(site, config)
  layout = full.subsampled(slices) if slices else full
  unsupported = unsupported_passes(full, kernels, site.chain)
  calls, aliases, first_of = [], {}, {}
  for kernel in kernels:
    passes = [p for p in PASSES if kernel.name not in unsupported[p]]
    if not passes:
      continue
    if kernel.sort == FUSED_OP:
      calls.append((kernel, tuple(passes)))
      continue
    todo = []
    for p in passes:
      ck = kernel.pass_numerics(p)
      if ck in first_of:  # identical code: share the first kernel's metrics
        aliases[(p, kernel.name)] = first_of[ck]
      else:
        first_of[ck] = kernel.name
        todo.append(p)
    if todo:
      calls.append((kernel, tuple(todo)))
  reservoir: Dict[str, object] = {"available": has_reservoir}
  draws = {GAUSSIAN: config.samples}
  if has_reservoir and config.num_reservoir > 0:
    capacity = site.reservoir_capacity
    draws[RESERVOIR] = config.num_reservoir
    reservoir.update(capacity=capacity, slices=slices, with_replacement=capacity < slices)
  elif not has_reservoir:
    reservoir["reason"] = full.slice_reason
  # One chunk size for both sources: every chunk has the same shapes and reuses one compile.
  size = _chunk_size(layout, max(draws.values()), config)
  if any(kernel.stateful for kernel, _ in calls):
    size = max(size, fused_chunk_floor(max(draws.values())))
  return _SitePlan(layout, slices, str(full.spec), unsupported, tuple(calls), aliases, draws,
                   size, reservoir, config.jitter, site.chain)


def fused_chunk_floor(samples: int) -> int:
  """The fewest samples a chunk holds where a delayed-scaling op is evaluated. The op warms
  its scale on the DELAYED_WARMUP samples before each one, rolled within the chunk
  (`fused_evaluator`): in a smaller chunk the roll brings the sample itself among them, its
  own amax then bounds its scale, and the op reads as current scaling that never saturates.
  The memory bound (`_chunk_size`) gave one sample a chunk at most sites of the `large`
  presets and the largest towers."""
  return min(DELAYED_WARMUP + 1, samples)


def warmup_excludes_self(size: int) -> bool:
  """Whether a chunk of `size` samples warms each sample's delayed scaling on others only."""
  return size > DELAYED_WARMUP


def _evaluator(plan: _SitePlan, kernel, passes: Tuple[str, ...], compute_dtype: str):
  if chains.is_chain_kernel(kernel):
    return chain_evaluator(kernel.name, passes, plan.spec, compute_dtype, plan.chain)
  if kernel.sort == FUSED_OP:
    return fused_evaluator(kernel.name, plan.spec, compute_dtype)
  return kernel_evaluator(kernel.name, passes, plan.spec, compute_dtype)


def _sampler_call(site: SiteProbe, plan: _SitePlan, source: str, keys, state):
  """(the source's jitted sampler, its arguments)."""
  if source == GAUSSIAN:
    return _gaussian_sampler(plan.layout, plan.jitter), (keys, state)
  weight = state["weight"] if site.layout.kind == ACT_WEIGHT else None
  return (_reservoir_sampler(plan.layout, site.reservoir_capacity, plan.slices),
          (keys, state["reservoir"], weight))


def _chunk_keys(source_key, start: int, size: int):
  return jax.random.split(jax.random.fold_in(source_key, start), size)


def evaluate_site(site: SiteProbe, state, kernels: Sequence, compute_dtype: str,
                  config: EvalConfig) -> SiteEvaluation:
  """Draws operands from both sources and evaluates every kernel on every pass it supports.
  Functions a `executables.Precompiler` compiled ahead (`compile_jobs`) are taken from it."""
  plan = _site_plan(site, "reservoir" in state, kernels, config)
  # Committed arrays everywhere: jit caches on committedness, and both sources must share
  # every compiled evaluator.
  state = jax.device_put(state, jax.devices()[0])
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), _stable_hash(site.name))
  results: Dict = {}
  errors: Dict[str, str] = {}
  source_errors: Dict[str, str] = {}
  for source, total in plan.draws.items():
    source_key = jax.random.fold_in(key, SOURCES.index(source))
    for start, count in _chunks(total, plan.size):
      try:
        sampler, args = _sampler_call(site, plan, source,
                                      _chunk_keys(source_key, start, plan.size), state)
        lhs, rhs, grad = executables.call(sampler, *args)
        refs = executables.call(references(plan.spec), lhs, rhs, grad)
      except Exception as e:  # no operands from this source: the other one still reports
        source_errors[source] = f"{type(e).__name__}: {str(e)[:500]}"
        for p in results.get(source, {}):
          results[source][p].clear()
        break
      outputs = {}
      for kernel, passes in plan.calls:
        try:
          outputs[kernel.name] = executables.call(
              _evaluator(plan, kernel, passes, compute_dtype), lhs, rhs, grad, refs)
        except Exception as e:  # a broken kernel is reported, the probe goes on
          errors[kernel.name] = f"{type(e).__name__}: {str(e)[:500]}"
      # One transfer a chunk: fetching each kernel's metrics as it was dispatched held the
      # host until that kernel finished, so the device idled while the next was dispatched.
      for name, out in _fetch(outputs, errors).items():
        for p, metrics in out.items():
          _append(results, (source, p, name), metrics, count)
  for source in results:
    for (p, name), first in plan.aliases.items():
      if first in results[source].get(p, {}):
        results[source][p][name] = results[source][p][first]
  reservoir = dict(plan.reservoir)
  if source_errors:
    reservoir["source_errors"] = source_errors
  return SiteEvaluation(site.name, plan.layout, plan.slices, results, plan.unsupported, errors,
                        reservoir, plan.size)


def compile_jobs(site: SiteProbe, state, kernels: Sequence, compute_dtype: str,
                 config: EvalConfig) -> List[executables.Job]:
  """The (jitted function, argument shapes) pairs `evaluate_site` will call for this site,
  for an `executables.Precompiler`; `state` may be abstract (ShapeDtypeStructs). A sampler
  whose shapes cannot be worked out is left out: evaluation reports it."""
  plan = _site_plan(site, "reservoir" in state, kernels, config)
  # As evaluate_site sees it: fetched to the host and put back, which drops weak types.
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
  keys = jax.eval_shape(lambda: _chunk_keys(jax.random.PRNGKey(0), 0, plan.size))
  jobs: List[executables.Job] = []
  operands = None
  for source in plan.draws:
    sampler, args = _sampler_call(site, plan, source, keys, state)
    jobs.append((sampler, args))
    if operands is None:
      try:
        operands = jax.eval_shape(sampler, *args)
      except Exception:  # noqa: BLE001 - evaluate_site reports it as a source error
        jobs.pop()
  if operands is None:
    return jobs
  refs_fn = references(plan.spec)
  jobs.append((refs_fn, tuple(operands)))
  refs = jax.eval_shape(refs_fn, *operands)
  for kernel, passes in plan.calls:
    jobs.append((_evaluator(plan, kernel, passes, compute_dtype), (*operands, refs)))
  return jobs


def _stable_hash(text: str) -> int:
  """A process-independent 31-bit hash (Python's hash() is salted per process)."""
  value = 0
  for ch in text.encode():
    value = (value * 131 + ch) % (2 ** 31 - 1)
  return value


def computed_passes(evaluation: SiteEvaluation) -> List[str]:
  return [p for p in PASSES if any(p in evaluation.results.get(s, {}) for s in SOURCES)]
