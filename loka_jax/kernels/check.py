"""The kernel check (`experiments.kernels`): every kernel, every pass, on fresh random inputs,
against reference (a): the float32 HIGHEST product of the original high-precision operands.

A kernel that computes a whole chain (`ChainKernel`: a GEMM with its epilogue fused in) is
checked as what it is: its chain on a fresh random bias as well, against the chain's pure-jnp
reference on the original operands, forward and, where the chain has one, backward (rows
`grad_lhs`, `grad_rhs` and `grad_bias`). Every kernel ends with a verdict (`verdicts`):
measured, unsupported at this shape or on this device, or an error.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax import _compat
from loka_jax.kernels import registry
from loka_jax.kernels.backend import backend_from_hlo
from loka_jax.kernels.base import FUSED_OP, ChainKernel, reference_einsum
from loka_jax.kernels.flax_delayed import FP8_META, run_delayed_passes
from loka_jax.kernels.spec import ACT_WEIGHT, PASSES, EinsumSpec
from loka_jax.precision import flush_fractions
from loka_jax.precision import metrics as metrics_lib

SCHEMA = "loka.check/1"
DENSE_SPEC = EinsumSpec.parse("mk,kn->mn")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One dense site problem: x (m, k) @ w (k, n), output gradient g (m, n)."""
  m: int
  k: int
  n: int
  seed: int = 0
  compute_dtype: str = "bfloat16"

  def operands(self):
    """Original float32 operands, N(0, 1) (never zeros), and their compute-dtype copies."""
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(self.seed), 3)
    x = jax.random.normal(kx, (self.m, self.k), jnp.float32)
    w = jax.random.normal(kw, (self.k, self.n), jnp.float32) / np.sqrt(self.k)
    g = jax.random.normal(kg, (self.m, self.n), jnp.float32)
    return x, w, g

  def bias(self):
    """A float32 bias (n,) for chains that add one, N(0, 0.1^2)."""
    key = jax.random.fold_in(jax.random.PRNGKey(self.seed), 3)
    return 0.1 * jax.random.normal(key, (self.n,), jnp.float32)


# XLA's FP8 dot with precise accumulation (cuBLASLt on sm_90) at ONE output column reads
# 31.2-31.7 dB against the exact product of its own dequantized operands, plain and vmapped
# alike, where the fast forward and every N = 8 case clear 35 (on an H200): a floor of its
# own under every such product's reading.
PRECISE_AT_ONE_COLUMN_DB = 30.0


def with_own_error_db(sqnr_db, own_db):
  """The SQNR of a product whose error is `sqnr_db`'s plus an independent error of its own
  reading `own_db` against the same signal (error powers add)."""
  return -10.0 * np.log10(10.0 ** (-np.asarray(sqnr_db) / 10.0) + 10.0 ** (-own_db / 10.0))


def logit_head_samples(samples: int, m: int, k: int, n: int = 1, seed: int = 0):
  """`samples` float32 problems (stacked) shaped like a trained tower's K -> n logit head:
  every activation row near one shared positive mean vector (at 8192x2048x8 the probe found
  99% of the head input's variance in one direction), weights N(0, 1/k), small output
  gradients. Each element's rounding error then repeats down the rows instead of averaging
  out, so FP8 products read low here and differ between kernels with different scales."""
  kmu, kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
  mean = 0.3 * jnp.abs(jax.random.normal(kmu, (k,), jnp.float32))
  x = mean + 0.01 * jax.random.normal(kx, (samples, m, k), jnp.float32)
  w = jax.random.normal(kw, (samples, k, n), jnp.float32) / np.sqrt(k)
  g = 1e-3 * jax.random.normal(kg, (samples, m, n), jnp.float32)
  return x, w, g


