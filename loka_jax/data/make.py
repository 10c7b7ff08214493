"""Builds a data source by name: the one place that knows every source."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Union

from loka_jax.data import criteo, movielens, synthetic
from loka_jax.data.sources import DataSource
from loka_jax.data.spec import ID_POLICIES, FeatureSpec

SOURCES = ("synthetic", "movielens", "criteo")


def make_source(name: str, *, features: Optional[FeatureSpec] = None,
                spec: Union[None, str, Mapping[str, Any]] = None,
                data_path: Optional[str] = None, data_cache: Optional[str] = None,
                seed: int = 0, num_eval: Optional[int] = None,
                id_policy: str = "error") -> DataSource:
  """Builds the named data source.

  synthetic: `features` (the model preset's FeatureSpec) shapes the batches, `spec` (SyntheticSpec
  keys) sets the distributions. movielens / criteo fix their own FeatureSpec from their columns
  (`features` is ignored; build the model from `source.features`), and `spec` holds their
  MovieLensConfig / CriteoConfig keys. `seed` orders the training stream; `num_eval` sizes the
  held-out set; `id_policy` ('error' | 'hash' | 'clip') treats out-of-vocabulary ids.
  """
  if id_policy not in ID_POLICIES:
    raise ValueError(f"unknown id_policy {id_policy!r}; use one of {ID_POLICIES}")
  if name == "synthetic":
    return synthetic.SyntheticSource(features=features, spec=spec, seed=seed, num_eval=num_eval,
                                     id_policy=id_policy)
  if name in ("movielens", "criteo") and features is not None:
    logging.info("data source %s defines its own FeatureSpec; the given features are ignored", name)
  if name == "movielens":
    return movielens.MovieLensSource(config=spec, data_path=data_path, data_cache=data_cache,
                                     seed=seed, num_eval=num_eval, id_policy=id_policy)
  if name == "criteo":
    if data_path is None:
      raise ValueError("the criteo source needs data_path: a .tsv/.tsv.gz file or a directory "
                       "of them")
    return criteo.CriteoSource(data_path, config=spec, seed=seed, num_eval=num_eval,
                               id_policy=id_policy)
  raise ValueError(f"unknown data source {name!r}; choose one of {SOURCES}")
