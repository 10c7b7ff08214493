"""The kernel benchmark of `python3 -m experiments.bench_kernels`: the Pallas FP8 kernels
(Triton and Mosaic GPU) against XLA FP8 and bf16 at recommendation shapes
(docs/BENCHMARKS.md, section 3: how speed is measured).

Per shape (GEMMs, batched interaction einsums, and the chain quantize -> GEMM ->
BlockNorm(256) -> Hard Swish -> quantize; the Mosaic GPU chain stops before the quantize,
which it fuses only for rows of at most 256 columns),
every variant is compiled (its backend read from the compiled HLO), then timed by
`loka_jax.timing.time_variants`: warm-up, variants interleaved, `repeats` each; a call
shorter than a quarter of `min_call_ms` is timed as a chain of dependent calls less its
floor, a longer one as single calls back to back. Each row has the median time, TFLOP/s,
and the speedup vs the baseline of its group measured in the same run (xla_bf16, or the
bf16 chain for the fused chain) with a bootstrap 95% CI; the fused chain also gets its
ratio vs the XLA FP8 chain. Rows go to OUT/results.jsonl; `run` skips finished shapes, so
the benchmark resumes across invocations that each stop at their time limit. A variant that
fails to compile records its error and the run goes on.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Callable, Optional, Tuple

from loka_jax import xla_env


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one benchmark run times (experiments/configs/bench_kernels.py, field by field)."""
  only: Tuple[str, ...] = ()      # shapes/variants whose name contains a token; (): all
  smoke: bool = False             # tiny shapes, CPU allowed: the code paths only
  repeats: int = 25               # interleaved timing repeats per variant
  min_call_ms: float = 1.0        # a timed sample's length (shorter calls run as chains)
  tune: bool = False              # autotune Pallas tiles (cached under OUT/pallas_tune)
  fp8_imprecise_acc: int = 0      # maxNumImpreciseAcc of the Pallas FP8 dots
  max_minutes: float = 7.0        # start no new shape after this (0: no limit)
  compile_cache: Optional[str] = None  # persistent compilation cache; None: ~/.cache/...

  @classmethod
  def from_config(cls, config) -> "Settings":
    from experiments import run_config
    select, timing = config.select, config.timing
    return cls(only=run_config.split(select.only), smoke=select.smoke,
               repeats=timing.repeats, min_call_ms=timing.min_call_ms, tune=timing.tune,
               fp8_imprecise_acc=timing.fp8_imprecise_acc,
               max_minutes=config.limits.max_minutes, compile_cache=config.limits.compile_cache)


SCHEMA = "loka.bench_kernels/1"
GEMMS = ((2048, 256, 768), (2048, 512, 1024), (2048, 1024, 1024), (4096, 512, 512),
         (8192, 1024, 1024), (2048, 4096, 1024), (2048, 16384, 1024), (2048, 123200, 1024))
CHAINS = ((2048, 256, 768), (4096, 512, 512), (2048, 1024, 1024), (8192, 1024, 1024))
INTERACTIONS = (("fmb", "bnd,bdk->bnk", (4096, 16, 128), (4096, 128, 24)),
                ("fmb", "bnd,bdk->bnk", (4096, 96, 128), (4096, 128, 96)))
CHAIN_BLOCK = 256
# Variant names per shape kind; the first is the baseline every ratio divides.
VARIANTS = {
    "gemm": ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise", "pallas_fp8_rowwise",
             "pallas_fp8_blockwise", "pallas_mosaic_fp8_rowwise",
             "pallas_mosaic_fp8_rowwise_precise", "pallas_mosaic_fp8_blockwise"),
    "batched": ("xla_bf16", "xla_fp8_tensorwise", "xla_fp8_rowwise", "pallas_fp8_batched",
                "pallas_mosaic_fp8_batched"),
    "chain": ("xla_bf16_chain", "xla_fp8_chain", "pallas_fused_chain",
              "pallas_mosaic_fused_chain"),
}


