"""Settings of the probe, `python3 -m experiments.probe --workdir=DIR`: train (or resume) with
the statistics pass, evaluate and time every candidate kernel on every GEMM site, write the
ProbeReport.

  python3 -m experiments.probe --workdir=/tmp/wk_probe --config.run.preset=small \
      --config.run.steps=200

--workdir is a flag of the main, not a setting: the run directory (rerunning resumes).
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import common


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The probed run: the tower, its data and the training the statistics pass rides on.
  config.run = run = common.run_group()
  run.checkpoint_every = 100   # steps between checkpoints (the probe's statistics ride along)

  # The statistics pass (ProbeConfig): what it keeps of each site's operands.
  config.stats = stats = ml_collections.ConfigDict()
  stats.cadence = 25               # a statistics pass every this many training steps
  stats.min_observations = 2       # observations made after training when fewer exist
  stats.max_full_width = 2048      # full covariance up to this width; above: diagonal + low rank
  stats.rank = 32                  # low-rank eigenpairs kept above max_full_width
  stats.weight_ema = 0.1           # EMA rate of the matrix-normal fit; 0: running mean
  stats.reservoir_elements = 1 << 20   # elements per operand of a site's reservoir

  # The error evaluation: each candidate kernel on draws from each site's statistics.
  config.evaluate = evaluate = ml_collections.ConfigDict()
  evaluate.samples = 100            # draws per site from the learned distributions
  evaluate.reservoir_samples = -1   # draws per site from the reservoir; -1: evaluate.samples
  # Candidate kernels, comma-separated. Empty: the default list (on a CPU without Pallas).
  evaluate.kernels = ""
  evaluate.sites = config_dict.placeholder(str)  # regex: evaluate only the matching sites
  # Elements per operand and sample; larger operands are row-subsampled (the report says so).
  evaluate.max_eval_elements = 1 << 22
  # Threads compiling the error evaluation of upcoming sites, and the statistics pass, ahead
  # (-1: the CPUs, up to 16; 0: compile each function on its first call).
  evaluate.compile_workers = -1
  # Compile every site's evaluation functions while the probe trains (on half those threads),
  # instead of site by site after it (unset: on a GPU, not on the CPU).
  evaluate.compile_while_training = config_dict.placeholder(bool)

  # Kernel timing: each candidate's time per distinct site shape and pass.
  config.timing = timing = ml_collections.ConfigDict()
  timing.time = "auto"     # time kernels here: auto (on a GPU only), on or off
  timing.repeats = 20      # timed repeats per kernel and pass
  timing.cache = config_dict.placeholder(str)  # timing cache directory; unset: WORKDIR/timing_cache
  # The committed table an untimed run falls back on (device kind or path); unset: the one
  # with the most entries.
  timing.table = config_dict.placeholder(str)
  # Merge the timings into loka_jax/probe/timings/<device>.json: auto (on a GPU), on or off.
  timing.write_table = "auto"
  # Threads compiling one shape's timed programs before any is timed (1: each in turn, just
  # before its warm-up). Keep 1 on a GPU: each compile autotunes its GEMMs on the device, and
  # with 8 workers on an H200 the autotuner timed out and every kernel read slower.
  timing.compile_workers = 1
  # Shapes whose forward product is below this many GFLOP are not timed and stay bf16 in
  # selection (0: time every shape); a shape's timing is mostly compiles.
  timing.min_gflops = 0.0
  # True: only time every candidate on every distinct site shape into timing.cache (no
  # training, no statistics, no report), so a later probe given that cache skips its timing.
  timing.only = False

  # Eligibility: the budget the report's per-site verdicts are read under.
  config.select = select = ml_collections.ConfigDict()
  select.metric = "sqnr"       # sqnr (pessimistic SQNR bars) or mere (MERE < 0.2, paper parity)
  select.min_speedup = 1.05    # pessimistic speedup a kernel needs; 0: accuracy only

  # The report's plots.
  config.plots = plots = ml_collections.ConfigDict()
  plots.enabled = True         # write PNG plots
  plots.sites = True           # one distribution plot per site

  # True: only print what the probe will hold (sites, distinct GEMM shapes, training state and
  # statistics bytes: its checkpoint), from abstract shapes: no training, no GPU needed.
  config.describe = False
  # Wall-clock budget in seconds (0: none): work that would end past it is left pending, the
  # run exits with status 3, and rerunning finishes it.
  config.budget_s = 0.0
  # Persistent XLA compilation cache: unset, $JAX_COMPILATION_CACHE_DIR or
  # ~/.cache/loka_jax/jax_cache; '' turns it off. Reruns load executables instead of compiling.
  config.compilation_cache = config_dict.placeholder(str)
  return config
