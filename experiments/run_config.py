"""What the config-driven mains (`experiments.loka`, `train`, `probe`, `dispatch`, `ablate_mods`,
`kernels`, `profile_step`) share: their --config flag and its parsing, JAX's persistent
compilation cache (`use_compilation_cache`, on in every main and in `experiments.measure` and
`experiments.report`), the fields whose values come
from a fixed list, comma-separated fields as tuples, and a config's `run` group as the
library's RunSpec.

A main reads its settings from a config file, `experiments/configs/<name>.py`, whose
`get_config()` returns an ml_collections ConfigDict; `--config.GROUP.FIELD=VALUE` overrides one
field, and ml_collections parses the value as the field's type. A field the config does not
have, a value of the wrong type, one outside a field's list or below its lower bound ends the
program with one line naming the field, before the main runs.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Dict, Optional, Sequence, Tuple

from absl import app, flags
from ml_collections import config_flags

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

DATA_SOURCES = ("synthetic", "movielens", "criteo")
PRECISIONS = ("fp32", "bf16", "fp8_all", "loka")  # loka: the kernels of run.plan
COLLECTIVES = ("fp32", "bf16", "fp8")
AUTO = ("auto", "on", "off")  # auto: on a GPU only


def choices() -> Dict[str, Tuple[str, ...]]:
  """The values each listed field accepts, by its path in the config."""
  from loka_jax.data.spec import ID_POLICIES
  from loka_jax.dispatch.selection import OBJECTIVES
  from loka_jax.models import MODEL_NAMES, PRESETS
  from loka_jax.probe.eligibility import METRICS
  from loka_jax.train import NAN_POLICIES
  from loka_jax.train.ablation_arms import TIMING_MODES
  return {"run.model": MODEL_NAMES, "run.preset": PRESETS, "run.data": DATA_SOURCES,
          "run.precision": PRECISIONS, "run.id_policy": ID_POLICIES,
          "train.nan_policy": NAN_POLICIES, "parallel.collectives": COLLECTIVES,
          "select.metric": METRICS, "select.objective": OBJECTIVES,
          "timing.time": AUTO, "timing.write_table": AUTO, "timing.mode": TIMING_MODES,
          "target.model": MODEL_NAMES, "target.preset": PRESETS}


# The least value a listed numeric field takes, by its path in the config.
LOWER_BOUNDS = {"timing.compile_workers": 1, "timing.min_gflops": 0.0, "train.prefetch": 0,
                "train.batch_workers": -1, "speed.train_calls": 1}


def define_config_flag(name: str) -> flags.FlagHolder:
  """Defines --config, by default `experiments/configs/<name>.py`, so the main runs its
  defaults with no argument. ml_collections reads the default file, with the overrides on
  the command line, right here: an override naming no field ends the program here."""
  try:
    return config_flags.DEFINE_config_file(
        "config", os.path.join(CONFIGS, f"{name}.py"),
        "Settings file (get_config() returning a ConfigDict). Override one field with "
        "--config.GROUP.FIELD=VALUE, e.g. --config.run.steps=50.", lock_config=True)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    _exit(e, sys.argv)


def parse_flags(argv: Sequence[str]):
  """`app.run`'s flags parser for a config-driven main: a wrong flag, field or value prints
  one line (`error: --config.run.steps=abc: ...`) and exits 1; --help exits 0."""
  try:
    rest = flags.FLAGS(list(argv))
    config = flags.FLAGS["config"].value
    given = {path: config[path.split(".")[0]].get(path.split(".")[1])  # a failed load raises
             for path in (*choices(), *LOWER_BOUNDS) if path.split(".")[0] in config}
  except SystemExit as e:  # absl's help flags print their text and exit 1: no error here
    sys.exit(0 if e.code == 1 else e.code)
  except OSError as e:  # the config file did not load: its message's last line says why
    name = ([a for a in argv if re.match(r"-{1,2}config=", a)] or ["--config"])[0]
    sys.exit(f"error: {name}: {str(e).strip().splitlines()[-1].strip()}")
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    _exit(e, argv)
  for path, allowed in choices().items():
    if given.get(path) is not None and given[path] not in allowed:
      sys.exit(f"error: --config.{path}={given[path]}: not one of {', '.join(allowed)}")
  for path, least in LOWER_BOUNDS.items():
    if given.get(path) is not None and given[path] < least:
      sys.exit(f"error: --config.{path}={given[path]}: must be >= {least}")
  use_compilation_cache(config.get("compilation_cache") if "compilation_cache" in config
                        else None)
  return rest


DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "loka_jax",
                                         "jax_cache")
# Compiles at least this long are written to the cache: a tower's training step takes 10-60 s
# to compile on a GPU, the probe's per-site evaluation and timing programs 0.5-5 s each.
# $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, JAX's own setting, overrides it when set (the
# CPU tests set it lower: a run they kill and resume loads its short compiles as well).
CACHE_MIN_COMPILE_SECONDS = 0.5


def use_compilation_cache(directory: Optional[str] = None) -> Optional[str]:
  """Turns on JAX's persistent compilation cache for this process, so a second run of the
  same model and plan loads its executables instead of compiling them. `directory`: a
  config's `compilation_cache` field ('' turns the cache off); None: $JAX_COMPILATION_CACHE_DIR
  when set, else ~/.cache/loka_jax/jax_cache. Compiles shorter than
  $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (unset: CACHE_MIN_COMPILE_SECONDS) are not
  cached. Returns the directory in use (None: off)."""
  import jax
  if directory == "":
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  directory = (directory or os.environ.get("JAX_COMPILATION_CACHE_DIR")
               or DEFAULT_COMPILATION_CACHE)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(
      os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", CACHE_MIN_COMPILE_SECONDS)))
  return directory


def _exit(error: BaseException, argv: Sequence[str]):
  """Exits with one line naming the override at fault where the error names its field."""
  while isinstance(error, BaseException) and error.args:  # AttributeError(KeyError(text))
    error = error.args[0]
  text = " ".join(str(error).split())
  overrides = [a.split("=", 1)[0] for a in argv if re.match(r"-{1,2}(no)?config\.", a)]
  named = re.match(r"'([^']+)'", text)
  if named:  # ml_collections names the missing field, and a close one when there is one
    fault = [o for o in overrides if named.group(1) in o.split(".")[1:]]
    hint = text[named.end():].strip()
    text = f"no field {named.group(0)} in the config" + (f" ({hint})" if hint else "")
    if fault:
      sys.exit(f"error: {fault[0]}: {text}")
  if text.startswith("flag --"):  # absl's own message names the flag
    sys.exit(f"error: {text[len('flag '):]}")
  sys.exit(f"error: {text}")


def split(value: Optional[str]) -> Tuple[str, ...]:
  """The entries of a comma-separated field, stripped, empty ones dropped (None: none)."""
  return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def auto(value: str) -> Optional[bool]:
  """An `AUTO` field as the library's tri-state: None (auto), True (on) or False (off)."""
  return None if value == "auto" else value == "on"


