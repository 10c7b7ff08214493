"""Checkpoints of sharded training state that restore onto another mesh shape.

Saving writes the same layout as the training loop's `Checkpointer` (`loka.checkpoint/1`:
orbax parts plus `layout.json`), orbax writing each array's shards, with every table and its
optimizer state cut back to the table's own rows (no padding: step.TableLayout). Restoring
reads every array into the target mesh and pads its tables for that mesh's `model` size, so
a checkpoint written on any mesh resumes on any other, on one device, or in the training
loop itself (`train.Checkpointer`): the files do not depend on the mesh.

A table whose rows do not divide by M has no even shards without its padding: while it is
saved or restored, it is replicated over the mesh (one whole table per device, for the
moment of the save or restore).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from loka_jax.parallel import step as step_lib
from loka_jax.parallel.mesh import MODEL
from loka_jax.train.checkpoint import (CheckpointError, Checkpointer, checkpoint_steps,
                                       read_step)
from loka_jax.train.state import TrainState, all_finite, split_variables


def save_sharded(directory: str, state: TrainState, tables: step_lib.TableLayout,
                 extras: Optional[Mapping[str, Any]] = None, keep: int = 3) -> int:
  """Writes `state` (laid out by `tables`, sharded or not) without its padding rows at its
  step; returns the step."""
  unpadded = step_lib.unshard_state(state, tables) if tables.padding() else state
  with Checkpointer(directory, keep=keep) as checkpointer:
    return checkpointer.save(unpadded, extras)


def sharded_template(model, tx: optax.GradientTransformation, example_batch,
                     mesh: Mesh) -> TrainState:
  """Shapes, dtypes and target shardings of the state on `mesh` (tables padded for it); no
  array is allocated."""
  def make():
    keys = jax.random.split(jax.random.PRNGKey(0))
    variables = model.init({"params": keys[0], "dropout": keys[1]}, example_batch, train=False)
    params, fp8_meta = split_variables(variables)
    fp8_meta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), fp8_meta)
    return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                      fp8_meta=fp8_meta, rng=keys[0])

  abstract = jax.eval_shape(make)
  layout = step_lib.TableLayout.of(abstract.params, mesh.shape[MODEL])
  padded = jax.eval_shape(layout.pad, abstract)
  shardings = step_lib.state_shardings(padded, mesh)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      padded, shardings)


def restore_sharded(directory: str, template: TrainState, tables: step_lib.TableLayout,
                    step: Optional[int] = None) -> Tuple[TrainState, Dict[str, Any]]:
  """(state laid out like `template`, extras) from checkpoint `step` (default: the newest).

  `template` comes from `sharded_template` (or is a state on the target mesh) and `tables`
  is its TableLayout (`step.table_layout`); the checkpoint may come from any mesh. Missing
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
  unpadded = tables.abstract_unpadded(template)
  abstract = unpadded.to_state_dict()
  try:
    restored, extras = read_step(os.path.join(directory, str(step)), abstract)
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"checkpoint {directory}/{step} does not fit this model's state "
                          f"(another model or preset?): {str(e)[:400]}") from e
  state = unpadded.from_state_dict(restored)
  if tables.padding():
    shardings = jax.tree.map(lambda x: x.sharding, template)
    state = jax.jit(tables.pad, out_shardings=shardings)(state)
  if not all_finite((state.params, state.opt_state, state.fp8_meta)):
    raise CheckpointError(f"checkpoint {directory}/{step} holds non-finite values")
  return state, extras
