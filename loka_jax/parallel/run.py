"""A sharded training run: the loop's files (metrics.jsonl, checkpoints/, final.json) with the
sharded step, resumable on any mesh (checkpoints hold the tables without padding).

Kept small on purpose: evaluation, metrics lines and checkpoint layout are the training
loop's own (loka_jax/train); only the step and the state layout differ.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Mapping, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from loka_jax import jsonio
from loka_jax.parallel import checkpoint as checkpoint_lib
from loka_jax.parallel import step as step_lib
from loka_jax.parallel.mesh import format_mesh_spec
from loka_jax.train import loop
from loka_jax.train.optim import make_optimizer
from loka_jax.train.metrics import json_safe

CHECKPOINTS = "checkpoints"


def _has_checkpoint(directory: str) -> bool:
  if not os.path.isdir(directory):
    return False
  with checkpoint_lib.Checkpointer(directory) as checkpointer:
    return bool(checkpointer.steps())


def train_sharded(model, source, workdir: str, config: loop.TrainConfig, mesh: Mesh,
                  parallel: step_lib.ParallelConfig = step_lib.ParallelConfig(), *,
                  run_info: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
  """Trains `model` on `source` over `mesh` up to `config.steps`; returns final.json's dict.

  A non-finite loss or gradient is never applied; with nan_policy 'stop' the run saves the
  last good state and raises loop.NonFiniteError, with 'skip' it moves on to the next batch.
  """
  if config.module_norms:
    raise ValueError("module_norms is logged by the single-device loop only: train the run "
                     "to read without a mesh")
  os.makedirs(workdir, exist_ok=True)
  run_info = dict(run_info or {}, mesh=format_mesh_spec(mesh), collectives=parallel.collectives)
  tx = make_optimizer(config.optim)
  example = source.train_batch(0, config.batch_size)
  directory = os.path.join(workdir, CHECKPOINTS)
  tables = step_lib.table_layout(model, tx, example, mesh)
  save = lambda state: checkpoint_lib.save_sharded(  # noqa: E731
      directory, state, tables, keep=config.keep_checkpoints)
  if _has_checkpoint(directory):
    template = checkpoint_lib.sharded_template(model, tx, example, mesh)
    state, _ = checkpoint_lib.restore_sharded(directory, template, tables)
  else:
    state = step_lib.init_sharded_state(model, tx, example, config.seed, mesh)
  first = int(jax.device_get(state.step))
  step_fn = step_lib.make_train_step(model, tx, mesh, state,
                                     step_lib.shard_batch(example, mesh), parallel,
                                     config.nan_policy)
  # Every process computes the same global values; one of them writes the run's files.
  primary = jax.process_index() == 0
  writer = (loop.MetricsWriter(os.path.join(workdir, "metrics.jsonl"), first) if primary
            else _NoWriter())
  start, losses, skipped = time.time(), [], 0
  try:
    for i in range(first, config.steps):
      batch = step_lib.shard_batch(source.train_batch(i, config.batch_size), mesh)
      state, out = step_fn(state, batch)
      ok = bool(out["ok"])
      if not ok and config.nan_policy == "stop":
        if config.saves:
          save(state)
        raise loop.NonFiniteError(
            f"non-finite loss or gradient at step {i} (sharded run on "
            f"{format_mesh_spec(mesh)}); the last good state is saved in {directory}",
            step=i, site=None, checkpoint=directory)
      skipped += not ok
      losses.append(out["loss"])
      done = i + 1
      if done % max(config.log_every, 1) == 0 or done == config.steps:
        mean = float(np.mean(jax.device_get(losses))) if losses else float("nan")
        writer.write({"step": done, "loss": mean, "time": time.time() - start})
        losses = []
      if config.checkpoint_every and done % config.checkpoint_every == 0:
        save(state)
  finally:
    writer.close()
  if config.saves:
    save(state)
  _, eval_step = loop.compiled_steps(model, config.optim, config.nan_policy)
  evaluation = loop.evaluate(eval_step, step_lib.unshard_state(state, tables), source,
                             config.eval_batch_size or config.batch_size)
  final = {"ne": evaluation["ne"], "auc": evaluation["auc"], "logloss": evaluation["logloss"],
           "steps": int(jax.device_get(state.step)), "skipped_steps": skipped,
           "seed": config.seed, "time": time.time() - start}
  final.update({k: v for k, v in run_info.items() if k not in final})
  final = json_safe(final)
  if primary:
    jsonio.write_json_atomic(os.path.join(workdir, "final.json"), final, sort_keys=True)
  return final


class _NoWriter:
  """The metrics writer of every process but the first."""

  def write(self, record) -> None:
    del record

  def close(self) -> None:
    pass