def head_rounding_readings(samples: int, m: int, k: int, seed: int = 0) -> Dict[str, np.ndarray]:
  """How much rounding alone moves a logit head's FP8 forward: on `logit_head_samples`, each
  sample's e4m3 product (exact float32 dot) with our quantize (one rounding, from float32) and
  with Flax's (divided in bf16 first, then cast: two roundings), each sample scaled by the
  amax of the one before it as delayed scaling would. {"ours", "flax": SQNR dB per sample
  against the bf16 product; "differ_x", "differ_w": the share of elements the two round
  differently, per sample}."""
  from flax.linen import fp8_ops
  from loka_jax.precision import scaling
  e4m3_max = float(jnp.finfo(jnp.float8_e4m3fn).max)
  x, w, _ = logit_head_samples(samples, m, k, seed=seed)

  @jax.jit
  def one(xa, wa, x_prev, w_prev):
    xa, wa = xa.astype(jnp.bfloat16), wa.astype(jnp.bfloat16)
    sx, sw = jnp.max(jnp.abs(x_prev)) / e4m3_max, jnp.max(jnp.abs(w_prev)) / e4m3_max
    ref = xa.astype(jnp.float32) @ wa.astype(jnp.float32)
    ours = [scaling.quantize_with_scale(a, s, "e4m3").astype(jnp.float32)
            for a, s in ((xa, sx), (wa, sw))]
    flax = [fp8_ops.quantize(a, jnp.float8_e4m3fn, s, jnp.bfloat16).astype(jnp.float32)
            for a, s in ((xa, sx), (wa, sw))]
    read = lambda qx, qw: metrics_lib.sqnr_db((qx @ qw) * sx * sw, ref)
    return (read(*ours), read(*flax), jnp.mean(ours[0] != flax[0]),
            jnp.mean(ours[1] != flax[1]))

  got = [one(x[i], w[i], x[i - 1], w[i - 1]) for i in range(samples)]
  return {name: np.array([float(g[j]) for g in got])
          for j, name in enumerate(("ours", "flax", "differ_x", "differ_w"))}


def pass_operands(pass_name: str, x, w, g):
  return {"fwd": (x, w), "grad_lhs": (g, w), "grad_rhs": (x, g)}[pass_name]


def _row(kernel, pass_name, out, ref, qa=None, qb=None, a=None, b=None, backend="") -> dict:
  errs = {k: metrics_lib.to_json_safe(v) for k, v in metrics_lib.product_errors(out, ref).items()}
  row = {"kernel": kernel, "pass": pass_name, **errs, "underflow": 0.0, "saturation": 0.0,
         "backend": backend, "error": None}
  fracs = [flush_fractions(o, q) for o, q in ((a, qa), (b, qb)) if q is not None]
  if fracs:
    row["underflow"] = max(float(u) for u, _ in fracs)
    row["saturation"] = max(float(s) for _, s in fracs)
  if any(errs[k] is None for k in ("sqnr_db", "rel_fro", "mere")) or not np.all(np.isfinite(out)):
    row["error"] = "non-finite output"
  return row


def _empty_row(kernel, pass_name: str, error: str) -> dict:
  return {"kernel": kernel.name, "pass": pass_name, "sqnr_db": None, "rel_fro": None,
          "mere": None, "median_rel": None, "underflow": None, "saturation": None,
          "backend": kernel.backend, "error": error}


CHAIN_GRADS = ("grad_lhs", "grad_rhs", "grad_bias")  # d x, d w, d bias of a chain


