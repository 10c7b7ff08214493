"""The FP8 GEMM core on Pallas' Mosaic GPU backend: TMA-pipelined Hopper wgmma + epilogue.

Computes out[b, m, n] = epilogue(sum_k A[b, m, k] B[b, n, k] * sa[b, m] * sb[b, n]) with
e4m3 operands and one fp32 scale per row of each (rowwise), or with one scale per row and
128-wide K block (block scales, 1x128 and 128x128 blocks as `products.block_operands` makes
them). Each program owns one (block_m, block_n) output tile of one batch entry:
`plgpu.emit_pipeline` streams (block_m, 128) and (block_n, 128) operand tiles into swizzled
shared memory by TMA, several K steps ahead, and each step issues one FP8 wgmma into an fp32
accumulator held in registers. The tensor cores accumulate FP8 products at a precision of
their own (about 14 bits kept on an H800, per DeepSeek-V3's technical report,
arXiv:2412.19437, section 3.3); a precise product (and every one with block scales) takes
each K step's 128 products out into an fp32 sum in registers instead, scaled by its K
block's scales first. The epilogue (row and column scales, bias, BlockNorm over the tile,
ReLU or Hard Swish, and optionally rowwise e4m3 quantization of the result for the next
layer when a tile holds whole rows) runs on the accumulator, and the output tile (and, for a
training forward, the pre-norm value) leaves through shared memory by TMA; those tiles take
the shared memory the K loop's operand stages held, so a wide fp32 epilogue leaves the
pipeline its full depth (`shared_memory_bytes` counts a program's shared memory as Mosaic
GPU allocates it).

Hopper's wgmma reads 8-bit operands only K-major, so both operands are stored with K last:
A as (B, M, K), B as (B, N, K). The products wrapper (`rowwise_einsum`) quantizes each
operand of a pass and transposes the e4m3 codes where its layout has K first. wgmma tiles
are multiples of 64 rows and at most 256 columns; operands are zero-padded to whole tiles
(a no-op for the aligned shapes of the towers) and the output is sliced back, so any shape
runs. The Triton core (`kernels_pallas.gemm`) takes the other layouts without a transpose
but lowers FP8 dots to f16 `mma.sync` (`compat.fp8_imprecise_acc`); this one keeps FP8 on
the tensor cores.

On the CPU the kernel runs in jax's GPU interpret mode, which simulates shared memory, TMA
and barriers; it cannot read a transposed shared-memory view, so there B is passed as
(B, K, N) and read without a transposed view (the numbers are the same, the layout is not).
`lowered_for_cuda` checks the compiled kernel's structure (wgmma shapes, layouts, shared
memory) on a machine without a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import compat
from kernels_pallas import epilogue as epilogue_lib
from kernels_pallas import mosaic_epilogue, mosaic_ws, products, tuning
from loka_jax import _compat
from loka_jax.kernels.spec import EinsumSpec
from loka_jax.precision import E4M3, scaling

BLOCK_K = 128          # one 128-byte swizzled row of e4m3 codes: wgmma's K group
ROWWISE_SCALES = "rowwise"
BLOCK_SCALES = "block"  # one scale per 128-wide K block (BLOCK_K == qtensor.BLOCK)
WGMMA_M = 64           # Hopper's wgmma instruction height
MAX_BLOCK_N = 256      # the widest wgmma
# Shared memory a Hopper (H100/H200) block may use, and how Mosaic GPU lays it out: every
# buffer starts on a 1 KiB boundary, each barrier takes 8 bytes, and a row reduction
# (BlockNorm's sum of squares) reserves its compiler's default scratch.
SMEM_LIMIT = 227 * 1024
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4
EPILOGUE_BARRIERS = 3  # the row scales, column scales and bias tiles each arrive on one
MAX_STAGES = 4
# Registers: the accumulator is block_m x block_n fp32 over one warpgroup's 128 threads.
MAX_ACC_ELEMENTS = 128 * 128
# Programs that fill an H100/H200 (132 SMs): below this, 64-row tiles double the programs.
TARGET_PROGRAMS = 132


@dataclasses.dataclass(frozen=True)
class MosaicConfig(tuning.Config):
  """A program's output tile and how many K steps its pipeline keeps in flight.

  compute_wgs: 1, one warpgroup copies and computes a (block_m, block_n) tile; 2, the
  warp-specialized core (`mosaic_ws`): a memory warpgroup feeds two compute warpgroups of
  block_m rows each, a (2 * block_m, block_n) tile (rowwise scales, the whole K
  accumulated on the tensor cores)."""
  block_m: int
  block_n: int
  stages: int
  compute_wgs: int = 1


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _aligned(nbytes: int) -> int:
  return _round_up(nbytes, SMEM_ALIGNMENT)


def _output_tiles(rows: int, bn: int, ep: epilogue_lib.Epilogue, out_dtype, pre_dtype) -> int:
  """Shared memory of the epilogue's outputs staged for TMA, over `rows` rows (one buffer
  for all of a program's warpgroups): the output, or its e4m3 codes and one fp32 scale a row;
  the pre-norm value; and a row reduction's scratch (BlockNorm's sum, the quantization's
  amax)."""
  if ep.quantize_output:
    tiles = _aligned(rows * bn) + _aligned(rows * 4)
  else:
    tiles = _aligned(rows * bn * jnp.dtype(out_dtype).itemsize)
  if ep.emit_pre:
    tiles += _aligned(rows * bn * jnp.dtype(pre_dtype).itemsize)
  if ep.block_size is not None or ep.quantize_output:
    tiles += REDUCTION_SCRATCH_BYTES
  return tiles


def shared_memory_bytes(cfg: MosaicConfig, ep: epilogue_lib.Epilogue, out_dtype=jnp.bfloat16,
                        pre_dtype=jnp.float32, block_scales: bool = False,
                        k_steps: Optional[int] = None) -> int:
  """The shared memory Mosaic GPU allocates for one program, counted as it counts it.

  The epilogue's scale and bias tiles stay for the whole program. The K loop's operand
  stages (e4m3, one byte a code, and with block scales one fp32 row per operand a stage)
  are released when it ends, and the output tiles staged for TMA reuse their space, so a
  program needs the larger of the two. A pipeline of `k_steps` K steps keeps no more stages
  than it has steps."""
  bm, bn = cfg.block_m, cfg.block_n
  stages = cfg.stages if k_steps is None else min(cfg.stages, k_steps)
  if cfg.compute_wgs > 1:
    # Every buffer lives for the whole program: A stages of both warpgroups' rows, B stages,
    # each warpgroup's output tiles, scales (and bias); a stage has a barrier for full and
    # one for consumed, and each warpgroup's vectors arrive on one each.
    wgs, vectors = cfg.compute_wgs, 3 if ep.bias else 2
    pipeline = _aligned(stages * wgs * bm * BLOCK_K) + _aligned(stages * bn * BLOCK_K)
    vector_tiles = _aligned(wgs * bm * 4) + _aligned(wgs * bn * 4) * (vectors - 1)
    tiles = _output_tiles(wgs * bm, bn, ep, out_dtype, pre_dtype) + vector_tiles
    return pipeline + tiles + (2 * stages + vectors * wgs) * BARRIER_BYTES
  resident = 0 if block_scales else _aligned(bm * 4) + _aligned(bn * 4)
  if ep.bias:
    resident += _aligned(bn * 4)
  pipeline = _aligned(stages * bm * BLOCK_K) + _aligned(stages * bn * BLOCK_K)
  if block_scales:
    pipeline += _aligned(stages * bm * 4) + _aligned(stages * bn * 4)
  tiles = _output_tiles(bm, bn, ep, out_dtype, pre_dtype)
  barriers = (EPILOGUE_BARRIERS + stages) * BARRIER_BYTES
  return resident + max(pipeline, tiles) + barriers


def validate_config(cfg: MosaicConfig, dims, ep: epilogue_lib.Epilogue,
                    out_dtype=jnp.bfloat16, pre_dtype=jnp.float32,
                    promote: bool = False, block_scales: bool = False) -> Optional[str]:
  """Why this config cannot run this problem (None when it can). `promote`: each K step's
  product is summed in registers beside the accumulator, which holds twice the values
  (always so with `block_scales`, whose rows of scales are staged with the operands)."""
  if cfg.compute_wgs not in (1, mosaic_ws.COMPUTE_WGS):
    return f"compute_wgs={cfg.compute_wgs} must be 1 or {mosaic_ws.COMPUTE_WGS}"
  if cfg.compute_wgs > 1:
    reason = mosaic_ws.unsupported(block_scales, promote)
    if reason:
      return reason
  promote = promote or block_scales
  if cfg.block_m < WGMMA_M or cfg.block_m % WGMMA_M:
    return f"block_m={cfg.block_m} must be a multiple of {WGMMA_M} (wgmma's height)"
  if cfg.block_n not in (64, 128, 256):
    return f"block_n={cfg.block_n} must be 64, 128 or 256 (a wgmma width)"
  acc_limit = MAX_ACC_ELEMENTS // 2 if promote else MAX_ACC_ELEMENTS
  if cfg.block_m * cfg.block_n > acc_limit:
    return (f"accumulator {cfg.block_m}x{cfg.block_n}{' and its fp32 sum' if promote else ''} "
            f"exceed {MAX_ACC_ELEMENTS} fp32 values (128 registers a thread)")
  if ep.block_size is not None and cfg.block_n != ep.block_size:
    return f"BlockNorm needs block_n == block_size ({ep.block_size}), got {cfg.block_n}"
  if ep.quantize_output and cfg.block_n < dims[2]:
    return (f"output quantization needs whole rows in one program: block_n={cfg.block_n} "
            f"< N={dims[2]}")
  if cfg.stages < 2:
    return "stages must be >= 2 (each step's operand slots are released a step late)"
  smem = shared_memory_bytes(cfg, ep, out_dtype, pre_dtype, block_scales,
                             k_steps=-(-dims[3] // BLOCK_K))
  if smem > SMEM_LIMIT:
    return (f"{cfg.stages} stages or the output tiles need {smem} bytes of shared memory "
            f"(> {SMEM_LIMIT}); lower stages or the tile")
  return None


def unsupported_epilogue(ep: epilogue_lib.Epilogue, n: Optional[int] = None) -> Optional[str]:
  """Why no tile of this core can run the epilogue on `n` output columns (None when one
  can; without `n`, whether one can for some width)."""
  if ep.block_size is not None and ep.block_size not in (64, 128, 256):
    return (f"BlockNorm({ep.block_size}) needs one tile a block, and a Mosaic GPU tile is "
            "64, 128 or 256 columns wide")
  widest = MAX_BLOCK_N if ep.block_size is None else ep.block_size
  if ep.quantize_output and n is not None and n > widest:
    what = "the widest wgmma" if ep.block_size is None else "a BlockNorm block's tile"
    return (f"output quantization needs each row in one tile, and N={n} is wider than "
            f"{widest} columns ({what})")
  return None


def _row_width(n: int) -> int:
  """The narrowest wgmma width that holds a whole row of n columns."""
  return next(w for w in (64, 128, MAX_BLOCK_N) if w >= n or w == MAX_BLOCK_N)


def default_config(dims, ep: epilogue_lib.Epilogue, out_dtype=jnp.bfloat16,
                   pre_dtype=jnp.float32, promote: bool = False,
                   block_scales: bool = False) -> MosaicConfig:
  """The tile by shape class: 128 columns (64 for narrow outputs, the block for BlockNorm),
  128 rows unless that leaves the GPU short of programs (or the registers short of room for
  a promoted sum), and as many stages as fit."""
  Bt, M, N, _ = dims
  if ep.block_size is not None:
    bn = ep.block_size
  elif ep.quantize_output:
    bn = _row_width(N)
  else:
    bn = 64 if N <= 64 else 128
  bm = 128
  if M <= WGMMA_M or Bt * -(-M // 128) * -(-N // bn) < TARGET_PROGRAMS:
    bm = WGMMA_M
  promote = promote or block_scales
  bm = max(WGMMA_M, min(bm, (MAX_ACC_ELEMENTS // (2 if promote else 1)) // bn))
  stages = MAX_STAGES
  while stages > 2 and validate_config(MosaicConfig(bm, bn, stages), dims, ep, out_dtype,
                                       pre_dtype, promote, block_scales):
    stages -= 1
  return MosaicConfig(bm, bn, stages)


def candidate_configs(dims, ep: epilogue_lib.Epilogue, out_dtype=jnp.bfloat16,
                      pre_dtype=jnp.float32, promote: bool = False,
                      block_scales: bool = False):
  """The default tile and the valid ones around it (at most tuning.MAX_CANDIDATES): 64 or
  128 rows, 64 to 256 columns (the block for BlockNorm, whole rows for output
  quantization), 2 to 4 stages, and warp-specialized tiles where rowwise scales meet the
  tensor cores' own accumulation."""
  default = default_config(dims, ep, out_dtype, pre_dtype, promote, block_scales)
  if ep.block_size is not None:
    widths = (ep.block_size,)
  elif ep.quantize_output:
    widths = tuple(w for w in (64, 128, MAX_BLOCK_N) if w >= _row_width(dims[2]))
  else:
    widths = (128, 64, 256)
  # Cached: the warp-specialized tiles are checked when picked and again with the rest.
  valid = functools.cache(lambda c: validate_config(c, dims, ep, out_dtype, pre_dtype, promote,
                                                    block_scales) is None)
  # Up to three warp-specialized tiles (where the problem allows them) first after the
  # default, so the tuner always times some.
  ws = [MosaicConfig(bm, bn, stages, mosaic_ws.COMPUTE_WGS) for bn in widths
        for bm, stages in ((64, 4), (128, 3), (64, 2))]
  cands = [default] + [c for c in ws if valid(c)][:3]
  cands += [MosaicConfig(bm, bn, stages) for bn in widths for bm in (128, 64)
            for stages in (4, 3, 2)]
  return tuning.filter_candidates(cands, valid)


