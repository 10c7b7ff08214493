"""The FP8 GEMM core: batched 2-D tiles, rowwise or per-K-block scales, fused epilogue.

Computes out[b, m, n] = epilogue(sum_k A[b, m, k] B[b, k, n] * scales) where each operand is
stored either as the product wants it or transposed (A as (K, M), B as (N, K)): the tile is
loaded in its stored layout and the dot contracts the right axis, so dgrad `G W^T` and
wgrad `X^T G` never materialize a transpose. Batch entries go on the grid (Triton dots are
2-D). Every load and store is masked on the M, N and batch tails and the K tail gets its own
masked step, so shapes need not be multiples of the tiles. A long K under a small output (the
weight gradient of a site over a long flattened batch) is cut into slices that run as batch
entries and are summed in fp32 afterwards (`split_k_for`), so the GPU gets enough programs.

Scales:
  rowwise: sa (B, M), sb (B, N), applied once to the fp32 accumulator.
  block:   sa (B, KB, M), sb (B, KB, N), one row per 128-wide K block: each K block's
           partial product is promoted to fp32 and scaled before it is accumulated.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import compat, tuning
from kernels_pallas import epilogue as epilogue_lib
from kernels_pallas.quantize import finite_abs, saturating_cast, scale_from_amax
from loka_jax.precision import E4M3
from loka_jax.precision.qtensor import BLOCK

ROWWISE_SCALES = "rowwise"
BLOCK_SCALES = "block"


def _and(*masks):
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = out & m
  return out


def _load(ref, mask, other=0.0):
  return compat.load(ref) if mask is None else compat.load(ref, mask=mask, other=other)


def _store(ref, value, mask):
  if mask is None:
    compat.store(ref, value)
  else:
    compat.store(ref, value, mask=mask)


def _gemm_kernel(a_ref, b_ref, sa_ref, sb_ref, *refs, dims, a_t, b_t, scales, cfg, ep):
  Bt, M, N, K = dims
  bm, bn, bk, ns, g = cfg.block_m, cfg.block_n, cfg.block_k, cfg.n_sub, cfg.batch_per_program
  refs = list(refs)
  bias_ref = refs.pop(0) if ep.bias else None
  if ep.quantize_output:
    q_ref, qs_ref = refs.pop(0), refs.pop(0)
  else:
    o_ref = refs.pop(0)
  pre_ref = refs.pop(0) if ep.emit_pre else None

  pb, pm, pn = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  traced_zero = pb * 0  # read program ids here: interpret mode cannot inside nested loops
  m0 = pm * bm
  rows = m0 + jnp.arange(bm)
  m_ok = (rows < M) if M % bm else None
  col0 = [pn * (bn * ns) + s * bn for s in range(ns)]
  cols = [c + jnp.arange(bn) for c in col0]
  n_ok = [(c < N) if N % (bn * ns) else None for c in cols]

  def one_batch(t, carry):
    bi = pb * g + t
    b_ok = (bi < Bt) if Bt % g else None

    def k_step(k, accs, k_tail):
      k0 = k * bk
      ks = k0 + jnp.arange(bk)
      k_ok = (ks < K) if k_tail else None
      if a_t:   # A stored (K, M): load (bk, bm) and contract its first axis
        a_mask = _and(None if k_ok is None else k_ok[:, None],
                      None if m_ok is None else m_ok[None, :], b_ok)
        a = _load(a_ref.at[bi, pl.ds(k0, bk), pl.ds(m0, bm)], a_mask)
      else:
        a_mask = _and(None if m_ok is None else m_ok[:, None],
                      None if k_ok is None else k_ok[None, :], b_ok)
        a = _load(a_ref.at[bi, pl.ds(m0, bm), pl.ds(k0, bk)], a_mask)
      if scales == BLOCK_SCALES:
        kb = k0 // BLOCK
        sa_k = _load(sa_ref.at[bi, kb, pl.ds(m0, bm)], _and(m_ok, b_ok))
      out = []
      for s in range(ns):
        nk = None if n_ok[s] is None else n_ok[s]
        if b_t:  # B stored (N, K): load (bn, bk) and contract its second axis
          b_mask = _and(None if nk is None else nk[:, None],
                        None if k_ok is None else k_ok[None, :], b_ok)
          b = _load(b_ref.at[bi, pl.ds(col0[s], bn), pl.ds(k0, bk)], b_mask)
        else:
          b_mask = _and(None if k_ok is None else k_ok[:, None],
                        None if nk is None else nk[None, :], b_ok)
          b = _load(b_ref.at[bi, pl.ds(k0, bk), pl.ds(col0[s], bn)], b_mask)
        part = compat.dot(a, b, trans_a=a_t, trans_b=b_t)
        if scales == BLOCK_SCALES:
          sb_k = _load(sb_ref.at[bi, kb, pl.ds(col0[s], bn)], _and(nk, b_ok))
          part = part * sa_k[:, None] * sb_k[None, :]
        out.append(accs[s] + part)
      return tuple(out)

    accs = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(ns))
    accs = lax.fori_loop(0, K // bk, functools.partial(k_step, k_tail=False), accs)
    if K % bk:
      # A traced index: Pallas rejects a static slice reaching past the array even when
      # the load is masked.
      accs = k_step(traced_zero + K // bk, accs, k_tail=True)

    if scales == ROWWISE_SCALES:
      sa_v = _load(sa_ref.at[bi, pl.ds(m0, bm)], _and(m_ok, b_ok))
    ys = []
    for s in range(ns):
      y = accs[s]
      if scales == ROWWISE_SCALES:
        sb_v = _load(sb_ref.at[bi, pl.ds(col0[s], bn)], _and(n_ok[s], b_ok))
        y = y * sa_v[:, None] * sb_v[None, :]
      if ep.bias:
        y = y + _load(bias_ref.at[pl.ds(col0[s], bn)], n_ok[s])[None, :]
      if n_ok[s] is not None:  # columns past N must not enter BlockNorm or the row amax
        y = jnp.where(n_ok[s][None, :], y, 0.0)
      out_mask = _and(None if m_ok is None else m_ok[:, None],
                      None if n_ok[s] is None else n_ok[s][None, :], b_ok)
      if ep.emit_pre:
        _store(pre_ref.at[bi, pl.ds(m0, bm), pl.ds(col0[s], bn)], y.astype(pre_ref.dtype),
               out_mask)
      if ep.block_size is not None:
        y = epilogue_lib.block_norm_tile(y, col0[s], N, ep.eps)
      y = epilogue_lib.activate(y, ep.activation)
      if ep.quantize_output:
        ys.append((y, out_mask))
      else:
        _store(o_ref.at[bi, pl.ds(m0, bm), pl.ds(col0[s], bn)], y.astype(o_ref.dtype), out_mask)
    if ep.quantize_output:  # the program holds whole rows: rowwise scales for the next layer
      amax = jnp.zeros((bm,), jnp.float32)
      for y, _ in ys:
        amax = jnp.maximum(amax, jnp.max(finite_abs(y), axis=1))
      scale = scale_from_amax(amax, E4M3.max)
      for s, (y, out_mask) in enumerate(ys):
        _store(q_ref.at[bi, pl.ds(m0, bm), pl.ds(col0[s], bn)],
               saturating_cast(y / scale[:, None], E4M3), out_mask)
      _store(qs_ref.at[bi, pl.ds(m0, bm)], scale, _and(m_ok, b_ok))
    return carry

  if g == 1:
    one_batch(0, 0)
  else:
    lax.fori_loop(0, g, one_batch, 0)


def validate_config(cfg: tuning.TileConfig, dims, ep: epilogue_lib.Epilogue, scales: str,
                    dtype=jnp.float8_e4m3fn) -> Optional[str]:
  """Why this tile config cannot run this problem (None when it can)."""
  Bt, M, N, K = dims
  for name in ("block_m", "block_n", "block_k"):
    v = getattr(cfg, name)
    if v < 1 or v & (v - 1):
      return f"{name}={v} must be a power of two (a Triton tile)"
  if cfg.n_sub < 1 or cfg.batch_per_program < 1:
    return "n_sub and batch_per_program must be >= 1"
  min_k = 32 if jnp.dtype(dtype).itemsize == 1 else 16
  if cfg.block_m < 16 or cfg.block_n < 16 or cfg.block_k < min_k:
    return f"Triton dot tiles need block_m, block_n >= 16 and block_k >= {min_k}"
  if ep.block_size is not None and cfg.block_n != ep.block_size:
    return f"BlockNorm needs block_n == block_size ({ep.block_size}), got {cfg.block_n}"
  if ep.quantize_output and cfg.block_n * cfg.n_sub < N:
    return (f"output quantization needs whole rows in one program: block_n * n_sub "
            f"({cfg.block_n * cfg.n_sub}) < N ({N})")
  if scales == BLOCK_SCALES and BLOCK % cfg.block_k:
    return f"block scales need block_k dividing {BLOCK}, got {cfg.block_k}"
  if cfg.block_m * cfg.block_n * cfg.n_sub > 65536:
    return "accumulator tile larger than 64K elements"
  smem = shared_memory_bytes(cfg, dtype)
  if smem > SMEM_BUDGET:
    return (f"pipelined operand tiles need ~{smem // 1024} KiB of shared memory "
            f"(> {SMEM_BUDGET // 1024} KiB); lower num_stages or block_k")
  return None


SMEM_BUDGET = 192 * 1024  # below the 227 KiB a Hopper block may use, leaving room for Triton


def shared_memory_bytes(cfg: tuning.TileConfig, dtype=jnp.float8_e4m3fn) -> int:
  """Operand tiles held in shared memory by a pipelined K loop (one buffer per stage)."""
  per_stage = (cfg.block_m + cfg.block_n * cfg.n_sub) * cfg.block_k * jnp.dtype(dtype).itemsize
  return per_stage * max(1, cfg.num_stages)


def _stages_that_fit(bm, bn, bk, ns, max_stages=3):
  per_stage = (bm + bn * ns) * bk
  return max(1, min(max_stages, SMEM_BUDGET // per_stage))


def _prev_pow2(n: int) -> int:
  return 1 << (max(1, int(n)).bit_length() - 1)


MAX_FULL_ROW = 2048  # widest N whose rows one program can hold for output quantization


def default_config(dims, ep: epilogue_lib.Epilogue, scales: str) -> tuning.TileConfig:
  """A sane config by shape class when nothing is cached."""
  Bt, M, N, K = dims
  p2 = compat.next_pow2
  bk = 128 if K >= 128 else max(32, p2(K))
  if ep.block_size is not None:
    bn = ep.block_size
  else:
    bn = min(128, max(16, p2(N)))
  if ep.quantize_output:
    ns = -(-N // bn)  # accumulators side by side (any count: each is its own tile)
    # ~16K fp32 accumulators per program: N=1024 -> 16 rows, 512 -> 32, 256 -> 64.
    bm = max(16, min(64, p2(M), _prev_pow2(16384 // (bn * ns)) if bn * ns <= 16384 else 16))
    # The whole weight row block is staged per K step: the longest K step that still
    # pipelines (2+ stages in shared memory).
    bk = next((k for k in (bk, 64, 32) if k <= bk and _stages_that_fit(bm, bn, k, ns) >= 2),
              32)
    warps = 8 if bm * bn * ns >= 16384 else 4
    return tuning.TileConfig(bm, bn, bk, ns, warps, _stages_that_fit(bm, bn, bk, ns), 1)
  bm = max(16, min(p2(M), 128 if (M >= 2048 and N >= 512) else 64,
                   _prev_pow2(32768 // bn)))  # at most 32K fp32 accumulators
  bk = next((k for k in (bk, 64, 32) if k <= bk and _stages_that_fit(bm, bn, k, 1) >= 2), 32)
  if Bt > 1 and M <= 128 and N <= 128:  # interaction shapes: one small problem per program
    return tuning.TileConfig(bm, bn, bk, 1, 4, min(2, _stages_that_fit(bm, bn, bk, 1)), 1)
  warps = 8 if bm * bn >= 16384 else 4
  return tuning.TileConfig(bm, bn, bk, 1, warps, _stages_that_fit(bm, bn, bk, 1), 1)


def candidate_configs(dims, ep: epilogue_lib.Epilogue, scales: str, dtype=jnp.float8_e4m3fn):
  """At most tuning.MAX_CANDIDATES valid configs for this shape class."""
  Bt, M, N, K = dims
  base = default_config(dims, ep, scales)
  T = tuning.TileConfig
  cands = [base]
  if ep.quantize_output:
    for bm in (16, 32, 64):
      for bk in (32, 64, 128):
        for warps in (4, 8):
          stages = _stages_that_fit(bm, base.block_n, bk, base.n_sub)
          cands.append(T(bm, base.block_n, bk, base.n_sub, warps, stages, 1))
  elif Bt > 1 and M <= 128 and N <= 128:
    for g in (1, 2, 4, 8):
      for warps, stages in ((4, 2), (4, 3), (2, 2)):
        cands.append(T(base.block_m, base.block_n, base.block_k, 1, warps, stages, g))
  else:
    bns = (base.block_n,) if ep.block_size is not None else (64, 128, 256)
    for bm, bn, bk, warps, stages in (
        (128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 64, 128, 4, 4), (64, 64, 128, 4, 4),
        (128, 256, 128, 8, 3), (64, 256, 128, 8, 3), (128, 128, 64, 4, 4), (32, 128, 128, 4, 4),
        (16, 128, 128, 4, 4), (256, 128, 128, 8, 3), (64, 128, 64, 4, 5)):
      if bn in bns or ep.block_size is not None:
        cands.append(T(bm, bns[0] if ep.block_size is not None else bn, bk, 1, warps, stages, 1))
  return tuning.filter_candidates(
      cands, lambda c: validate_config(c, dims, ep, scales, dtype) is None)


# Programs a GEMM should launch to fill the GPU: about two waves of an H100's or H200's 132 SMs.
TARGET_PROGRAMS = 256
# The least K one slice of a split sums over: 16 K steps of 128, which amortize a program's
# start and its fp32 partial output.
MIN_SPLIT_K = 2048


def _splittable(a_t: bool, b_t: bool, epilogue: epilogue_lib.Epilogue) -> bool:
  """Whether K can be sliced as a free reshape: both operands K first, a plain epilogue."""
  return a_t and not b_t and epilogue == epilogue_lib.Epilogue()


def split_k_for(dims, *, a_t: bool, b_t: bool, epilogue: epilogue_lib.Epilogue,
                scales: str = ROWWISE_SCALES) -> int:
  """Slices to cut K into (1: none), each summed by its own programs, then added in fp32.

  A weight gradient `X^T G` of a site over a long flattened batch has a small output and a
  long K: InterFormer `small`'s sequence attention projections have grad_rhs (128 x 128)
  summed over K = 540,672, two programs of the default tile that loop 4,224 K steps each
  while the other SMs of the GPU idle. Splitting is offered where it is a free reshape: both
  operands stored K first (A as (K, M), B as (K, N): the layout of every grad_rhs), a plain
  epilogue (a bias, norm, activation or output quantization needs the whole sum) and K a
  multiple of 128-wide blocks per slice (so block scales split with it). Slices double while
  the programs stay within TARGET_PROGRAMS and each slice keeps MIN_SPLIT_K."""
  Bt, M, N, K = dims
  if not _splittable(a_t, b_t, epilogue):
    return 1
  cfg = default_config(dims, epilogue, scales)
  programs = (-(-Bt // cfg.batch_per_program) * -(-M // cfg.block_m)
              * -(-N // (cfg.block_n * cfg.n_sub)))
  splits = 1
  while (programs * splits * 2 <= TARGET_PROGRAMS and K // (splits * 2) >= MIN_SPLIT_K
         and K % (splits * 2 * BLOCK) == 0):
    splits *= 2
  return splits


def _split_k_gemm(a, b, sa, sb, splits: int, *, scales: str, out_dtype, kernel_name: str):
  """`gemm` of K-first operands as `splits` slices of K on the batch axis, summed in fp32."""
  Bt, K = a.shape[0], a.shape[1]
  slice_k = K // splits
  a_s = a.reshape(Bt * splits, slice_k, a.shape[2])   # (Bt, K, M) -> (Bt * S, K / S, M)
  b_s = b.reshape(Bt * splits, slice_k, b.shape[2])
  if scales == ROWWISE_SCALES:  # one scale per row and per column: the same in every slice
    sa_s, sb_s = jnp.repeat(sa, splits, axis=0), jnp.repeat(sb, splits, axis=0)
  else:                         # one scale row per 128-wide K block: each slice takes its own
    sa_s = sa.reshape(Bt * splits, -1, sa.shape[2])
    sb_s = sb.reshape(Bt * splits, -1, sb.shape[2])
  parts = gemm(a_s, b_s, sa_s, sb_s, a_t=True, b_t=False, scales=scales,
               out_dtype=jnp.float32, kernel_name=kernel_name, split_k=1)
  return parts.reshape(Bt, splits, *parts.shape[1:]).sum(axis=1).astype(out_dtype)


def shape_key(dims, a_t, b_t, scales, ep, dtype, out_dtype) -> str:
  Bt, M, N, K = dims
  return (f"b{Bt}_m{M}_n{N}_k{K}_{'t' if a_t else 'n'}{'t' if b_t else 'n'}_{scales}_"
          f"{ep.tag}_{jnp.dtype(dtype).name}_{jnp.dtype(out_dtype).name}")


def gemm(a, b, sa, sb, *, a_t: bool = False, b_t: bool = False, scales: str = ROWWISE_SCALES,
         epilogue: epilogue_lib.Epilogue = epilogue_lib.Epilogue(), bias=None,
         out_dtype=jnp.bfloat16, pre_dtype=jnp.float32,
         config: Optional[tuning.TileConfig] = None, kernel_name: str = "pallas_gemm",
         split_k: Optional[int] = None):
  """The batched scaled GEMM on 3-D operands (see the module docstring for layouts).

  Returns out (B, M, N), or (q (B, M, N) e4m3, q_scale (B, M)) when quantizing the output;
  plus pre (B, M, N) when epilogue.emit_pre. `split_k`: slices of K summed apart, then
  added in fp32 (`split_k_for`); None chooses it when no `config` is given, 1 never splits.
  """
  if a.ndim != 3 or b.ndim != 3:
    raise ValueError(f"gemm: operands must be 3-D (batch first), got {a.shape}, {b.shape}")
  if a.dtype != b.dtype:
    raise ValueError(f"gemm: Triton dots need one operand dtype, got {a.dtype} and {b.dtype}; "
                     "quantize both to e4m3 (gradients: e4m3 with rowwise scales) or upcast")
  Bt = a.shape[0]
  M, Ka = (a.shape[2], a.shape[1]) if a_t else (a.shape[1], a.shape[2])
  N, Kb = (b.shape[1], b.shape[2]) if b_t else (b.shape[2], b.shape[1])
  if b.shape[0] != Bt or Ka != Kb:
    raise ValueError(f"gemm: shapes {a.shape} (a_t={a_t}) and {b.shape} (b_t={b_t}) do not "
                     "form a batched product")
  K = Ka
  dims = (Bt, M, N, K)
  if scales == ROWWISE_SCALES:
    want_a, want_b = (Bt, M), (Bt, N)
  elif scales == BLOCK_SCALES:
    nkb = pl.cdiv(K, BLOCK)
    want_a, want_b = (Bt, nkb, M), (Bt, nkb, N)
  else:
    raise ValueError(f"gemm: unknown scales mode {scales!r}")
  if sa.shape != want_a or sb.shape != want_b:
    raise ValueError(f"gemm: {scales} scales must have shapes {want_a} and {want_b}, got "
                     f"{sa.shape} and {sb.shape}")
  if epilogue.bias and (bias is None or bias.shape != (N,)):
    raise ValueError(f"gemm: epilogue has a bias: pass one of shape ({N},), got "
                     f"{None if bias is None else bias.shape}")
  if epilogue.quantize_output and N > MAX_FULL_ROW:
    raise ValueError(f"gemm: output quantization holds whole rows in one program; N={N} "
                     f"exceeds {MAX_FULL_ROW} (quantize the output with kernels_pallas.quantize)")
  if split_k is None:
    split_k = (1 if config is not None else
               split_k_for(dims, a_t=a_t, b_t=b_t, epilogue=epilogue, scales=scales))
  if split_k > 1:
    if not _splittable(a_t, b_t, epilogue) or config is not None or K % (split_k * BLOCK):
      raise ValueError(f"gemm: split_k={split_k} needs both operands stored K first "
                       f"(a_t=True, b_t=False; got {a_t}, {b_t}), a plain epilogue, no fixed "
                       f"config and K a multiple of {split_k} x {BLOCK} (K={K})")
    return _split_k_gemm(a, b, sa, sb, split_k, scales=scales, out_dtype=out_dtype,
                         kernel_name=kernel_name)
  key = shape_key(dims, a_t, b_t, scales, epilogue, a.dtype, out_dtype)
  if config is None:
    default = default_config(dims, epilogue, scales)

    def runner(cfg):
      # A jittable call, not an eager one: eager calls time Python tracing and dispatch
      # (~22 ms per call on H200), not the kernel (30-3000 us).
      def call(a, b, sa, sb, bias):
        return gemm(a, b, sa, sb, a_t=a_t, b_t=b_t, scales=scales, epilogue=epilogue,
                    bias=bias, out_dtype=out_dtype, pre_dtype=pre_dtype, config=cfg)
      return call, (a, b, sa, sb, bias)
    concrete = compat.concrete(a, b, sa, sb, bias)
    config = tuning.choose(kernel_name, key, default,
                           candidate_configs(dims, epilogue, scales, a.dtype),
                           runner if concrete else None)
  problem = validate_config(config, dims, epilogue, scales, a.dtype)
  if problem:
    raise ValueError(f"gemm {key}: tile config {config} invalid: {problem}")
  sa = sa.astype(jnp.float32)
  sb = sb.astype(jnp.float32)
  out_shape = []
  if epilogue.quantize_output:
    out_shape += [jax.ShapeDtypeStruct((Bt, M, N), E4M3.dtype),
                  jax.ShapeDtypeStruct((Bt, M), jnp.float32)]
  else:
    out_shape.append(jax.ShapeDtypeStruct((Bt, M, N), out_dtype))
  if epilogue.emit_pre:
    out_shape.append(jax.ShapeDtypeStruct((Bt, M, N), pre_dtype))
  args = [a, b, sa, sb]
  if epilogue.bias:
    args.append(bias.astype(jnp.float32))
  grid = (pl.cdiv(Bt, config.batch_per_program), pl.cdiv(M, config.block_m),
          pl.cdiv(N, config.block_n * config.n_sub))
  kernel = functools.partial(_gemm_kernel, dims=dims, a_t=a_t, b_t=b_t, scales=scales,
                             cfg=config, ep=epilogue)
  outs = pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=grid,
      compiler_params=compat.compiler_params(config.num_warps, config.num_stages),
      interpret=compat.use_interpret(), name=f"loka_{kernel_name}")(*args)
  return outs[0] if len(outs) == 1 else tuple(outs)


def reference(a_deq, b_deq, *, a_t=False, b_t=False, epilogue=epilogue_lib.Epilogue(),
              bias=None, out_dtype=jnp.float32):
  """Kernel-correctness reference: fp32 HIGHEST product of dequantized operands + epilogue."""
  a = jnp.swapaxes(a_deq, 1, 2) if a_t else a_deq
  b = jnp.swapaxes(b_deq, 1, 2) if b_t else b_deq
  z = jnp.einsum("bmk,bkn->bmn", a.astype(jnp.float32), b.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST)
  return epilogue_lib.reference(z, epilogue, bias).astype(out_dtype)