def check_chain(kernel: ChainKernel, problem: Problem, *, want_backend: bool = False
                ) -> List[dict]:
  """Rows for a chain kernel: its forward and (if it has one) each gradient of its chain
  on the problem's operands and bias in the compute dtype, against `chain_reference` and its
  gradients on the original float32 operands (output gradient g)."""
  reason = kernel.chain_unsupported_reason(problem.m, problem.k, problem.n)
  if reason:
    return [_empty_row(kernel, "*", f"unsupported: {reason}")]
  x, w, g = problem.operands()
  bias = problem.bias()
  dt = jnp.dtype(problem.compute_dtype)
  run = lambda a, b, c: kernel.chain(a, b, c, out_dtype=jnp.float32)
  if kernel.has_backward:
    def fn(a, b, c, dy):
      out, vjp = jax.vjp(run, a, b, c)
      return (out, *vjp(dy.astype(out.dtype)))

    def ref_fn(a, b, c, dy):
      out, vjp = jax.vjp(kernel.chain_reference, a, b, c)
      return (out, *vjp(dy))
    passes = ("fwd",) + CHAIN_GRADS
  else:
    fn = lambda a, b, c, dy: (run(a, b, c),)
    ref_fn = lambda a, b, c, dy: (kernel.chain_reference(a, b, c),)
    passes = ("fwd",)
  args = (x.astype(dt), w.astype(dt), bias, g.astype(dt))
  compiled = jax.jit(fn).lower(*args).compile()  # one compile: outputs and HLO
  outs = compiled(*args)
  refs = jax.jit(ref_fn)(x, w, bias, g)
  backend = (backend_from_hlo(compiled.as_text(), jax.default_backend()) if want_backend
             else kernel.backend)
  return [_row(kernel.name, p, out.astype(jnp.float32), ref, backend=backend)
          for p, out, ref in zip(passes, outs, refs)]


def check_kernel(name: str, problem: Problem, *, warmup: int = 3,
                 want_backend: bool = False) -> List[dict]:
  """Rows (one per pass) for one kernel; a kernel that raises gets rows with `error` set."""
  kernel = registry.get(name)
  x, w, g = problem.operands()
  # The fp32 reference arm computes in fp32 (its policy's compute dtype); others get bf16.
  dt = jnp.dtype(getattr(kernel, "dtype", None) if not kernel.fp8 else problem.compute_dtype)
  rows = []
  try:
    if isinstance(kernel, ChainKernel):
      return check_chain(kernel, problem, want_backend=want_backend)
    if kernel.sort == FUSED_OP:
      # One compile of the warm-up steps and the measured one (Pallas kernels run them in
      # interpret mode on the CPU, where every eager step would trace them again).
      passes = jax.jit(lambda a, b, c: run_delayed_passes(str(DENSE_SPEC), a, b, c,
                                                          warmup=warmup, kernel=name))
      out, d_x, d_w, _ = passes(x.astype(dt), w.astype(dt), g.astype(dt))
      results = {"fwd": out, "grad_lhs": d_x, "grad_rhs": d_w}
      for p in PASSES:
        a, b = pass_operands(p, x, w, g)
        ref = reference_einsum(DENSE_SPEC.for_pass(p), a, b)
        rows.append(_row(name, p, results[p].astype(jnp.float32), ref,
                         # one op for every pass: its backend, not one per GEMM
                         backend=kernel.backend if not want_backend
                         else f"{kernel.backend}_fused"))
      return rows
    for p in PASSES:
      if p not in kernel.passes:
        continue
      reason = kernel.unsupported_reason(DENSE_SPEC.for_pass(p), p, ACT_WEIGHT,
                                         (problem.m, problem.k), (problem.k, problem.n))
      if reason:
        rows.append(_empty_row(kernel, p, f"unsupported: {reason}"))
        continue
      spec = DENSE_SPEC.for_pass(p)
      a, b = pass_operands(p, x, w, g)
      a_c, b_c = a.astype(dt), b.astype(dt)
      fn = lambda a_, b_, spec=spec, p=p: kernel.einsum(spec, a_, b_, pass_name=p,
                                                        out_dtype=jnp.float32)
      compiled = jax.jit(fn).lower(a_c, b_c).compile()  # one compile: output and HLO
      out = compiled(a_c, b_c)
      ref = reference_einsum(spec, a, b)
      qa, qb = kernel.quantized_operands(spec, a_c, b_c, pass_name=p)
      backend = (backend_from_hlo(compiled.as_text(), jax.default_backend()) if want_backend
                 else kernel.backend)
      rows.append(_row(name, p, out, ref, qa, qb, a_c, b_c, backend))
  except Exception as e:  # A broken kernel is reported in its rows, the check goes on.
    rows.append(_empty_row(kernel, "*", f"{type(e).__name__}: {e}"))
  if not rows:
    rows.append(_empty_row(kernel, "*", f"unsupported: kernel {name} has no pass to check"))
  return rows


