"""Data sources (synthetic, MovieLens-100K, Criteo TSV) behind one batch contract."""
from loka_jax.data.spec import BatchError, FeatureSpec, validate_batch