def mods(value: str) -> Tuple[str, ...]:
  """The Mods of a comma-separated `run.mods` (keep_bias:PATTERN entries as given)."""
  from loka_jax.train import experiment
  return experiment.parse_mods(value.split(","))


def run_spec(run, **overrides):
  """The RunSpec of a config's `run` group: each RunSpec field the group holds, `mods` split,
  `num_eval` 0 as the source's default; `overrides` set the rest (an arm's precision, ...)."""
  import dataclasses
  from loka_jax.train import experiment
  fields = {f.name for f in dataclasses.fields(experiment.RunSpec)}
  values = {k: v for k, v in run.items() if k in fields}
  values.update(mods=mods(run.mods), num_eval=run.num_eval or None)
  values.update(overrides)
  return experiment.RunSpec(**values)


def read_plan_arg(path: str, flag: str = "--plan"):
  """`read_plan` of a command-line argument (a Plan): a missing, corrupt or wrong-schema file
  is absl's UsageError naming the flag and the file, not a traceback."""
  from loka_jax.plan.file import read_plan
  if not os.path.exists(path):
    raise app.UsageError(f"{flag}={path}: no such file")
  try:
    return read_plan(path)
  except ValueError as e:   # PlanFileError, or a malformed plan's own error
    raise app.UsageError(str(e)) from e
