"""Figures drawn straight to files, on matplotlib's object API without pyplot.

No global backend is chosen or changed, so a notebook's own plots keep theirs, and nothing
pays pyplot's import (about a quarter of a second, which every entry point would pay) until
a figure is drawn.
"""
from __future__ import annotations


def subplots(nrows: int = 1, ncols: int = 1, *, figsize=None, **kwargs):
  """(figure, axes) as `pyplot.subplots` returns them, on a Figure no pyplot state holds:
  `fig.savefig` writes it (PNG through Agg), and it is freed with its last reference."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=figsize)
  return fig, fig.subplots(nrows, ncols, **kwargs)
