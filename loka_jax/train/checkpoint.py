"""Checkpoints of a training run: state, fp8 state, data position, rng and extras.

A checkpoint `DIR/<step>/` holds the TrainState (params, optimizer state, fp8_meta, step, rng)
and a free-form `extras` dict: top-level entries whose leaves are all arrays (probe
statistics) are stored as arrays, every other entry (the active plan, configs) as JSON.

Layout (`loka.checkpoint/1`):
  DIR/<step>/state/<part>/     orbax (OCDBT) directories, one per part of the state's arrays
  DIR/<step>/extras/<part>/    the same for the array extras
  DIR/<step>/layout.json       which array (its path in the tree) lives in which part, and
                               the JSON extras
Arrays are written PART BY PART, each part at most `part_bytes` (default HOST_TRANSFER_GB):
orbax moves every array of one save through host memory at once, whatever its
`save_concurrent_gb` (that bounds only the disk writes), and Wukong large's 50 GiB state plus
25 GiB of probe statistics exhausted a 128 GiB GPU host that way (H200, 2026-11-26). Restores
read part by part as well.

Writes are atomic: a step is written to `DIR/<step>.loka-tmp-<pid>` and renamed when
complete, so a run killed mid-write leaves the previous checkpoints intact and its partial
directory is ignored; a write that fails (a full disk) removes its partial directory and says
that the previous checkpoints are intact.

Integrity: layout.json, written after the arrays, holds a CRC-32 of every array's bytes
(`digests`) and a sha256 of its own content (`sha256`). A restore checks both: a flipped bit
in an array or in the layout fails the check. CRC-32 catches every error of up to 32
consecutive bits and misses a random corruption with probability 2**-32. Restore tries the
newest step first; one that fails to read, fails its integrity check or holds non-finite
values is moved aside to `DIR/corrupt-<step>` with a warning naming why, and the previous one
is used.

Rotation keeps the newest `keep` checkpoints and also the newest *earned* one: a checkpoint
earns its place once training from it reached the next save with every step finite
(`DIR/earned.json`). A newer checkpoint that has not earned it (a state that was never trained
on, or one followed by skipped non-finite steps) never pushes it out.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from loka_jax import jsonio
from loka_jax.train.state import TrainState, all_finite

FORMAT = "loka.checkpoint/1"
LAYOUT_JSON = "layout.json"
TMP_MARK = ".loka-tmp-"  # in the name of a step's directory while it is being written
STATE = "state"
EXTRAS = "extras"
HOST_TRANSFER_GB = 4  # the most array data one save or restore holds in host memory at once
DIGESTS = "digests"
EARNED_JSON = "earned.json"


class CheckpointError(RuntimeError):
  """No usable checkpoint: the message names the directory and what to do."""


def _is_array_tree(value) -> bool:
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(isinstance(x, (np.ndarray, jax.Array)) for x in leaves)


def split_extras(extras: Optional[Mapping[str, Any]]) -> Tuple[Dict, Dict]:
  """(JSON entries, array entries) of `extras`; a JSON entry that does not serialize is an
  error naming its key. Array entries stay where they are (device arrays are not copied to
  the host here: the part-by-part write does that, a part at a time)."""
  json_part, array_part = {}, {}
  for key, value in (extras or {}).items():
    if _is_array_tree(value):
      array_part[key] = value
      continue
    try:
      json.dumps(value)
    except TypeError as e:
      raise TypeError(f"checkpoint extras[{key!r}] is neither a tree of arrays nor "
                      f"JSON-serializable: {e}") from e
    json_part[key] = value
  return json_part, array_part


def _nbytes(x) -> int:
  return int(x.nbytes)  # jax and numpy arrays alike, without a host copy


def plan_parts(sizes: Sequence[int], part_bytes: int) -> List[int]:
  """The part of each array, in order: consecutive arrays share a part while their bytes sum
  to at most `part_bytes`; an array larger than that gets a part of its own."""
  parts, part, used = [], 0, 0
  for size in sizes:
    if used and used + size > part_bytes:
      part, used = part + 1, 0
    parts.append(part)
    used += size
  return parts


def _handler():
  return ocp.StandardCheckpointHandler(save_concurrent_gb=HOST_TRANSFER_GB,
                                       restore_concurrent_gb=HOST_TRANSFER_GB)


def _key(i: int) -> str:
  return f"a{i:05d}"


def array_digest(x) -> Optional[str]:
  """'crc32:<hex>' of an array's bytes in C order; None for an array this process cannot read
  whole (sharded over several processes: each process sees only its shards)."""
  if not getattr(x, "is_fully_addressable", True):
    return None
  host = np.ascontiguousarray(np.asarray(jax.device_get(x)))
  return f"crc32:{zlib.crc32(host.reshape(-1).view(np.uint8)):08x}"


def _write_arrays(directory: str, flat: Mapping[Tuple, Any], part_bytes: int
                  ) -> Tuple[List[List], Dict[str, Optional[str]]]:
  """Writes the arrays of `flat` ({path: array}) part by part under `directory`; returns the
  layout rows [path, part, key] and {key: `array_digest`}."""
  paths = list(flat)
  parts = plan_parts([_nbytes(flat[p]) for p in paths], part_bytes)
  rows = [[list(p), part, _key(i)] for i, (p, part) in enumerate(zip(paths, parts))]
  digests = {}
  with ocp.Checkpointer(_handler()) as checkpointer:
    for part in sorted(set(parts)):
      tree = {key: flat[tuple(path)] for path, q, key in rows if q == part}
      checkpointer.save(os.path.join(directory, f"{part:04d}"), args=ocp.args.StandardSave(tree))
      digests.update({key: array_digest(x) for key, x in tree.items()})
  return rows, digests


def _read_arrays(directory: str, rows: Sequence[Sequence],
                 abstract: Optional[Mapping[Tuple, Any]] = None,
                 digests: Optional[Mapping[str, Optional[str]]] = None) -> Dict[Tuple, Any]:
  """{path: array} read part by part (into `abstract`'s shapes, dtypes and shardings when
  given, {path: ShapeDtypeStruct}); each array whose digest `digests` records must match it,
  else ValueError naming the array."""
  out = {}
  with ocp.Checkpointer(_handler()) as checkpointer:
    for part in sorted({int(r[1]) for r in rows}):
      members = [(tuple(path), key) for path, q, key in rows if int(q) == part]
      target = None if abstract is None else {key: abstract[path] for path, key in members}
      args = ocp.args.StandardRestore(target) if target is not None else ocp.args.StandardRestore()
      tree = checkpointer.restore(os.path.join(directory, f"{part:04d}"), args=args)
      for path, key in members:
        want = (digests or {}).get(key)
        if want is not None:
          got = array_digest(tree[key])
          if got is not None and got != want:
            raise ValueError(f"array {'/'.join(map(str, path))} fails its integrity check "
                             f"({got}, written as {want})")
        out[path] = tree[key]
  return out


def write_step(directory: str, step: int, state_dict: Mapping, extras_json: Mapping,
               extras_arrays: Mapping, part_bytes: int) -> str:
  """Writes checkpoint `step` atomically (see the module docstring); returns its directory."""
  final = os.path.join(directory, str(step))
  # Several processes (jax.distributed) write one checkpoint together: orbax writes each
  # process's shards into the same directory, the first process does the rest.
  primary = jax.process_index() == 0
  # No process may create this write's directory before the first has cleared old ones.
  _sync("loka_checkpoint_begin")
  # Unfinished writes of killed runs are never checkpoints; a large model's would fill the
  # disk (Wukong large's probe checkpoint takes 41 GB), so they go before this one is written.
  for name in os.listdir(directory) if primary else ():
    if TMP_MARK in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
  mark = os.getpid() if jax.process_count() == 1 else "processes"
  tmp = os.path.join(directory, f"{step}{TMP_MARK}{mark}")
  try:
    if primary:  # the others write into it once the barrier says it exists
      os.makedirs(tmp)
    _sync("loka_checkpoint_tmp")
    state_rows, state_digests = _write_arrays(
        os.path.join(tmp, STATE), flax.traverse_util.flatten_dict(dict(state_dict)), part_bytes)
    extras_rows, extras_digests = (_write_arrays(
        os.path.join(tmp, EXTRAS), flax.traverse_util.flatten_dict(dict(extras_arrays)),
        part_bytes) if extras_arrays else ([], {}))
    # Written after every array: a checkpoint with a layout holds all of its data.
    layout = jsonio.with_digest({
        "format": FORMAT, "step": int(step), "extras_json": dict(extras_json),
        STATE: state_rows, EXTRAS: extras_rows,
        DIGESTS: {STATE: state_digests, EXTRAS: extras_digests}})
    if primary:
      with open(os.path.join(tmp, LAYOUT_JSON), "w") as f:
        json.dump(layout, f)
        f.flush()
        os.fsync(f.fileno())
  except OSError as e:   # a full disk or a quota
    shutil.rmtree(tmp, ignore_errors=True)
    kept = checkpoint_steps(directory)
    raise CheckpointError(
        f"cannot write checkpoint {final} ({e}); "
        + (f"the previous checkpoints ({', '.join(map(str, kept))}) are intact" if kept
           else "no earlier checkpoint exists")) from e
  if primary:
    commit(tmp, final)
  _sync("loka_checkpoint_commit")
  return final


def _sync(name: str) -> None:
  """A barrier of every process (nothing to wait for in a single-process run)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def commit(tmp: str, final: str) -> None:
  """Makes the fully written `tmp` the checkpoint `final` (one rename: a run killed before it
  leaves only an ignored temporary directory)."""
  os.rename(tmp, final)


