"""Mods on a tower config: the one reader of a Mods list (`parse_mods`), switching Mods on
(`apply_mods`) and checking No Bias's keep_bias patterns against a model (`check_keep_bias`).
`build.tower_options` resolves them into the tower's options."""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Dict, Sequence, Tuple, Union

import flax.linen as nn
import ml_collections

from loka_jax.models.site import DenseSite, site_name, trace_sites

MODS = ("no_bias", "blocknorm", "hard_swish")

# A Mods entry `keep_bias:PATTERN` keeps, under No Bias, the biases of the dense sites whose
# path matches the glob PATTERN (e.g. `keep_bias:top_mlp/*`); repeat it for more patterns.
# Why: No Bias with Hard Swish spikes DCNv2 `large` (on an H200) where neither does alone,
# and a spike read names the module to keep.
KEEP_BIAS = "keep_bias:"


class ModsError(ValueError):
  """A Mods list that cannot apply: an unknown Mod, or a keep_bias pattern that cannot."""


def parse_mods(mods: Union[str, Sequence[str]]) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
  """(the Mods named, in order, 'all' expanded; the keep_bias patterns), or ModsError naming
  an unknown Mod, an empty pattern, or patterns without No Bias. The one reader of a Mods list:
  configs (`apply_mods`), the bench's Mods sets and its towers take it from here."""
  if isinstance(mods, str):
    mods = mods.split(",")
  names = [m.strip() for m in mods if m and m.strip()]
  patterns = tuple(m[len(KEEP_BIAS):] for m in names if m.startswith(KEEP_BIAS))
  names = [m for m in names if not m.startswith(KEEP_BIAS)]
  unknown = [m for m in names if m not in MODS + ("all",)]
  if unknown:
    raise ModsError(f"unknown Mod(s) {unknown}; valid: {', '.join(MODS)}, all, "
                    f"{KEEP_BIAS}PATTERN")
  if any(not p for p in patterns):
    raise ModsError(f"an empty {KEEP_BIAS} pattern; name the sites, e.g. "
                    f"{KEEP_BIAS}top_mlp/dense_0 or {KEEP_BIAS}cross_*")
  names = MODS if "all" in names else tuple(dict.fromkeys(names))
  if patterns and "no_bias" not in names:
    raise ModsError(f"{KEEP_BIAS}{patterns[0]} keeps biases that only No Bias drops: add "
                    "no_bias (or all) to the Mods")
  return names, patterns


def apply_mods(config: ml_collections.ConfigDict, mods: Sequence[str]) -> ml_collections.ConfigDict:
  """A copy of `config` with the named Mods on ('no_bias', 'blocknorm', 'hard_swish', 'all'),
  and No Bias's exceptions (`keep_bias:PATTERN` entries) in `mods.keep_bias`."""
  out = ml_collections.ConfigDict(config.to_dict())
  names, patterns = parse_mods(mods)
  for name in names:
    out.mods[name] = True
  if patterns:
    out.mods.keep_bias = patterns
  return out


def check_keep_bias(model: nn.Module, config, example_batch: Callable[[], Any]) -> None:
  """ModsError naming each of `config`'s keep_bias patterns that keeps no bias: one that
  matches no dense site whose bias No Bias drops (a misspelt pattern, a site without a bias
  by design such as a low-rank `v`, or one with a bias anyway such as the prediction layer),
  which would otherwise train plain No Bias silently. `model` is traced abstractly (no
  compilation) with and without its patterns (`TowerOptions.keep_bias`) on `example_batch()`,
  which is only called, and the model only traced, when there are patterns."""
  patterns = tuple(config.mods.get("keep_bias", ()))
  if not patterns:
    return
  batch = example_batch()
  with_patterns = _site_biases(model, batch)
  without = _site_biases(
      model.clone(opts=dataclasses.replace(model.opts, keep_bias=())), batch)
  kept = [s for s, biased in with_patterns.items() if biased and not without.get(s, False)]
  missing = [p for p in patterns if not any(fnmatch.fnmatchcase(s, p) for s in kept)]
  if missing:
    anyway = sorted(s for s, biased in without.items() if biased)
    raise ModsError(f"keep_bias pattern(s) {missing} keep no bias: they match no dense site "
                    "whose bias No Bias drops (patterns are globs over site paths; its dense "
                    f"sites: {', '.join(sorted(with_patterns))}"
                    + (f"; with a bias anyway: {', '.join(anyway)}" if anyway else "") + ")")


def _site_biases(model: nn.Module, batch) -> Dict[str, bool]:
  """Each dense site's path -> whether it has a bias, from an abstract init on `batch`."""
  sites: Dict[str, bool] = {}

  def visit(module, args):
    if isinstance(module, DenseSite):
      sites[site_name(module)] = bool(module.use_bias)

  trace_sites(model, None, batch, visit)
  return sites