def setup_env(out_dir, s):
  """Caches and XLA autotune persistence; must run before JAX touches the GPU."""
  os.environ.setdefault("LOKA_PALLAS_TUNE_DIR", os.path.join(out_dir, "pallas_tune"))
  if s.tune:
    os.environ["LOKA_PALLAS_AUTOTUNE"] = "1"
  # Read by kernels_pallas at import (kernels_pallas.compat.fp8_imprecise_acc).
  os.environ["LOKA_PALLAS_FP8_IMPRECISE_ACC"] = str(s.fp8_imprecise_acc)
  xla_env.add_xla_flags(xla_env.autotune_flag(os.path.join(out_dir, "xla_autotune.textproto")))


def shapes(s):
  out = []
  gemms, chains, interactions = GEMMS, CHAINS, INTERACTIONS
  if s.smoke:
    gemms, chains = ((64, 200, 96),), ((64, 200, 256),)
    interactions = (("fmb", "bnd,bdk->bnk", (4, 16, 64), (4, 64, 24)),)
  for m, k, n in gemms:
    out.append({"name": f"gemm_m{m}_k{k}_n{n}", "kind": "gemm", "m": m, "k": k, "n": n})
  for m, k, n in chains:
    out.append({"name": f"chain_m{m}_k{k}_n{n}", "kind": "chain", "m": m, "k": k, "n": n})
  for tag, spec, lhs, rhs in interactions:
    out.append({"name": f"{tag}_b{lhs[0]}_{lhs[1]}x{lhs[2]}x{rhs[2]}", "kind": "batched",
                "spec": spec, "lhs": lhs, "rhs": rhs})
  return out


def _selected(name, s):
  return not s.only or any(tok in name for tok in s.only)


def shape_selected(shape, s):
  return _selected(shape["name"], s) or any(_selected(v, s) for v in VARIANTS[shape["kind"]][1:])


def _variants(shape):
  """(name, fn(a, b) -> output, flops) of one shape; the first is the group's baseline."""
  import jax
  import jax.numpy as jnp

  from kernels_pallas import fused
  from loka_jax import kernels
  from loka_jax.kernels import EinsumSpec
  from loka_jax.mods import functional
  from loka_jax.precision import E4M3, ROWWISE, scaling

  if shape["kind"] == "chain":
    flops = 2 * shape["m"] * shape["k"] * shape["n"]

    def bf16_chain(x, w):
      y = jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
      return functional.hard_swish(functional.block_norm(y, CHAIN_BLOCK)).astype(jnp.bfloat16)

    def xla_fp8_chain(x, w):
      qx = scaling.quantize(x, E4M3, ROWWISE, (1,))
      qw = scaling.quantize(w, E4M3, ROWWISE, (0,))
      y = jax.lax.dot_general(qx.data, qw.data, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32) * qx.scale * qw.scale
      y = functional.hard_swish(functional.block_norm(y, CHAIN_BLOCK))
      q = scaling.quantize(y, E4M3, ROWWISE, (1,))
      return q.data, q.scale

    def pallas_chain(x, w):
      q = fused.fused_dense(x, w, block_size=CHAIN_BLOCK, activation="hard_swish",
                            quantize_output=True)
      return q.data, q.scale

    def mosaic_chain(x, w):
      # The Mosaic GPU core quantizes its output only where a tile holds whole rows (at
      # most 256 columns), narrower than these chains: bf16 out, as the bf16 chain's.
      return fused.fused_dense(x, w, block_size=CHAIN_BLOCK, activation="hard_swish",
                               core=fused.MOSAIC_GPU)

    fns = {"xla_bf16_chain": bf16_chain, "xla_fp8_chain": xla_fp8_chain,
           "pallas_fused_chain": pallas_chain, "pallas_mosaic_fused_chain": mosaic_chain}
    return [(name, fns[name], flops) for name in VARIANTS["chain"]]

  if shape["kind"] == "gemm":
    spec = EinsumSpec.parse("mk,kn->mn")
    flops = 2 * shape["m"] * shape["k"] * shape["n"]
  else:
    spec = EinsumSpec.parse(shape["spec"])
    flops = spec.flops(shape["lhs"], shape["rhs"])
  out = []
  for name in VARIANTS[shape["kind"]]:
    kernel = kernels.get(name)
    out.append((name, (lambda k: lambda a, b: k.einsum(spec, a, b, pass_name="fwd",
                                                       out_dtype=jnp.bfloat16))(kernel), flops))
  return out