def checkpoint_steps(directory: str) -> List[int]:
  """Steps of the checkpoints in `directory`, oldest first (none if it does not exist;
  unfinished writes are not among them)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def _read_layout(step_dir: str) -> Dict[str, Any]:
  path = os.path.join(step_dir, LAYOUT_JSON)
  if not os.path.exists(path):
    raise ValueError(f"{step_dir} has no {LAYOUT_JSON} (not a {FORMAT} checkpoint)")
  with open(path) as f:
    layout = json.load(f)
  if not isinstance(layout, dict) or layout.get("format") != FORMAT:
    raise ValueError(f"{path}: format "
                     f"{layout.get('format') if isinstance(layout, dict) else None!r}, "
                     f"expected {FORMAT!r}")
  jsonio.check_digest(layout, path, "checkpoint layout", "it is moved aside", ValueError)
  return layout


def _digests(layout: Mapping, section: str) -> Dict[str, Optional[str]]:
  """{key: digest} of a section's arrays (none for a checkpoint written before digests)."""
  return dict((layout.get(DIGESTS) or {}).get(section) or {})


def _extras(step_dir: str, layout: Mapping, array_extras: bool) -> Dict[str, Any]:
  extras = dict(layout.get("extras_json") or {})
  if array_extras and layout.get(EXTRAS):
    extras.update(flax.traverse_util.unflatten_dict(
        _read_arrays(os.path.join(step_dir, EXTRAS), layout[EXTRAS],
                     digests=_digests(layout, EXTRAS))))
  return extras