def pass_numerics_disagreements(results: Mapping[str, Sequence]) -> List[str]:
  """Where `Kernel.pass_numerics` and measured results disagree. `results` holds each
  kernel's (fwd, grad_lhs, grad_rhs) outputs on one problem; for each pair of kernels and
  each pass, a line when the two name the pass alike yet differ bit for bit, or name it
  apart yet agree. Validation reads an alike-named pass as equally accurate, so the names
  hold only where this is empty."""
  out = []
  for a, b in itertools.combinations(results, 2):
    for p, got_a, got_b in zip(PASSES, results[a], results[b]):
      alike = registry.get(a).pass_numerics(p) == registry.get(b).pass_numerics(p)
      equal = np.array_equal(np.asarray(got_a, np.float32), np.asarray(got_b, np.float32))
      if alike != equal:
        out.append(f"{a} vs {b}, {p}: named {'alike' if alike else 'apart'}, "
                   f"{'bit-identical' if equal else 'different'}")
  return out


MEASURED, UNSUPPORTED, ERROR = "measured", "unsupported", "error"


def verdicts(results: Sequence[dict]) -> Dict[str, str]:
  """Each kernel's verdict over its result rows, in the rows' order: ERROR when a row holds
  an error other than an unsupported pass (the kernel raised or gave a non-finite output),
  else MEASURED when some pass was measured, else UNSUPPORTED."""
  out: Dict[str, str] = {}
  for r in results:
    error = r["error"]
    verdict = (MEASURED if error is None else
               UNSUPPORTED if error.startswith("unsupported") else ERROR)
    have = out.get(r["kernel"])
    if have is None or have == UNSUPPORTED or verdict == ERROR:
      out[r["kernel"]] = verdict
  return out


def run_check(problem: Problem, kernels: Optional[Sequence[str]] = None) -> Dict:
  names = list(kernels) if kernels else registry.names()
  want_backend = _compat.on_gpu()
  results = []
  for name in names:
    results.extend(check_kernel(name, problem, want_backend=want_backend))
  return {"schema": SCHEMA, "shape": {"m": problem.m, "k": problem.k, "n": problem.n},
          "seed": problem.seed, "compute_dtype": problem.compute_dtype,
          "device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": results,
          "verdicts": verdicts(results)}


def format_verdicts(report: Dict) -> str:
  """One line: how many kernels were measured, and which were unsupported or failed."""
  found = report.get("verdicts") or verdicts(report["results"])
  parts = []
  for verdict in (MEASURED, UNSUPPORTED, ERROR):
    names = [k for k, v in found.items() if v == verdict]
    if verdict == MEASURED:
      parts.append(f"{len(names)} measured")
    elif names:
      parts.append(f"{len(names)} {verdict} ({', '.join(names)})")
  return "verdicts: " + ", ".join(parts)


def format_table(report: Dict) -> str:
  lines = [f"check m={report['shape']['m']} k={report['shape']['k']} n={report['shape']['n']} "
           f"on {report['device']} (jax {report['jax']}); reference: fp32 HIGHEST on original "
           "operands (chain kernels: their whole chain)",
           f"{'kernel':32s} {'pass':9s} {'SQNR dB':>8s} {'rel_fro':>9s} {'MERE':>9s} "
           f"{'underflow':>9s} {'backend':16s} error"]
  fmt = lambda v, f: "-" if v is None else format(v, f)
  for r in report["results"]:
    lines.append(f"{r['kernel']:32s} {r['pass']:9s} {fmt(r['sqnr_db'], '8.2f')} "
                 f"{fmt(r['rel_fro'], '9.2e')} {fmt(r['mere'], '9.2e')} "
                 f"{fmt(r['underflow'], '9.4f')} {r['backend']:16s} {r['error'] or ''}")
  lines.append(format_verdicts(report))
  return "\n".join(lines)