def shape_key(dims, scales: str, precise: bool, ep: epilogue_lib.Epilogue, out_dtype,
              pre_dtype) -> str:
  """The tuning cache's key of one problem: its sizes and everything that changes the
  kernel's code or shared memory."""
  Bt, M, N, K = dims
  return (f"b{Bt}_m{M}_n{N}_k{K}_{scales}{'_precise' if precise else ''}_{ep.tag}_"
          f"{jnp.dtype(out_dtype).name}_{jnp.dtype(pre_dtype).name}")


def _swizzled(minor: int, dtype):
  """Tiling and swizzle transforms for a shared-memory tile `minor` elements wide."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(a_g, b_g, sa_g, sb_g, *refs, n_true, cfg, ep, k_steps, scales, precise,
            interpret, out_dtype, pre_dtype):
  bm, bn = cfg.block_m, cfg.block_n
  refs = list(refs)
  bias_g = refs.pop(0) if ep.bias else None
  o_g = refs.pop(0)    # the output, or with output quantization its e4m3 codes
  scale_g = refs.pop(0) if ep.quantize_output else None
  pre_g = refs.pop(0) if ep.emit_pre else None
  block_scales = scales == BLOCK_SCALES
  promote = precise or block_scales
  operand = _swizzled(BLOCK_K, E4M3.dtype)
  # Fast accumulation keeps one wgmma in flight while the next is issued, its operand slots
  # released a step late (delay_release) so the pipeline does not refill them under it; a
  # promoted step reads its own result before the next starts.
  delay = 1 if k_steps > 1 and not promote else 0
  # Interpret mode knows no layouts (and no rule for casting one): values pass unchanged.
  as_layout = (lambda x, _: x) if interpret else plgpu.layout_cast
  rows_of, cols_of = mosaic_epilogue.layouts(interpret)
  by_rows = lambda v: rows_of(v, (bm, bn))
  by_cols = lambda v: cols_of(v, (bm, bn))

  def scoped(sa_smem, sb_smem, bias_smem, barriers):
    ni, mi, bi = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("b")
    m_slice, n_slice = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)
    # The epilogue's scale and bias tiles load while the K loop runs.
    if not block_scales:
      plgpu.copy_gmem_to_smem(sa_g.at[bi, m_slice], sa_smem, barriers.at[0])
      plgpu.copy_gmem_to_smem(sb_g.at[bi, n_slice], sb_smem, barriers.at[1])
    if ep.bias:
      plgpu.copy_gmem_to_smem(bias_g.at[n_slice], bias_smem, barriers.at[2])

    def issue(acc_ref, a_smem, b_smem):
      b_view = b_smem if interpret else b_smem.transpose((1, 0))
      plgpu.wgmma(acc_ref, a_smem, b_view)

    if interpret:
      b_spec = plgpu.BlockSpec((BLOCK_K, bn), lambda k: (k, 0),
                               transforms=_swizzled(bn, E4M3.dtype), delay_release=delay)
      b_tiles = b_g.at[bi, :, n_slice]
    else:
      b_spec = plgpu.BlockSpec((bn, BLOCK_K), lambda k: (0, k), transforms=operand,
                               delay_release=delay)
      b_tiles = b_g.at[bi, n_slice]
    specs = [plgpu.BlockSpec((bm, BLOCK_K), lambda k: (0, k), transforms=operand,
                             delay_release=delay), b_spec]
    tiles = [a_g.at[bi, m_slice], b_tiles]
    if block_scales:  # each K step's row of scales arrives with its operand tiles
      specs += [plgpu.BlockSpec((1, bm), lambda k: (k, 0)),
                plgpu.BlockSpec((1, bn), lambda k: (k, 0))]
      tiles += [sa_g.at[bi, :, m_slice], sb_g.at[bi, :, n_slice]]

    if promote:
      # Each K step's product leaves the tensor cores for an fp32 sum in registers (scaled
      # by its K block's scales first), so no more than 128 products accumulate at the
      # tensor cores' own precision.
      def k_step(_, a_smem, b_smem, *rest):
        *scale_smem, total = rest

        def one(acc_ref):
          issue(acc_ref, a_smem, b_smem)
          plgpu.wgmma_wait(0)
          return acc_ref[...]

        part = pl.run_scoped(one, plgpu.ACC((bm, bn), jnp.float32))
        if block_scales:
          sa_k, sb_k = scale_smem
          part = part * by_rows(sa_k[0]) * by_cols(sb_k[0])
        return total + part

      zeros = as_layout(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)
      acc = plgpu.emit_pipeline(k_step, grid=(k_steps,), in_specs=specs,
                                max_concurrent_steps=cfg.stages, init_carry=zeros)(*tiles)
    else:
      def k_step(_, a_smem, b_smem, acc_ref):
        issue(acc_ref, a_smem, b_smem)
        plgpu.wgmma_wait(delay)

      def product(acc_ref):
        plgpu.emit_pipeline(functools.partial(k_step, acc_ref=acc_ref), grid=(k_steps,),
                            in_specs=specs, max_concurrent_steps=cfg.stages)(*tiles)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

      acc = pl.run_scoped(product, plgpu.ACC((bm, bn), jnp.float32))

    def store(o_smem, *rest):
      scale_smem = rest[0] if ep.quantize_output else None
      pre_smem = rest[-1] if ep.emit_pre else None
      y = acc
      if not block_scales:
        plgpu.barrier_wait(barriers.at[0])
        plgpu.barrier_wait(barriers.at[1])
        y = y * by_rows(sa_smem[...]) * by_cols(sb_smem[...])
      if ep.bias:
        plgpu.barrier_wait(barriers.at[2])
        y = y + by_cols(bias_smem[...])
      mosaic_epilogue.write_tile(
          y, ep, n_true - ni * bn, rows_of, out_dtype, pre_dtype,
          (o_smem, scale_smem, pre_smem),
          mosaic_epilogue.out_slices(o_g, scale_g, pre_g, bi, m_slice, n_slice))

    # The K loop has released its operand stages: the output tiles reuse that memory.
    pl.run_scoped(store, *(s for s in out_scratch if s is not None))

  rowwise = not block_scales
  code_dtype = E4M3.dtype if ep.quantize_output else out_dtype
  out_scratch = [plgpu.SMEM((bm, bn), code_dtype, transforms=_swizzled(bn, code_dtype)),
                 plgpu.SMEM((bm,), jnp.float32) if ep.quantize_output else None,
                 plgpu.SMEM((bm, bn), pre_dtype, transforms=_swizzled(bn, pre_dtype))
                 if ep.emit_pre else None]
  scratch = [plgpu.SMEM((bm,), jnp.float32) if rowwise else None,
             plgpu.SMEM((bn,), jnp.float32) if rowwise else None,
             plgpu.SMEM((bn,), jnp.float32) if ep.bias else None,
             plgpu.Barrier(num_barriers=EPILOGUE_BARRIERS)]
  allocated = [s for s in scratch if s is not None]

  def with_scratch(*refs_in):
    it = iter(refs_in)
    scoped(*(None if s is None else next(it) for s in scratch))

  pl.run_scoped(with_scratch, *allocated)


def _pad_to(x, axis: int, multiple: int, value=0):
  extra = _round_up(x.shape[axis], multiple) - x.shape[axis]
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def gemm(a, b, sa, sb, *, scales: str = ROWWISE_SCALES, precise: bool = False,
         epilogue: epilogue_lib.Epilogue = epilogue_lib.Epilogue(), bias=None,
         out_dtype=jnp.bfloat16, pre_dtype=jnp.float32,
         config: Optional[MosaicConfig] = None, kernel_name: str = "pallas_mosaic_gemm"):
  """The batched scaled GEMM on K-last e4m3 operands: a (B, M, K), b (B, N, K).

  scales: 'rowwise', sa (B, M) and sb (B, N) applied to the accumulator once; or 'block',
  sa (B, KB, M) and sb (B, KB, N), one row per 128-wide K block, applied to each K step's
  product. precise: every K step's product is summed in fp32 registers (always so with
  block scales); otherwise the tensor cores accumulate the whole K. config: the tile; None
  takes the tuning cache's for this shape (`kernels_pallas.tuning`: tuned on an eager call
  on a GPU with LOKA_PALLAS_AUTOTUNE=1), else `default_config`. Returns out (B, M, N), or
  with epilogue.quantize_output its e4m3 codes (B, M, N) and one fp32 scale a row (B, M);
  plus pre (B, M, N) when epilogue.emit_pre (the scaled product + bias, before BlockNorm and
  the activation)."""
  if a.ndim != 3 or b.ndim != 3:
    raise ValueError(f"{kernel_name}: operands must be 3-D (batch, rows, K), got {a.shape} "
                     f"and {b.shape}")
  if a.dtype != E4M3.dtype or b.dtype != E4M3.dtype:
    raise ValueError(f"{kernel_name}: FP8 wgmma takes e4m3 operands, got {a.dtype} and "
                     f"{b.dtype}; quantize them first (quantize.quantize(x, E4M3, ...))")
  Bt, M, K = a.shape
  if b.shape[0] != Bt or b.shape[2] != K:
    raise ValueError(f"{kernel_name}: a {a.shape} and b {b.shape} must be (B, M, K) and "
                     "(B, N, K) with the same B and K")
  N = b.shape[1]
  if scales == ROWWISE_SCALES:
    want_a, want_b = (Bt, M), (Bt, N)
  elif scales == BLOCK_SCALES:
    want_a, want_b = (Bt, -(-K // BLOCK_K), M), (Bt, -(-K // BLOCK_K), N)
  else:
    raise ValueError(f"{kernel_name}: unknown scales mode {scales!r}; use "
                     f"{ROWWISE_SCALES!r} or {BLOCK_SCALES!r}")
  if sa.shape != want_a or sb.shape != want_b:
    raise ValueError(f"{kernel_name}: {scales} scales must have shapes {want_a} and "
                     f"{want_b}, got {sa.shape} and {sb.shape}")
  if epilogue.bias and (bias is None or bias.shape != (N,)):
    raise ValueError(f"{kernel_name}: the epilogue adds a bias: pass one of shape ({N},), got "
                     f"{None if bias is None else bias.shape}")
  dims = (Bt, M, N, K)
  block_scales = scales == BLOCK_SCALES
  cfg = config
  if cfg is None:
    def runner(candidate):
      # A jittable call on these operands: tuning times the kernel, not eager dispatch.
      def call(a, b, sa, sb, bias):
        return gemm(a, b, sa, sb, scales=scales, precise=precise, epilogue=epilogue,
                    bias=bias, out_dtype=out_dtype, pre_dtype=pre_dtype, config=candidate,
                    kernel_name=kernel_name)
      return call, (a, b, sa, sb, bias)
    concrete = compat.concrete(a, b, sa, sb, bias)
    cfg = tuning.choose(kernel_name, shape_key(dims, scales, precise, epilogue, out_dtype,
                                               pre_dtype),
                        default_config(dims, epilogue, out_dtype, pre_dtype, precise,
                                       block_scales),
                        candidate_configs(dims, epilogue, out_dtype, pre_dtype, precise,
                                          block_scales),
                        runner if concrete else None)
  problem = validate_config(cfg, dims, epilogue, out_dtype, pre_dtype, precise, block_scales)
  if problem:
    raise ValueError(f"{kernel_name} b{Bt}_m{M}_n{N}_k{K}: tile config {cfg} invalid: "
                     f"{problem}")
  interpret = compat.mosaic_interpret()
  # Zero codes in the padding: padded K adds nothing, padded rows and columns are sliced off.
  a_p = _pad_to(_pad_to(a, 1, cfg.block_m * cfg.compute_wgs), 2, BLOCK_K)
  b_p = _pad_to(_pad_to(b, 1, cfg.block_n), 2, BLOCK_K)
  sa_p = _pad_to(sa.astype(jnp.float32), sa.ndim - 1, cfg.block_m * cfg.compute_wgs, 1.0)
  sb_p = _pad_to(sb.astype(jnp.float32), sb.ndim - 1, cfg.block_n, 1.0)
  Mp, Np, Kp = a_p.shape[1], b_p.shape[1], a_p.shape[2]
  args = [a_p, jnp.swapaxes(b_p, 1, 2) if interpret else b_p, sa_p, sb_p]
  if epilogue.bias:
    args.append(_pad_to(bias.astype(jnp.float32), 0, cfg.block_n))
  if cfg.compute_wgs > 1:
    outs = mosaic_ws.gemm(*args[:4], args[4] if epilogue.bias else None, ep=epilogue,
                          n_true=N, block_m=cfg.block_m, block_n=cfg.block_n,
                          stages=cfg.stages, block_k=BLOCK_K, swizzled=_swizzled,
                          out_dtype=jnp.dtype(out_dtype), pre_dtype=jnp.dtype(pre_dtype),
                          interpret=interpret)
    return _unpadded(outs, M, N)
  body = functools.partial(_kernel, n_true=N, cfg=cfg, ep=epilogue, k_steps=Kp // BLOCK_K,
                           scales=scales, precise=precise, interpret=interpret is not None,
                           out_dtype=jnp.dtype(out_dtype), pre_dtype=jnp.dtype(pre_dtype))
  out_type = mosaic_epilogue.out_types(Bt, Mp, Np, epilogue, out_dtype, pre_dtype)
  call = plgpu.kernel(body, out_type=out_type, grid=(Np // cfg.block_n, Mp // cfg.block_m, Bt),
                      grid_names=("n", "m", "b"), interpret=interpret)
  return _unpadded(call(*args), M, N)


def _unpadded(outs, M: int, N: int):
  """The kernel's outputs less their padding: one array, or a tuple of them."""
  outs = tuple(o[:, :M, :N] if o.ndim == 3 else o[:, :M] for o in outs)
  return outs[0] if len(outs) == 1 else outs


