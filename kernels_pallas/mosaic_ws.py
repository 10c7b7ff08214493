"""The Mosaic GPU FP8 core, warp-specialized: one warpgroup feeds, two compute.

`mosaic_gemm`'s program is one warpgroup that both issues the TMA copies of the K loop and
runs its wgmma. Here a program has three: a memory warpgroup that only keeps the operand
stages filled (`plgpu.emit_pipeline_warp_specialized`, with few registers), and two compute
warpgroups, each owning `block_m` rows of a (2 * block_m, block_n) output tile. Both compute
warpgroups read the same B tile of every K step, so a program moves a B tile per 2 * block_m
rows, and while one warpgroup waits on its wgmma the other's runs (the layout of jax's own
Hopper matmul, `jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, on FP8 operands).

It computes what `mosaic_gemm.gemm` computes on rowwise scales with the tensor cores
accumulating the whole K, epilogue included (`mosaic_epilogue`: bias, BlockNorm, activation,
the pre-norm value, output quantization), each warpgroup on its own rows. `mosaic_gemm.gemm`
runs it for a `MosaicConfig` with `compute_wgs=2`, a tile the tuner may pick on a GPU;
operands arrive padded to whole tiles, with B as (B, N, K), or (B, K, N) in interpret mode,
which reads no transposed shared-memory view. Nothing of its shared memory is released
before the epilogue, so its output tiles sit beside the operand stages.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import mosaic_epilogue

COMPUTE_WGS = 2       # compute warpgroups a program
MEMORY_REGISTERS = 40  # registers a thread of the memory warpgroup keeps (jax's Hopper matmul)


def unsupported(block_scales: bool, precise: bool) -> str | None:
  """Why the warp-specialized core cannot run this problem (None when it can)."""
  if block_scales or precise:
    return "the warp-specialized core takes rowwise scales accumulated on the tensor cores"
  return None


def gemm(a, b, sa, sb, bias, *, ep, n_true: int, block_m: int, block_n: int, stages: int,
         block_k: int, swizzled, out_dtype, pre_dtype, interpret):
  """The padded outputs of padded operands: a (Bt, Mp, Kp) e4m3, b (Bt, Np, Kp) e4m3 (or
  (Bt, Kp, Np) in interpret mode), sa (Bt, Mp), sb (Bt, Np) fp32, bias (Np,) fp32 or None.
  Mp is a multiple of 2 * block_m, Np of block_n and Kp of block_k. Returns out (Bt, Mp,
  Np), or with output quantization its e4m3 codes and (Bt, Mp) scales; plus pre (Bt, Mp,
  Np) with `ep.emit_pre`, as `mosaic_gemm.gemm`. `swizzled(minor, dtype)` gives a tile's
  shared-memory transforms."""
  bt, mp, kp = a.shape
  np_ = sb.shape[1]
  rows = COMPUTE_WGS * block_m
  k_steps = kp // block_k
  operand = swizzled(block_k, jnp.float8_e4m3fn)
  interpreted = interpret is not None   # `interpret`: the GPU interpret mode's parameters
  rows_of, cols_of = mosaic_epilogue.layouts(interpreted)
  tile = (block_m, block_n)
  code_dtype = jnp.float8_e4m3fn if ep.quantize_output else out_dtype

  def body(a_g, b_g, sa_g, sb_g, *refs):
    refs = list(refs)
    bias_g = refs.pop(0) if ep.bias else None
    o_g = refs.pop(0)
    scale_g = refs.pop(0) if ep.quantize_output else None
    pre_g = refs.pop(0) if ep.emit_pre else None
    allocated = iter(refs)
    out_smem, scale_smem, pre_smem, sa_smem, sb_smem, bias_smem, barriers = (
        None if s is None else next(allocated) for s in scratch)
    ni, mi, bi = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("b")
    n_slice = pl.ds(ni * block_n, block_n)

    def compute(eval_pipeline):
      wg = lax.axis_index("wg")
      m_slice = pl.ds(mi * rows + wg * block_m, block_m)
      # This warpgroup's row scales, column scales and bias load while its K loop runs.
      loads = [(sa_g.at[bi, m_slice], sa_smem), (sb_g.at[bi, n_slice], sb_smem)]
      if ep.bias:
        loads.append((bias_g.at[n_slice], bias_smem))
      for i, (src, dst) in enumerate(loads):
        plgpu.copy_gmem_to_smem(src, dst.at[wg], barriers.at[i * COMPUTE_WGS + wg])

      def with_acc(acc_ref):
        eval_pipeline(acc_ref)
        acc = acc_ref[...]
        for i in range(len(loads)):
          plgpu.barrier_wait(barriers.at[i * COMPUTE_WGS + wg])
        y = acc * rows_of(sa_smem[wg], tile) * cols_of(sb_smem[wg], tile)
        if ep.bias:
          y = y + cols_of(bias_smem[wg], tile)
        own = lambda ref: None if ref is None else ref.at[wg]   # this warpgroup's tile
        mosaic_epilogue.write_tile(
            y, ep, n_true - ni * block_n, rows_of, out_dtype, pre_dtype,
            (own(out_smem), own(scale_smem), own(pre_smem)),
            mosaic_epilogue.out_slices(o_g, scale_g, pre_g, bi, m_slice, n_slice))

      pl.run_scoped(with_acc, plgpu.ACC(tile, jnp.float32))

    def k_step(_, a_smem, b_smem, acc_ref):
      wg_rows = a_smem.at[pl.ds(lax.axis_index("wg") * block_m, block_m)]
      plgpu.wgmma(acc_ref, wg_rows, b_smem if interpreted else b_smem.transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return acc_ref

    if interpreted:
      b_spec = plgpu.BlockSpec((block_k, block_n), lambda k: (k, 0),
                               transforms=swizzled(block_n, jnp.float8_e4m3fn))
      b_tiles = b_g.at[bi, :, n_slice]
    else:
      b_spec = plgpu.BlockSpec((block_n, block_k), lambda k: (0, k), transforms=operand)
      b_tiles = b_g.at[bi, n_slice]
    pipeline = plgpu.emit_pipeline_warp_specialized(
        k_step, grid=(k_steps,), memory_registers=MEMORY_REGISTERS,
        in_specs=[plgpu.BlockSpec((rows, block_k), lambda k: (0, k), transforms=operand),
                  b_spec],
        wg_axis="wg", num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=stages,
        compute_context=compute)
    pipeline(a_g.at[bi, pl.ds(mi * rows, rows)], b_tiles)

  vectors = 3 if ep.bias else 2   # row scales, column scales (and bias) of each warpgroup
  scratch = [
      plgpu.SMEM((COMPUTE_WGS,) + tile, code_dtype, transforms=swizzled(block_n, code_dtype)),
      plgpu.SMEM((COMPUTE_WGS, block_m), jnp.float32) if ep.quantize_output else None,
      plgpu.SMEM((COMPUTE_WGS,) + tile, pre_dtype, transforms=swizzled(block_n, pre_dtype))
      if ep.emit_pre else None,
      plgpu.SMEM((COMPUTE_WGS, block_m), jnp.float32),
      plgpu.SMEM((COMPUTE_WGS, block_n), jnp.float32),
      plgpu.SMEM((COMPUTE_WGS, block_n), jnp.float32) if ep.bias else None,
      plgpu.Barrier(num_barriers=vectors * COMPUTE_WGS)]
  call = plgpu.kernel(
      body, out_type=mosaic_epilogue.out_types(bt, mp, np_, ep, out_dtype, pre_dtype),
      grid=(np_ // block_n, mp // rows, bt), grid_names=("n", "m", "b"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      scratch_types=[s for s in scratch if s is not None], interpret=interpret)
  args = (a, b, sa, sb) + ((bias,) if ep.bias else ())
  return call(*args)
