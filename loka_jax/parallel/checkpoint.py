"""Checkpoints of sharded training state that restore onto another mesh shape.

Saving writes the same layout as the training loop's `Checkpointer` (`loka.checkpoint/1`:
orbax parts plus `layout.json`), orbax writing each array's shards. Restoring reads every
array straight into the layout of the target mesh (`NamedSharding`s of a template), so a run
saved on data:2,model:2 resumes on data:2,model:1 or on one device; only the target mesh's
`model` size must divide every table's rows.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from loka_jax.parallel import step as step_lib
from loka_jax.train.checkpoint import (CheckpointError, Checkpointer, checkpoint_steps,
                                       read_step)
from loka_jax.train.state import TrainState, all_finite, split_variables


def save_sharded(directory: str, state: TrainState, extras: Optional[Mapping[str, Any]] = None,
                 keep: int = 3) -> int:
  """Writes `state` (sharded or not) at its step; returns the step."""
  with Checkpointer(directory, keep=keep) as checkpointer:
    return checkpointer.save(state, extras)


def sharded_template(model, tx: optax.GradientTransformation, example_batch,
                     mesh: Mesh) -> TrainState:
  """Shapes, dtypes and target shardings of the state on `mesh`; no array is allocated."""
  def make():
    keys = jax.random.split(jax.random.PRNGKey(0))
    variables = model.init({"params": keys[0], "dropout": keys[1]}, example_batch, train=False)
    params, fp8_meta = split_variables(variables)
    fp8_meta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), fp8_meta)
    return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                      fp8_meta=fp8_meta, rng=keys[0])

  abstract = jax.eval_shape(make)
  step_lib.check_tables(abstract.params, mesh)
  shardings = step_lib.state_shardings(abstract, mesh)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def restore_sharded(directory: str, template: TrainState, step: Optional[int] = None
                    ) -> Tuple[TrainState, Dict[str, Any]]:
  """(state laid out like `template`, extras) from checkpoint `step` (default: the newest).

  `template` comes from `sharded_template` (or is a state on the target mesh). Missing
  checkpoints, a structure that does not match the model, and non-finite values are
  CheckpointErrors naming the directory.
  """
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoint directory {directory}")
  steps = checkpoint_steps(directory)
  if not steps:
    raise CheckpointError(f"no checkpoint in {directory}")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise CheckpointError(f"no checkpoint of step {step} in {directory}; steps: {steps}")
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      template.to_state_dict())
  try:
    restored, extras = read_step(os.path.join(directory, str(step)), abstract)
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"checkpoint {directory}/{step} does not fit this model's state "
                          f"(another model or preset?): {str(e)[:400]}") from e
  state = template.from_state_dict(restored)
  if not all_finite((state.params, state.opt_state, state.fp8_meta)):
    raise CheckpointError(f"checkpoint {directory}/{step} holds non-finite values")
  return state, extras