def _inputs(shape, seed=0):
  """Random (never zero) bf16 operands: activations with per-row spread, weights N(0, 1/K)."""
  import jax
  import jax.numpy as jnp
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  if shape["kind"] == "batched":
    lhs, rhs = shape["lhs"], shape["rhs"]
    a = jax.random.normal(k1, lhs, jnp.float32) * jnp.exp(
        0.5 * jax.random.normal(k3, lhs[:-1] + (1,)))
    b = jax.random.normal(k2, rhs, jnp.float32)
    return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  m, k, n = shape["m"], shape["k"], shape["n"]
  a = jax.random.normal(k1, (m, k), jnp.float32) * jnp.exp(0.5 * jax.random.normal(k3, (m, 1)))
  w = jax.random.normal(k2, (k, n), jnp.float32) / math.sqrt(k)
  return a.astype(jnp.bfloat16), (w if shape["kind"] == "chain" else w.astype(jnp.bfloat16))


def _backend_tag(compiled_text):
  if "cublas$lt$matmul$f8" in compiled_text:
    return "cublasLt_fp8"
  if "xla.gpu.triton" in compiled_text:
    return "pallas_triton"
  if "mosaic_gpu" in compiled_text:
    return "pallas_mosaic_gpu"
  if "__cublas$lt" in compiled_text or "__cublas$gemm" in compiled_text:
    return "cublas"
  if "triton_gemm" in compiled_text or "__triton" in compiled_text:
    return "xla_triton"
  return "other"


def chosen_variants(shape, s):
  """Selected variants plus those every ratio needs (the baseline; the XLA FP8 chain)."""
  names = VARIANTS[shape["kind"]]
  if _selected(shape["name"], s):
    return list(names)
  always = names[:2] if shape["kind"] == "chain" else names[:1]
  return list(always) + [v for v in names[len(always):] if _selected(v, s)]


