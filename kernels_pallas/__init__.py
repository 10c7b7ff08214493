"""Pallas FP8 kernels (Triton and Mosaic GPU backends), each beside its pure-jnp reference.

Importing the package registers its kernels (loka_jax.kernels.registry loads it as a plugin):
pallas_fp8_rowwise, pallas_fp8_blockwise, pallas_fp8_batched, the delayed-scaling fused ops
pallas_fp8_delayed{,_grad_lhs,_fwd}, the fused epilogue kernels pallas_fp8_rowwise_fused_*, and
on the Mosaic GPU backend pallas_mosaic_fp8_{rowwise,batched} and
pallas_mosaic_fp8_rowwise_fused_*.
Modules: quantize (fused amax + scale + cast), delayed (delayed scaling's cast, amax and
transposed copy in one pass) and delayed_op (the fused ops built on it), gemm (the scaled
GEMM core and its epilogue), mosaic_gemm (the same on Hopper's FP8 wgmma) and mosaic_ws (its
warp-specialized tile), products (einsum
specs -> core), fused (fused_dense and its reference), tuning (per-shape tile autotuning
cache). On the CPU kernels run in interpret mode
(jax's GPU interpret mode for the Mosaic GPU ones).
"""
from kernels_pallas import (compat, delayed, delayed_op, epilogue, fused, gemm, mosaic_gemm,
                            mosaic_ws, products, quantize, tuning)
from kernels_pallas import registration as _registration
from kernels_pallas.fused import fused_dense, fused_dense_reference

_registration.register_all()
if compat.fp8_imprecise_acc():  # $LOKA_PALLAS_FP8_IMPRECISE_ACC set for this process
  compat.install_fp8_dot_hook()