def reference(a_deq, b_deq, *, epilogue=epilogue_lib.Epilogue(), bias=None,
              out_dtype=jnp.float32):
  """Kernel-correctness reference: fp32 HIGHEST product of dequantized K-last operands."""
  z = jnp.einsum("bmk,bnk->bmn", a_deq.astype(jnp.float32), b_deq.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST)
  return epilogue_lib.reference(z, epilogue, bias).astype(out_dtype)


# The operands' quantize: the library's pure-jnp one (kernels_pallas.quantize follows the same
# convention in one Triton pass), which XLA fuses with the transpose a K-first operand needs,
# and which keeps this core independent of Pallas' Triton backend.
QUANTIZE = scaling.quantize


def _k_last(ops: products.CoreOperands):
  """The core operands with K last: wgmma's 8-bit operands are K-major, so an operand
  stored K first has its e4m3 codes transposed."""
  da = jnp.swapaxes(ops.a, 1, 2) if ops.layout.a_t else ops.a
  db = ops.b if ops.layout.b_t else jnp.swapaxes(ops.b, 1, 2)
  return da, db


def rowwise_einsum(spec: EinsumSpec, a, b, *, out_dtype, kernel_name: str,
                   precise: bool = False, config: Optional[MosaicConfig] = None) -> jax.Array:
  """Both operands quantized e4m3 with one scale per non-contracting index, then the core
  (`precise`: each K step's product summed in fp32 registers)."""
  ops = products.rowwise_operands(spec, a, b, kernel_name=kernel_name, quantize=QUANTIZE)
  da, db = _k_last(ops)
  out = gemm(da, db, ops.sa, ops.sb, precise=precise, out_dtype=out_dtype, config=config,
             kernel_name=kernel_name)
  return ops.finish(out, spec, out_dtype)