def run_shape(shape, device, todo, s):
  """Times the baseline and the `todo` variants of one shape, interleaved; returns their
  rows (a variant that fails records its error, never raises)."""
  import jax

  from loka_jax import timing

  a, b = _inputs(shape)
  variants = _variants(shape)
  base_name = variants[0][0]
  always = VARIANTS[shape["kind"]][:2 if shape["kind"] == "chain" else 1]
  chosen = [v for v in variants if v[0] in always or v[0] in todo]
  errors, backends, ready = {}, {}, {}
  for name, fn, _ in chosen:
    try:
      if s.tune and name.startswith("pallas"):
        jax.block_until_ready(fn(a, b))  # eager call: tunes each Pallas GEMM on a cache miss
      backends[name] = _backend_tag(jax.jit(fn).lower(a, b).compile().as_text())
      ready[name] = (fn, (a, b))
    except Exception as e:  # pylint: disable=broad-except
      errors[name] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
  timings = {}
  if base_name in ready:
    try:
      timings = timing.time_variants(ready, repeats=s.repeats,
                                     min_call_seconds=s.min_call_ms * 1e-3)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      for name in ready:
        errors.setdefault(name, f"timing failed: {type(e).__name__}: {e}"[:2000])
  else:
    errors.setdefault(base_name, "baseline failed")
  flops = {name: fl for name, _, fl in chosen}
  rows = []
  for name, _, _ in chosen:
    row = {"schema": SCHEMA, "shape": shape["name"], "variant": name, "device": device,
           "jax": jax.__version__, "repeats": s.repeats, "baseline": base_name,
           "backend": backends.get(name), "fp8_imprecise_acc": s.fp8_imprecise_acc,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    row.update({k: v for k, v in shape.items() if k != "name"})
    if name in timings:
      t = timings[name]
      row["median_us"] = t.median_us
      row["iters_per_call"] = t.inner
      row["tflops"] = flops[name] / (t.median_us * 1e-6) / 1e12
      point, lo, hi = timing.speedup_ci(timings[base_name], t)
      row["speedup_vs_baseline"] = [lo, point, hi]
      if shape["kind"] == "chain" and "xla_fp8_chain" in timings:
        point, lo, hi = timing.speedup_ci(timings["xla_fp8_chain"], t)
        row["speedup_vs_xla_fp8_chain"] = [lo, point, hi]
    else:
      row["error"] = errors.get(name, "not timed")
    rows.append(row)
  return rows


def load_rows(path):
  rows = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        line = line.strip()
        if line:
          try:
            rows.append(json.loads(line))
          except ValueError:
            print(f"skipping unreadable line in {path}", file=sys.stderr)
  return rows


def latest(rows):
  """The last row of each (shape, variant, device): reruns re-time the baseline."""
  latest = {}
  for r in rows:
    latest[(r.get("shape"), r.get("variant"), r.get("device"))] = r
  return list(latest.values())


def markdown_table(rows):
  def ci(r, key):
    v = r.get(key)
    return "" if not v else f"{v[1]:.2f} [{v[0]:.2f}, {v[2]:.2f}]"
  lines = ["| shape | variant | median us | TFLOP/s | speedup vs baseline [95% CI] | "
           "vs xla_fp8_chain | backend | device | error |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    med = f"{r['median_us']:.1f}" if "median_us" in r else ""
    tf = f"{r['tflops']:.1f}" if "tflops" in r else ""
    err = (r.get("error") or "").replace("|", "/").replace("\n", " ")[:80]
    lines.append(f"| {r['shape']} | {r['variant']} | {med} | {tf} | "
                 f"{ci(r, 'speedup_vs_baseline')} ({r.get('baseline')}) | "
                 f"{ci(r, 'speedup_vs_xla_fp8_chain')} | {r.get('backend') or ''} | "
                 f"{r.get('device')} | {err} |")
  return "\n".join(lines)


# A shape takes up to about a minute: no new shape starts unless this much time is left.
SHAPE_SECONDS = 75


def run(s: Settings, out_dir: str,
        should_stop: Optional[Callable[[float], bool]] = None) -> Tuple[str, str]:
  """Times every selected shape not yet in OUT/results.jsonl, appending its rows, until
  `should_stop(SHAPE_SECONDS)` says no shape fits; writes OUT/table.md of every row and
  returns (device kind, markdown table). Raises RuntimeError off a GPU unless `s.smoke`."""
  start = time.time()
  os.makedirs(out_dir, exist_ok=True)
  setup_env(out_dir, s)
  import jax
  jax.config.update("jax_compilation_cache_dir",
                    s.compile_cache or os.path.join(os.path.expanduser("~"), ".cache",
                                                    "loka_jax", "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if jax.default_backend() != "gpu" and not s.smoke:
    raise RuntimeError("bench_kernels times GPU kernels; run it on the GPU host "
                       "(--config.select.smoke=true checks its code paths anywhere)")
  device = jax.devices()[0].device_kind
  path = os.path.join(out_dir, "results.jsonl")
  done = {(r["shape"], r["variant"], r["device"]) for r in load_rows(path)}
  for shape in shapes(s):
    if not shape_selected(shape, s):
      continue
    todo = [v for v in chosen_variants(shape, s) if (shape["name"], v, device) not in done]
    if not todo:
      print(f"skip {shape['name']} (done)")
      continue
    elapsed = time.time() - start
    if should_stop and should_stop(SHAPE_SECONDS):
      print(f"stopping after {elapsed:.0f}s (limits.max_minutes={s.max_minutes}); "
            "rerun to resume")
      break
    print(f"running {shape['name']} ({elapsed:.0f}s elapsed)", flush=True)
    try:
      rows = run_shape(shape, device, todo, s)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      rows = [{"schema": SCHEMA, "shape": shape["name"], "variant": "*", "device": device,
               "error": f"{type(e).__name__}: {e}"[:2000]}]
    with open(path, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
    jax.clear_caches()  # drop this shape's executables; the persistent cache keeps them
  table = markdown_table(latest(load_rows(path)))
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(f"card: {device}\n\n{table}\n")
  return device, table
