"""Data sources (synthetic, MovieLens-100K, Criteo TSV) behind one batch contract."""
from loka_jax.data.spec import BatchError, FeatureSpec, validate_batch
from loka_jax.data.sources import DataFileError, DataSource
from loka_jax.data.synthetic import SyntheticSource, SyntheticSpec
from loka_jax.data.movielens import MovieLensConfig, MovieLensSource
from loka_jax.data.criteo import CriteoConfig, CriteoSource
from loka_jax.data.make import SOURCES, make_source