def latest_json_extras(directory: str) -> Optional[Tuple[int, Dict[str, Any]]]:
  """(step, JSON extras) of the newest checkpoint in `directory` without reading any array,
  or None when there is none or its layout is unreadable (a restore moves it aside)."""
  steps = checkpoint_steps(directory)
  if not steps:
    return None
  step_dir = os.path.join(directory, str(steps[-1]))
  try:
    return steps[-1], _extras(step_dir, _read_layout(step_dir), array_extras=False)
  except (OSError, ValueError):
    return None


def read_step(step_dir: str, abstract_state: Mapping, array_extras: bool = True
              ) -> Tuple[Dict, Dict[str, Any]]:
  """(state dict, extras) of one checkpoint directory, the state read into `abstract_state`
  (a state dict of ShapeDtypeStructs, shardings included); a mismatch names the paths.
  `array_extras=False` leaves the array extras (probe statistics) unread."""
  layout = _read_layout(step_dir)
  template = flax.traverse_util.flatten_dict(dict(abstract_state), keep_empty_nodes=True)
  wanted = {p for p, v in template.items() if v is not flax.traverse_util.empty_node}
  saved = {tuple(r[0]) for r in layout[STATE]}
  if saved != wanted:
    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    raise ValueError("the checkpoint's arrays do not match this state: missing "
                     f"{['/'.join(map(str, p)) for p in missing[:5]]}, unexpected "
                     f"{['/'.join(map(str, p)) for p in extra[:5]]}")
  arrays = _read_arrays(os.path.join(step_dir, STATE), layout[STATE],
                        {p: template[p] for p in wanted}, _digests(layout, STATE))
  state = flax.traverse_util.unflatten_dict({**template, **arrays})
  return state, _extras(step_dir, layout, array_extras)


def read_extras(step_dir: str) -> Dict[str, Any]:
  """The extras (JSON and arrays) of one checkpoint directory, its state left unread: a
  probe resuming takes its statistics from here while the training loop reads the state, so
  the two never hold a state each (Wukong large: 37 GB)."""
  return _extras(step_dir, _read_layout(step_dir), array_extras=True)


