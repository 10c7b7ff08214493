"""The Mosaic GPU FP8 core, warp-specialized: one warpgroup feeds, two compute.

`mosaic_gemm`'s program is one warpgroup that both issues the TMA copies of the K loop and
runs its wgmma. Here a program has three: a memory warpgroup that only keeps the operand
stages filled (`plgpu.emit_pipeline_warp_specialized`, with few registers), and two compute
warpgroups, each owning `block_m` rows of a (2 * block_m, block_n) output tile. Both compute
warpgroups read the same B tile of every K step, so a program moves a B tile per 2 * block_m
rows, and while one warpgroup waits on its wgmma the other's runs (the layout of jax's own
Hopper matmul, `jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, on FP8 operands).

It computes what `mosaic_gemm.gemm` computes for a plain epilogue on rowwise scales with the
tensor cores accumulating the whole K: out[b, m, n] = sum_k A[b, m, k] B[b, n, k] * sa[b, m]
* sb[b, n]. `mosaic_gemm.gemm` runs it for a `MosaicConfig` with `compute_wgs=2`, a tile the
tuner may pick on a GPU; operands arrive padded to whole tiles, with B as (B, N, K), or
(B, K, N) in interpret mode, which reads no transposed shared-memory view.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WGS = 2       # compute warpgroups a program
MEMORY_REGISTERS = 40  # registers a thread of the memory warpgroup keeps (jax's Hopper matmul)


def unsupported(epilogue, scales: str, precise: bool) -> str | None:
  """Why the warp-specialized core cannot run this problem (None when it can)."""
  if not epilogue.is_plain:
    return f"the warp-specialized core fuses no epilogue (got {epilogue.tag})"
  if scales != "rowwise" or precise:
    return "the warp-specialized core takes rowwise scales accumulated on the tensor cores"
  return None


def gemm(a, b, sa, sb, *, block_m: int, block_n: int, stages: int, block_k: int,
         swizzled, out_dtype, interpret):
  """out (Bt, Mp, Np) of padded operands: a (Bt, Mp, Kp) e4m3, b (Bt, Np, Kp) e4m3 (or
  (Bt, Kp, Np) in interpret mode), sa (Bt, Mp), sb (Bt, Np) fp32. Mp is a multiple of
  2 * block_m, Np of block_n and Kp of block_k. `swizzled(minor, dtype)` gives a tile's
  shared-memory transforms."""
  bt, mp, kp = a.shape
  np_ = sb.shape[1]
  rows = COMPUTE_WGS * block_m
  k_steps = kp // block_k
  operand = swizzled(block_k, jnp.float8_e4m3fn)
  as_layout = (lambda x, _: x) if interpret else plgpu.layout_cast

  def body(a_g, b_g, sa_g, sb_g, o_g, out_smem, sa_smem, sb_smem, scale_barriers):
    ni, mi, bi = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("b")
    n_slice = pl.ds(ni * block_n, block_n)

    def compute(eval_pipeline):
      wg = lax.axis_index("wg")
      m_slice = pl.ds(mi * rows + wg * block_m, block_m)
      # This warpgroup's row and column scales load while its K loop runs.
      plgpu.copy_gmem_to_smem(sa_g.at[bi, m_slice], sa_smem.at[wg], scale_barriers.at[wg])
      plgpu.copy_gmem_to_smem(sb_g.at[bi, n_slice], sb_smem.at[wg],
                              scale_barriers.at[COMPUTE_WGS + wg])

      def with_acc(acc_ref):
        eval_pipeline(acc_ref)
        acc = acc_ref[...]
        plgpu.barrier_wait(scale_barriers.at[wg])
        plgpu.barrier_wait(scale_barriers.at[COMPUTE_WGS + wg])
        by_rows = lax.broadcast_in_dim(
            as_layout(sa_smem[wg], plgpu.Layout.WGMMA.reduce(1)), (block_m, block_n), (0,))
        by_cols = lax.broadcast_in_dim(
            as_layout(sb_smem[wg], plgpu.Layout.WGMMA.reduce(0)), (block_m, block_n), (1,))
        out_smem[wg] = (acc * by_rows * by_cols).astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg], o_g.at[bi, m_slice, n_slice])
        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(with_acc, plgpu.ACC((block_m, block_n), jnp.float32))

    def k_step(_, a_smem, b_smem, acc_ref):
      wg_rows = a_smem.at[pl.ds(lax.axis_index("wg") * block_m, block_m)]
      plgpu.wgmma(acc_ref, wg_rows, b_smem if interpret else b_smem.transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return acc_ref

    if interpret:
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

  call = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((bt, mp, np_), out_dtype),
      grid=(np_ // block_n, mp // rows, bt), grid_names=("n", "m", "b"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      scratch_types=[
          plgpu.SMEM((COMPUTE_WGS, block_m, block_n), out_dtype,
                     transforms=swizzled(block_n, out_dtype)),
          plgpu.SMEM((COMPUTE_WGS, block_m), jnp.float32),
          plgpu.SMEM((COMPUTE_WGS, block_n), jnp.float32),
          plgpu.Barrier(num_barriers=2 * COMPUTE_WGS)],
      interpret=interpret)
  return call(a, b, sa, sb)
