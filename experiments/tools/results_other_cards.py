"""RESULTS' quality verdicts measured on cards other than the page's own, or on the CPU: the same
paired rule, one subsection per device, each with its verdicts, its arms by seed and, after
`--plots`, its paired plot. The manifest lists these row files under 'quality_other_cards',
apart from 'rows', so the page's targets and headline stay those of its one card."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

from experiments.tools.results_sections import ManifestError


def _by_card(paths: Sequence[str], page_device: str) -> Dict[str, List[Dict]]:
  """{card: its quality rows}, refusing a file that holds a row of another suite or of the
  page's own card (those belong under 'rows')."""
  from experiments.bench import collect
  for path in paths:
    for row in collect.read_rows([path]):
      if row.get("suite") != "quality":
        raise ManifestError(f"quality_other_cards: {os.path.basename(path)} holds a "
                            f"{row.get('suite')!r} row; list only quality rows there")
      if row.get("device") == page_device:
        raise ManifestError(f"quality_other_cards: {os.path.basename(path)} holds rows of "
                            f"the {page_device}, the page's own card; list it under 'rows'")
  rows = collect.read_rows(paths)
  return {card: [r for r in rows if r.get("device") == card] for card in collect.devices(rows)}


def device_name(device: str) -> str:
  """A rows' `device` as a heading names it: the card's name, or "CPU"."""
  return "CPU" if device == "cpu" else device


def plot_path(plot_stem: str, card: str) -> str:
  """The paired plot of `card`'s rows: the manifest's stem with the card's name appended."""
  return f"{plot_stem}_{card.replace('NVIDIA ', '').replace(' ', '_').lower()}.png"


def section(files: Sequence[Tuple[str, str, str]], page_device: str, plot_stem: str = "") -> str:
  """The section's markdown (without its heading) of `files`, (path, commit, command) each."""
  from experiments.bench import collect, quality_pairs, tables, targets
  paths = [path for path, _, _ in files]
  out = ["Quality runs on other cards or the CPU, judged by the rule of \"Quality\" and "
         "reported here apart from the targets above, which are the page's own card's:", ""]
  for card, rows in _by_card(paths, page_device).items():
    out += [f"### On the {device_name(card)}", "", quality_pairs.pairing_summary(rows), "",
            tables.quality_verdicts_table(targets.check_quality(rows)), ""]
    if plot_stem:
      name = os.path.basename(plot_path(plot_stem, card))
      out += [f"![Paired quality on the {device_name(card)}: each seed's change and the 95% "
              f"CI of their mean, +0.02% margin](results/{name})", ""]
    out += ["Arms by seed:", "", tables.quality_table(rows), ""]
  sources = []
  for path, commit, command in files:
    rows = collect.read_rows([path])
    # Quality rows carry no date: the file's name ends with it.
    dates = sorted({r["date"] for r in rows if r.get("date")}) or [
        os.path.basename(path).rsplit("_", 1)[-1].split(".")[0]]
    sources.append(f"`{os.path.basename(path)}`: {', '.join(collect.devices(rows))}, jax "
                   f"{', '.join(sorted({str(r.get('jax')) for r in rows}))}, "
                   f"{dates[0]}{'' if dates[-1] == dates[0] else ' to ' + dates[-1]}, commit "
                   f"{commit}, `{command}`")
  out.append("Rows: " + "; ".join(sources) + ".")
  return "\n".join(out)


def write_plots(paths: Sequence[str], page_device: str, plot_stem: str) -> List[str]:
  """The paired plot of each card's rows (`plot_path`); the paths written."""
  from experiments.bench import plots, targets
  written = []
  for card, rows in _by_card(paths, page_device).items():
    path = plots.paired_quality_plot(targets.check_quality(rows), plot_path(plot_stem, card))
    if path:
      written.append(path)
  return written


def missing_plots(paths: Sequence[str], page_device: str, plot_stem: str) -> List[str]:
  """The cards' plots that `write_plots` would write (a card with a paired verdict) and are
  not there."""
  from experiments.bench import targets
  return [plot_path(plot_stem, card) for card, rows in _by_card(paths, page_device).items()
          if any("changes" in v for v in targets.check_quality(rows))
          and not os.path.exists(plot_path(plot_stem, card))]
