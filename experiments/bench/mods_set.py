"""The Mods a benchmark run's Mods arms train with (bf16+Mods, its served form, LoKA).

The default is every Mod ('all'). A run with another set, e.g. `no_bias,blocknorm` to see
whether a target's plan holds without Hard Swish, measures a different subject: its rows
carry `mods_set` (the set's label), which is part of their key, so they never stand in for
the default's rows, and the reports compare them only with one another. Its plans live in a
folder of their own, PLANS/mods_<label>/, since a plan is probed and selected on the model
with its Mods. The quality suite's arms without Mods are the same runs in every set, so their
rows never carry a set and each set's comparison shares them (`quality.Comparison.holds`).
Rows of the default set have no `mods_set`, so rows written before it existed keep their
keys.

A set may keep some biases under No Bias (`keep_bias:PATTERN` entries, `presets.KEEP_BIAS`),
e.g. `all,keep_bias:cross_*`: it is then every Mod named one by one, with its patterns, and
its label names them. Folders take the label with `/` and `*` escaped (`folder_label`).
"""
from __future__ import annotations

import dataclasses
import os
import urllib.parse
from typing import Mapping, Optional, Sequence, Tuple, TypeVar, Union

from loka_jax.models.presets import KEEP_BIAS, MODS, parse_mods

DEFAULT: Tuple[str, ...] = ("all",)

T = TypeVar("T")


def parse(names: Union[str, Sequence[str]]) -> Tuple[str, ...]:
  """The canonical Mods set: DEFAULT for 'all' (or every Mod named), else the Mods named in
  MODS' order, then No Bias's `keep_bias:` entries sorted (a set with them names every Mod
  one by one). An empty set is an error, since the arms without Mods are the bf16 and FP8
  arms already; so is anything `presets.parse_mods` refuses."""
  if isinstance(names, str):
    names = names.split(",")
  names = [n.strip() for n in names if n and n.strip()]
  if not [n for n in names if not n.startswith(KEEP_BIAS)]:
    raise ValueError("the Mods set is empty: name at least one of "
                     f"{', '.join(MODS)}, or 'all' (the runs without Mods are the bf16 and "
                     "FP8 arms)")
  mods, patterns = parse_mods(names)
  base = tuple(m for m in MODS if m in mods)
  if patterns:
    return base + tuple(sorted({KEEP_BIAS + p for p in patterns}))
  return DEFAULT if base == MODS else base


def label(mods: Union[str, Sequence[str]]) -> Optional[str]:
  """None for the default set, else its Mods joined by '+' (e.g. 'no_bias+blocknorm')."""
  mods = parse(mods)
  return None if mods == DEFAULT else "+".join(mods)


def of_row(row: Mapping) -> Optional[str]:
  """A row's Mods-set label (None: the default set)."""
  return row.get("mods_set")


def preset_label(preset: str, set_label: Optional[str]) -> str:
  """The preset as the reports name it: with the Mods set where it is not the default."""
  return preset + (f" (Mods {set_label})" if set_label else "")


def subject(model: str, preset: str, set_label: Optional[str]) -> str:
  """'model/preset' as the reports name a subject, its Mods set named where it is not the
  default."""
  return f"{model}/{preset_label(preset, set_label)}"


def row_subject(row: Mapping) -> str:
  """The subject of a speed row (`subject`)."""
  return subject(row["model"], row["preset"], of_row(row))


def of_flag(values: Sequence[str]) -> Tuple[str, ...]:
  """The set a script's --mods (the bench's targets.mods) names: an empty one is every Mod, and
  anything else is `parse`d (ValueError naming what is wrong)."""
  return parse(values or DEFAULT)


def folder_label(set_label: str) -> str:
  """A set's label as one folder name: a keep_bias pattern's `/` and `*` escaped."""
  return urllib.parse.quote(set_label, safe="+_-.:")


def plans_root(plans_dir: str, mods: Sequence[str]) -> str:
  """Where the plans of runs with `mods` live: `plans_dir` for the default set, else its
  mods_<label> subfolder."""
  set_label = label(mods)
  return (plans_dir if set_label is None else
          os.path.join(plans_dir, f"mods_{folder_label(set_label)}"))


def apply(arm: T, mods: Sequence[str]) -> T:
  """`arm` (a speed Variant or a quality arm) with the Mods set in place of its Mods; an arm
  without Mods is returned as it is."""
  if not arm.mods:
    return arm
  return dataclasses.replace(arm, mods=parse(mods))
