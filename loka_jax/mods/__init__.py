"""LoKA Mods: No Bias, BlockNorm, Hard Swish."""
from loka_jax.mods.functional import activation, block_norm, hard_swish
from loka_jax.mods.layers import NORMS, BlockNorm, Norm
