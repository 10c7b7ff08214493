"""The DataSource protocol, `make_source`, and the JSON config loading every source shares."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import (Any, Dict, Iterator, Mapping, Optional, Protocol, Type, TypeVar, Union,
                    runtime_checkable)

import numpy as np

from loka_jax.data.spec import FeatureSpec


C = TypeVar("C")


class DataFileError(ValueError):
  """A malformed input file: the message names the file, the line and, where one is at fault,
  the column."""


@runtime_checkable
class DataSource(Protocol):
  """A training stream plus a fixed held-out set, both following the batch contract (spec.py)."""

  name: str
  features: FeatureSpec
  oracle_ne: Optional[float]

  def train_batch(self, step: int, batch_size: int) -> Dict[str, np.ndarray]:
    """Batch `step` of the training stream: a pure function of (source seed, step, batch_size)."""
    ...

  def eval_batches(self, batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
    """The held-out set in fixed order, full batches only (the last partial batch is dropped)."""
    ...

  def num_eval_examples(self) -> int:
    """Examples in the held-out set (eval_batches yields batch_size * (this // batch_size))."""
    ...


def _field_types(cls) -> Dict[str, Any]:
  return {f.name: f for f in dataclasses.fields(cls)}


def _tupled(value):
  """JSON lists become tuples (hashable, immutable); nested lists too."""
  if isinstance(value, (list, tuple)):
    return tuple(_tupled(v) for v in value)
  return value


def config_from_dict(cls: Type[C], values: Optional[Mapping[str, Any]], what: str) -> C:
  """Builds the dataclass `cls` from a mapping; unknown keys are an error naming them."""
  values = dict(values or {})
  known = _field_types(cls)
  unknown = sorted(set(values) - set(known))
  if unknown:
    raise ValueError(f"unknown {what} key(s) {unknown}; valid keys: {sorted(known)}")
  kwargs = {}
  for key, value in values.items():
    if isinstance(value, Mapping):
      kwargs[key] = dict(value)
    else:
      kwargs[key] = _tupled(value)
  return cls(**kwargs)


def config_to_dict(config) -> Dict[str, Any]:
  """A JSON-ready dict of a config dataclass (tuples become lists)."""
  def plain(value):
    if isinstance(value, (tuple, list)):
      return [plain(v) for v in value]
    if isinstance(value, Mapping):
      return {k: plain(v) for k, v in value.items()}
    return value
  return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def load_config(cls: Type[C], spec: Union[None, str, os.PathLike, Mapping[str, Any], C],
                what: str) -> C:
  """`spec` as an instance, a dict, a JSON string, or the path of a JSON file -> `cls`."""
  if spec is None:
    return cls()
  if isinstance(spec, cls):
    return spec
  if isinstance(spec, Mapping):
    return config_from_dict(cls, spec, what)
  if isinstance(spec, (str, os.PathLike)):
    text = str(spec)
    if text.lstrip().startswith("{"):
      source, raw = "the JSON string", text
    else:
      if not os.path.isfile(text):
        raise FileNotFoundError(f"{what} file {text!r} does not exist")
      with open(text) as f:
        source, raw = text, f.read()
    try:
      values = json.loads(raw)
    except json.JSONDecodeError as e:
      raise DataFileError(f"{what} in {source} is not valid JSON: {e}") from e
    if not isinstance(values, dict):
      raise DataFileError(f"{what} in {source} must be a JSON object, got "
                          f"{type(values).__name__}")
    try:
      return config_from_dict(cls, values, what)
    except (TypeError, ValueError) as e:   # an unknown key, or a value its checks refuse
      raise DataFileError(f"{source}: {e}") from e
  raise TypeError(f"{what} must be None, a dict, a JSON file path or {cls.__name__}, "
                  f"got {type(spec).__name__}")


def epoch_order(seed: int, stream: int, epoch: int, size: int) -> np.ndarray:
  """The shuffled example order of one epoch: a pure function of its arguments."""
  return np.random.default_rng([seed, stream, epoch]).permutation(size)
