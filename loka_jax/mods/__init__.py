"""LoKA Mods: No Bias, BlockNorm, Hard Swish.

Submodules: `functional` (BlockNorm / Hard Swish references), `layers` (BlockNorm, Norm),
`fused` (FusedDenseNormAct: site + bias + BlockNorm + activation as one fused site; it builds
on loka_jax.models, so import it as `loka_jax.mods.fused`), `ablation` (the Mods ablation).
"""
from loka_jax.mods.functional import activation, block_norm, hard_swish
from loka_jax.mods.layers import NORMS, BlockNorm, Norm