def forward_fn(name: str, problem: Problem):
  """(fn, args) computing one kernel's forward product, quantization included (a chain
  kernel's: its whole chain)."""
  kernel = registry.get(name)
  x, w, g = problem.operands()
  if isinstance(kernel, ChainKernel):
    dt = jnp.dtype(problem.compute_dtype)
    return ((lambda a, b, c: kernel.chain(a, b, c, out_dtype=dt)),
            (x.astype(dt), w.astype(dt), problem.bias()))
  dt = jnp.dtype(getattr(kernel, "dtype", None) if not kernel.fp8 else problem.compute_dtype)
  x, w = x.astype(dt), w.astype(dt)
  if kernel.sort == FUSED_OP:
    module = kernel.make_module(name=None)
    _, _, _, meta = run_delayed_passes(str(DENSE_SPEC), x, w, g.astype(dt), kernel=name)
    variables = {FP8_META: meta}
    return (lambda v, a, b: module.apply(v, str(DENSE_SPEC), a, b)), (variables, x, w)
  return (lambda a, b: kernel.einsum(DENSE_SPEC, a, b, pass_name="fwd", out_dtype=dt)), (x, w)


def time_forward(problem: Problem, kernels: Sequence[str], *, repeats: int = 20,
                 baseline: str = "xla_bf16") -> Dict[str, dict]:
  """Forward time of each kernel vs `baseline`, interleaved in one run (GPU numbers only)."""
  from loka_jax import timing
  names = [baseline] + [k for k in kernels if k != baseline]
  variants = {name: forward_fn(name, problem) for name in names}
  return timing.summarize(timing.time_variants(variants, repeats=repeats), baseline)


def format_timing(report: Dict) -> str:
  lines = [f"forward time incl. quantization, {report['device']}: median us [95% CI], "
           "speedup vs xla_bf16 [95% CI]"]
  backends = {r["kernel"]: r["backend"] for r in report["results"] if r["pass"] == "fwd"}
  for name, t in report["timing"].items():
    lines.append(f"{name:32s} {t['median_us']:10.1f} [{t['ci_us'][0]:.1f}, {t['ci_us'][1]:.1f}]"
                 f"  x{t['speedup']:.3f} [{t['speedup_ci'][0]:.3f}, {t['speedup_ci'][1]:.3f}]"
                 f"  {backends.get(name, '')}")
  return "\n".join(lines)


def markdown_summary(reports: Sequence[Dict]) -> str:
  """One markdown table over several shapes: fwd SQNR, backend per pass, fwd time, speedup."""
  lines = ["| M x K x N | kernel | fwd SQNR dB | dgrad / wgrad SQNR dB | "
           "backend fwd / dgrad / wgrad "
           "| fwd us (median) | speedup vs xla_bf16 [95% CI] |", "|---|---|---|---|---|---|---|"]
  for report in reports:
    shape = "x".join(str(report["shape"][d]) for d in "mkn")
    rows = {(r["kernel"], r["pass"]): r for r in report["results"]}
    for name, t in report.get("timing", {}).items():
      get = lambda p, key: rows.get((name, p), {}).get(key)
      fmt = lambda v: "-" if v is None else f"{v:.1f}"
      lines.append(
          f"| {shape} | {name} | {fmt(get('fwd', 'sqnr_db'))} | "
          f"{fmt(get('grad_lhs', 'sqnr_db'))} / "
          f"{fmt(get('grad_rhs', 'sqnr_db'))} | {get('fwd', 'backend')} / "
          f"{get('grad_lhs', 'backend')}"
          f" / {get('grad_rhs', 'backend')} | {t['median_us']:.1f} | {t['speedup']:.2f} "
          f"[{t['speedup_ci'][0]:.2f}, {t['speedup_ci'][1]:.2f}] |")
  return "\n".join(lines)
