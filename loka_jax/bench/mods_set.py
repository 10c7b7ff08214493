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

from loka_jax.models.presets import KEEP_BIAS, MODS

DEFAULT: Tuple[str, ...] = ("all",)

T = TypeVar("T")


def parse(names: Union[str, Sequence[str]]) -> Tuple[str, ...]:
  """The canonical Mods set: DEFAULT for 'all' (or every Mod named), else the Mods named in
  MODS' order. An empty set or an unknown name is an error: the arms without Mods are bf16
  and the FP8 peers already."""
  if isinstance(names, str):
    names = names.split(",")
  names = [n.strip() for n in names if n and n.strip()]
  keep = tuple(sorted(dict.fromkeys(n for n in names if n.startswith(KEEP_BIAS))))
  names = [n for n in names if not n.startswith(KEEP_BIAS)]
  unknown = [n for n in names if n not in MODS + DEFAULT]
  if unknown:
    raise ValueError(f"unknown Mod(s) {unknown} in the Mods set; valid: "
                     f"{', '.join(MODS + DEFAULT)}, {KEEP_BIAS}PATTERN")
  if not names:
    raise ValueError("the Mods set is empty: name at least one of "
                     f"{', '.join(MODS)}, or 'all' (the runs without Mods are the bf16 and "
                     "FP8 arms)")
  every = "all" in names or set(names) == set(MODS)
  base = MODS if every else tuple(m for m in MODS if m in names)
  if keep:
    if KEEP_BIAS in keep:
      raise ValueError(f"an empty {KEEP_BIAS} pattern in the Mods set")
    if "no_bias" not in base:
      raise ValueError(f"{keep[0]} keeps biases that only No Bias drops: add no_bias (or "
                       "all) to the Mods set")
    return base + keep
  return DEFAULT if every else base


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


def row_subject(row: Mapping) -> str:
  """'model/preset' of a speed row, its Mods set named where it is not the default."""
  return f"{row['model']}/{preset_label(row['preset'], of_row(row))}"


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
