"""What the probe evaluates and times, and how: the options of every probe entry point."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

from loka_jax.probe import timing_table as tables_lib
from loka_jax.probe import eligibility, kernel_timing


class ProbeSetupError(ValueError):
  """Options that select nothing or do not fit the run."""


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
  """What to evaluate and time, and how (the probe's statistics settings: ProbeConfig)."""
  samples: int = 100                       # Gaussian draws per site
  reservoir_samples: Optional[int] = None  # reservoir draws per site (None: samples)
  kernels: Tuple[str, ...] = ()            # candidates (empty: the default list)
  time: Optional[bool] = None              # time kernels here (None: only on a GPU)
  repeats: int = 20                        # timing repeats (benchmark protocol: >= 20)
  timing_cache: Optional[str] = None       # directory (None: WORKDIR/timing_cache)
  timing_table: Optional[str] = None       # fallback table, path or device kind (untimed runs)
  write_table: Optional[bool] = None       # merge GPU timings into the committed table
  table_dir: str = tables_lib.TIMINGS_DIR
  max_eval_elements: int = 1 << 22         # per operand and sample; beyond: row subsampling
  chunk_elements: int = 1 << 26            # vmapped operand elements at once
  bootstrap: int = 1000                    # bootstrap resamples of every CI
  plots: bool = True
  site_plots: bool = True
  sites: Optional[str] = None              # regex (re.search): probe only these sites
  # Asked before each site's evaluation and each shape's timing, with the expected seconds of
  # that work (the longest of its kind so far in this call); True leaves it pending for a
  # rerun, which resumes from the caches. The caller decides what "out of time" means.
  should_stop: Optional[Callable[[float], bool]] = None
  compile_workers: Optional[int] = None    # threads compiling evaluation ahead (None: CPUs
                                           # up to 16; 0: compile on first call, in turn)
  # Start compiling every site's evaluation functions while the probe trains, on half the
  # compile threads, so the evaluation phase finds them compiled (a fresh probe only: its
  # evaluation cache is empty, so every candidate is evaluated). None: on where the probe
  # trains on a GPU, whose host cores sit idle during the steps (the main job at Wukong
  # `small` on an H100 reached its selected plan at 152 s with it, 178 s without); off on
  # the CPU, where the compiles would take the training's cores.
  compile_evaluation_while_training: Optional[bool] = None
  timing_compile_workers: int = 1          # threads compiling a shape's timed programs
                                           # before they are timed (1: each in turn)
  # Shapes whose forward product is below this many GFLOP are not timed (0: every shape is):
  # their passes get `timing: "skipped"`, no speedup, so selection keeps them in bf16. A
  # shape's timing is mostly compiles (about 100 s a shape at DHEN large on the H200), and
  # across the H200 table's 140 shape-pass groups below 5 GFLOP no FP8 kernel reached 1.05x
  # but one (a 4096x1 output's grad_lhs).
  min_timing_gflops: float = 0.0
  # Time every candidate pass of every shape. By default a GPU probe times only what can
  # change the plan (`timing_needs`): passes some site of the shape admits on accuracy under
  # `criteria`, not dominated on this card, and not already in this card's committed table.
  time_all: bool = False
  criteria: eligibility.Criteria = eligibility.Criteria()
  seed: int = 0


def timing_plan(options: ProbeOptions) -> Tuple[bool, bool]:
  """(measure here, timings valid for dispatch)."""
  on_gpu = kernel_timing.on_gpu()
  measure = on_gpu if options.time is None else options.time
  return measure, measure and on_gpu
