"""loka_jax: FP8 for recommendation models in JAX/Flax (Probe, Mods, Dispatch)."""
__version__ = "0.1.0"