class Checkpointer:
  """Saves and restores TrainStates under one directory, keeping the last `keep`.

  `part_bytes`: the most array bytes one orbax save or restore handles (and so holds in host
  memory) at a time."""

  def __init__(self, directory: str, keep: int = 3,
               part_bytes: int = HOST_TRANSFER_GB * 1024 ** 3):
    if keep < 1:
      raise ValueError(f"keep must be >= 1 checkpoint, got {keep}")
    if part_bytes < 1:
      raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    self.directory = os.path.abspath(directory)
    self.keep = keep
    self.part_bytes = part_bytes
    os.makedirs(self.directory, exist_ok=True)

  def steps(self):
    """Steps of the checkpoints, oldest first (unfinished writes are not among them)."""
    return checkpoint_steps(self.directory)

  def latest_step(self) -> Optional[int]:
    steps = self.steps()
    return steps[-1] if steps else None

  def earned_step(self) -> Optional[int]:
    """The newest checkpoint that training from it reached the next save with every step
    finite (rotation keeps it), or None."""
    try:
      with open(os.path.join(self.directory, EARNED_JSON)) as f:
        step = int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
      return None
    return step if step in self.steps() else None

  def mark_earned(self, step: int) -> None:
    """Records that checkpoint `step` was followed by finite training to the next save."""
    if step in self.steps():
      jsonio.write_json_atomic(os.path.join(self.directory, EARNED_JSON), {"step": int(step)})

  def save(self, state: TrainState, extras: Optional[Mapping[str, Any]] = None,
           previous_earned: bool = False) -> int:
    """Writes `state` (and extras) at its step; a step already saved is left as it is.
    `previous_earned`: every step since the newest earlier checkpoint was finite, so that one
    has earned its place (the module docstring). Rotation then removes all but the newest
    `keep` checkpoints and the earned one."""
    step = int(jax.device_get(state.step))
    if step in self.steps():
      return step
    before = [s for s in self.steps() if s < step]
    if previous_earned and before:
      self.mark_earned(before[-1])
    json_part, array_part = split_extras(extras)
    write_step(self.directory, step, state.to_state_dict(), json_part, array_part,
               self.part_bytes)
    earned = self.earned_step()
    for old in self.steps()[:-self.keep] if jax.process_index() == 0 else ():
      if old != earned:
        shutil.rmtree(os.path.join(self.directory, str(old)))
    return step

  def _restore_step(self, step: int, template: TrainState, array_extras: bool = True):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template.to_state_dict())
    state_dict, extras = read_step(os.path.join(self.directory, str(step)), abstract,
                                   array_extras)
    state = template.from_state_dict(state_dict)
    if int(jax.device_get(state.step)) != step:
      raise ValueError(f"holds step {int(state.step)} in a directory named {step}")
    if not all_finite((state.params, state.opt_state, state.fp8_meta)):
      raise ValueError("holds non-finite parameters or optimizer state")
    return state, extras

  def _move_aside(self, step: int) -> str:
    target = os.path.join(self.directory, f"corrupt-{step}")
    n = 1
    while os.path.exists(target):
      n += 1
      target = os.path.join(self.directory, f"corrupt-{step}.{n}")
    os.rename(os.path.join(self.directory, str(step)), target)
    return target

  def restore(self, template: TrainState, array_extras: bool = True
              ) -> Optional[Tuple[TrainState, Dict[str, Any]]]:
    """(state, extras) of the newest readable checkpoint, or None if there is none.
    `array_extras=False` skips the array extras (a probe's 19 GB of statistics on Wukong
    large) when only the state is wanted.

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
        return self._restore_step(step, template, array_extras)
      except Exception as e:  # orbax/tensorstore raise many types for damaged files
        moved = self._move_aside(step)
        failures.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
        logging.warning("checkpoint %s/%d is unreadable or damaged (%s); moved it to %s and "
                        "falling back to the previous checkpoint", self.directory, step,
                        failures[-1], moved)
        print(f"checkpoint {self.directory}/{step} is unreadable or damaged ({failures[-1]}); "
              f"moved it to {moved}", file=sys.stderr, flush=True)
    raise CheckpointError(
        f"no readable checkpoint in {self.directory} (each was moved to corrupt-<step>):\n  "
        + "\n  ".join(failures)
        + "\nRerunning now starts from step 0; restore a copy of the directory to resume instead.")

  def restore_extras(self) -> Optional[Tuple[int, Dict[str, Any]]]:
    """(step, extras) of the newest checkpoint whose extras read, without its state; None if
    there is none. Unreadable ones are skipped with a warning and left where they are: the
    restore of the state decides what is moved aside."""
    for step in reversed(self.steps()):
      try:
        return step, read_extras(os.path.join(self.directory, str(step)))
      except Exception as e:  # orbax/tensorstore raise many types for damaged files
        logging.warning("the extras of checkpoint %s/%d are unreadable (%s: %s); trying the "
                        "previous one", self.directory, step, type(e).__name__, str(e)[:300])
    return None

  def close(self) -> None:
    """Nothing to release (every write finished in `save`); kept for `with` blocks."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
