"""One model preset's train step (fwd + bwd + optimizer) and inference as argument-less calls."""
from __future__ import annotations

from typing import Optional

import jax

from experiments.bench import speed
from experiments.bench.variants import Variant
from loka_jax.data import FeatureSpec, make_source
from loka_jax.models.presets import (apply_mods, build_model, check_keep_bias, get_config,
                                    tower_flops)
from loka_jax.models.site import SiteConfig
from loka_jax.train import loop
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import create_train_state


def prepare(model_name: str, preset: str, variant: Variant, batch_size: Optional[int] = None,
            seed: int = 0):
  """(train_call, infer_call, info): argument-less calls running one step on fixed data."""
  config = get_config(model_name, preset)
  if variant.mods:
    config = apply_mods(config, variant.mods)
  batch_size = batch_size or int(config.batch_size)
  features = FeatureSpec.from_dict(dict(config.features))
  source = make_source("synthetic", features=features, seed=seed, num_eval=batch_size)
  model = build_model(config, source.features,
                      SiteConfig.for_precision(variant.precision, kernel=variant.kernel))
  check_keep_bias(model, config, lambda: source.train_batch(0, 2))
  batch = jax.device_put(source.train_batch(0, batch_size))  # real data, never zeros
  optim = OptimConfig()
  train_step, eval_step = loop.compiled_steps(model, optim, "stop")
  state = create_train_state(model, make_optimizer(optim), batch, seed)
  # Call the compiled executables directly: one compile each, also read for memory use.
  compiled_train = train_step.lower(state, batch).compile()
  compiled_eval = eval_step.lower(state, batch).compile()
  info = {"batch_size": batch_size, "flops_per_example": int(tower_flops(config, features)),
          "train_memory_bytes": speed.memory_bytes(compiled_train),
          "infer_memory_bytes": speed.memory_bytes(compiled_eval)}
  holder = {"state": state}

  def train_call():
    holder["state"], metrics = compiled_train(holder["state"], batch)
    return metrics["loss"]

  def infer_call():
    return compiled_eval(holder["state"], batch)

  return train_call, infer_call, info
