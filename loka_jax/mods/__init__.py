"""LoKA Mods: No Bias, BlockNorm, Hard Swish.

Submodules: `functional` (BlockNorm / Hard Swish references), `layers` (BlockNorm, Norm).
The fused layer that runs a site, its bias, BlockNorm and the activation as one site
(FusedDenseNormAct) is a site like the others: `loka_jax.models.fused`. The Mods ablation, a
set of training runs, is `loka_jax.train.ablation`.
"""
from loka_jax.mods.functional import activation, block_norm, hard_swish
from loka_jax.mods.layers import NORMS, BlockNorm, Norm
