"""Benchmarks on the GPU by the protocol of loka_jax.timing: models, towers, kernels."""