def blockwise_einsum(spec: EinsumSpec, a, b, *, pass_name: str, out_dtype, kernel_name: str,
                     config: Optional[MosaicConfig] = None) -> jax.Array:
  """1x128 blocks along the contraction for activations and gradients, 128x128 for the
  weight (`products.block_operands`), each K step's product scaled by its block's scales
  and summed in fp32 registers."""
  ops = products.block_operands(spec, a, b, pass_name=pass_name, kernel_name=kernel_name,
                                quantize=QUANTIZE)
  da, db = _k_last(ops)
  out = gemm(da, db, ops.sa, ops.sb, scales=BLOCK_SCALES, out_dtype=out_dtype, config=config,
             kernel_name=kernel_name)
  return ops.finish(out, spec, out_dtype)


def lowered_for_cuda(fn, *args) -> str:
  """The StableHLO text of `fn(*args)` lowered for 'cuda' with compiled (not interpreted)
  Mosaic GPU kernels; no GPU needed. Lowering builds each kernel's Mosaic GPU module, so a
  wgmma shape, layout or shared-memory error surfaces here. Pass a function this process
  has not traced yet: jax reuses a trace made in interpret mode."""
  # An abstract GPU: jax 0.11 and later ask it for the device (a vmapped kernel's lowering
  # does) and find none on a CPU-only process.
  with compat.compiled_kernels(), _compat.abstract_gpu():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
