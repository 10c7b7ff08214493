"""Tiny towers, meshes and single-device references shared by the tests/parallel modules
(`from sharded_fixtures import ...`); every fixture is built once per test session."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax import parallel
from loka_jax.data.make import make_source
from loka_jax.data.spec import FeatureSpec
from loka_jax.models import SiteConfig, build_model, get_config
from loka_jax.train import create_train_state, make_optimizer
from loka_jax.train.optim import OptimConfig

BATCH = 64          # 16 examples per device on 4 devices
OPTIM = OptimConfig()
# Vocabularies that divide by neither 2, 3 nor 4 (except 24: a table that needs no padding
# sits beside the padded ones); tables are capped at MAX_VOCAB rows, so three tables hash
# their ids modulo 995 rows.
ODD_VOCABS = (997, 583, 1000, 13, 305, 7, 999, 24)
MAX_VOCAB = 995


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


@functools.lru_cache(maxsize=None)
def mesh(spec: str):
  """A mesh over the first devices it needs (specs of fewer than 4 devices leave the rest)."""
  sizes = dict(parallel.parse_mesh_spec(spec))
  count = sizes["data"] * sizes["model"]
  return parallel.build_mesh(spec, devices=jax.devices()[:count])


@functools.lru_cache(maxsize=None)
def odd_dlrm():
  """(model, source) of a tiny fp32 DLRM whose tables have the ODD_VOCABS rows."""
  config = get_config("dlrm", "tiny")
  config.features.vocab_sizes = ODD_VOCABS
  config.max_vocab = MAX_VOCAB
  features = FeatureSpec.from_dict(dict(config.features))
  source = make_source("synthetic", features=features, seed=3, num_eval=128)
  return build_model(config, source.features, SiteConfig.for_precision("fp32")), source


@functools.lru_cache(maxsize=None)
def odd_state():
  """(batch, single-device initial state) of `odd_dlrm`."""
  model, source = odd_dlrm()
  batch = source.train_batch(0, BATCH)
  return batch, create_train_state(model, make_optimizer(OPTIM), batch, seed=1)


def copy(tree):
  """A copy that owns its buffers (steps donate their state)."""
  return jax.tree.map(jnp.copy, tree)
