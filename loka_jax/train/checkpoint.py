"""Orbax checkpoints of a training run: state, fp8 state, data position, rng and extras.

A checkpoint `DIR/<step>/` holds the TrainState (params, optimizer state, fp8_meta, step, rng)
and a free-form `extras` dict: top-level entries whose leaves are all arrays (probe
statistics) are stored as arrays, every other entry (the active plan, configs) as JSON.
Writes are atomic (orbax writes a temporary directory and renames it when complete), so a
run killed mid-write leaves the previous checkpoints intact. Restore tries the newest step
first; an unreadable or non-finite one is moved aside to `DIR/corrupt-<step>` with a warning
and the previous one is used.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from loka_jax.train.state import TrainState, all_finite

STATE = "state"
EXTRAS_JSON = "extras_json"
EXTRAS_ARRAYS = "extras_arrays"
HOST_TRANSFER_GB = 4  # the most array data one save or restore holds in host memory at once


class CheckpointError(RuntimeError):
  """No usable checkpoint: the message names the directory and what to do."""


def _is_array_tree(value) -> bool:
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(isinstance(x, (np.ndarray, jax.Array)) for x in leaves)


def split_extras(extras: Optional[Mapping[str, Any]]) -> Tuple[Dict, Dict]:
  """(JSON entries, array entries) of `extras`; a JSON entry that does not serialize is an
  error naming its key."""
  json_part, array_part = {}, {}
  for key, value in (extras or {}).items():
    if _is_array_tree(value):
      array_part[key] = jax.tree.map(np.asarray, value)
      continue
    try:
      json.dumps(value)
    except TypeError as e:
      raise TypeError(f"checkpoint extras[{key!r}] is neither a tree of arrays nor "
                      f"JSON-serializable: {e}") from e
    json_part[key] = value
  return json_part, array_part


def item_handlers() -> Dict[str, Any]:
  """orbax handlers of a run's checkpoint items, with bounded host transfers.

  orbax's default moves up to 96 GB through host memory at once; Wukong large's 50 GiB state
  then exhausted a 128 GiB GPU host mid-save (H200, 2026-11-26). The bound costs nothing in
  correctness.
  """
  def arrays():
    return ocp.StandardCheckpointHandler(save_concurrent_gb=HOST_TRANSFER_GB,
                                         restore_concurrent_gb=HOST_TRANSFER_GB)
  return {STATE: arrays(), EXTRAS_JSON: ocp.JsonCheckpointHandler(), EXTRAS_ARRAYS: arrays()}


class Checkpointer:
  """Saves and restores TrainStates under one directory, keeping the last `keep`."""

  def __init__(self, directory: str, keep: int = 3):
    if keep < 1:
      raise ValueError(f"keep must be >= 1 checkpoint, got {keep}")
    self.directory = os.path.abspath(directory)
    self.keep = keep
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(self.directory, options=options,
                                 item_handlers=item_handlers())

  def steps(self):
    """Steps of the complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    steps = self.steps()
    return steps[-1] if steps else None

  def save(self, state: TrainState, extras: Optional[Mapping[str, Any]] = None) -> int:
    """Writes `state` (and extras) at its step; a step already saved is left as it is."""
    step = int(jax.device_get(state.step))
    if step in self._manager.all_steps():
      return step
    json_part, array_part = split_extras(extras)
    items = {STATE: ocp.args.StandardSave(state.to_state_dict()),
             EXTRAS_JSON: ocp.args.JsonSave(json_part)}
    if array_part:  # orbax refuses empty items
      items[EXTRAS_ARRAYS] = ocp.args.StandardSave(array_part)
    self._manager.save(step, args=ocp.args.Composite(**items))
    self._manager.wait_until_finished()
    return step

  def _restore_step(self, step: int, template: TrainState):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template.to_state_dict())
    items = {STATE: ocp.args.StandardRestore(abstract), EXTRAS_JSON: ocp.args.JsonRestore()}
    if os.path.isdir(os.path.join(self.directory, str(step), EXTRAS_ARRAYS)):
      items[EXTRAS_ARRAYS] = ocp.args.StandardRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state = template.from_state_dict(restored[STATE])
    if int(jax.device_get(state.step)) != step:
      raise ValueError(f"holds step {int(state.step)} in a directory named {step}")
    if not all_finite((state.params, state.opt_state, state.fp8_meta)):
      raise ValueError("holds non-finite parameters or optimizer state")
    extras = dict(restored[EXTRAS_JSON] or {})
    if EXTRAS_ARRAYS in items:
      extras.update(restored[EXTRAS_ARRAYS])
    return state, extras

  def _move_aside(self, step: int) -> str:
    target = os.path.join(self.directory, f"corrupt-{step}")
    n = 1
    while os.path.exists(target):
      n += 1
      target = os.path.join(self.directory, f"corrupt-{step}.{n}")
    os.rename(os.path.join(self.directory, str(step)), target)
    return target

  def restore(self, template: TrainState) -> Optional[Tuple[TrainState, Dict[str, Any]]]:
    """(state, extras) of the newest readable checkpoint, or None if there is none.

    `template` gives the structure, shapes and dtypes (a freshly created state). A bad
    checkpoint is moved aside with a warning and the previous one tried; if every one is bad
    this raises CheckpointError naming the directory.
    """
    steps = self.steps()
    if not steps:
      return None
    failures = []
    for step in reversed(steps):
      try:
        return self._restore_step(step, template)
      except Exception as e:  # orbax/tensorstore raise many types for damaged files
        moved = self._move_aside(step)
        failures.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
        logging.warning("checkpoint %s/%d is unreadable (%s); moved it to %s and falling back "
                        "to the previous checkpoint", self.directory, step, failures[-1], moved)
        self._manager.close()  # forget the moved step
        self._manager = self._open()
    raise CheckpointError(
        f"no readable checkpoint in {self.directory} (each was moved to corrupt-<step>):\n  "
        + "\n  ".join(failures)
        + "\nRerunning now starts from step 0; restore a copy of the directory to resume instead.")

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
