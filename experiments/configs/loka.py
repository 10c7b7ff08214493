"""Settings of the main job, `python3 -m experiments.loka`: probe -> dispatch -> validate, then
bf16+Mods, the plan (Mods + plan) and naive FP8 trained side by side.

  python3 -m experiments.loka --config.run.preset=small --config.select.min_speedup=0

--workdir is a flag of the main (default ./loka_run), not a setting: the run directory.
"""

import ml_collections
from ml_collections import config_dict

from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The model, its data and the arms' training; every arm (and the probe) shares them.
  config.run = run = ml_collections.ConfigDict()
  run.model = "wukong"                       # tower: dlrm, dcnv2, wukong, dhen, interformer
  run.preset = config_dict.placeholder(str)  # tiny, small, large; unset: small on a GPU, else tiny
  run.data = "synthetic"                     # synthetic, movielens or criteo
  run.data_spec = config_dict.placeholder(str)   # JSON spec of the synthetic data
  run.data_path = config_dict.placeholder(str)   # input file or directory (criteo TSV)
  run.data_cache = config_dict.placeholder(str)  # cache directory of downloaded data (MovieLens)
  # Mods of every arm, comma-separated: no_bias, blocknorm, hard_swish or all; keep_bias:PATTERN
  # keeps No Bias's biases at the dense sites whose path matches the glob. Empty: all.
  run.mods = "all"
  run.seed = 0           # parameters, data order and held-out set, the same in every arm
  run.steps = 300        # training steps of each arm
  run.batch_size = 0     # training batch; 0: the preset's
  run.num_eval = 2048    # held-out examples; 0: the data source's default

  # The probe: a bf16+Mods training run that collects each site's statistics, then each
  # candidate kernel's error (and, on a GPU, its time) per site and pass.
  config.probe = probe = ml_collections.ConfigDict()
  probe.steps = 100      # training steps of the probe run
  probe.cadence = 25     # a statistics pass every this many steps
  # Steps between the probe run's checkpoints, which carry its statistics: a killed job
  # resumes its probe from the newest (0: only at the probe's end).
  probe.checkpoint_every = 0
  probe.samples = 8      # draws per site and source
  # Candidate kernels, comma-separated. Empty: on a CPU xla_bf16, xla_fp8_tensorwise and
  # xla_fp8_rowwise (their fast-accumulation twins compute the same there); on a GPU
  # xla_bf16, xla_fp8_rowwise and Flax's three delayed-scaling ops (experiments/loka.py).
  probe.kernels = ""
  probe.sites = config_dict.placeholder(str)  # regex: probe only these sites (others stay bf16)
  # Threads compiling the error evaluation of upcoming sites, and the statistics pass, ahead
  # (-1: the CPUs, up to 16; 0: compile each function on its first call).
  probe.compile_workers = -1
  # Compile every site's evaluation functions while the probe trains (on half those threads),
  # instead of site by site after it (unset: on a GPU, not on the CPU).
  probe.compile_evaluation_while_training = config_dict.placeholder(bool)

  # The selection of the plan from the probe report.
  config.select = select = ml_collections.ConfigDict()
  # Speed rule: unset, the default budget (1.05x when timings are known); <= 0, accuracy only
  # (what the error budget alone admits).
  select.min_speedup = config_dict.placeholder(float)

  # End-to-end validation of the plan, starting from the probe's trained state.
  config.validate = validate = ml_collections.ConfigDict()
  validate.enabled = True                          # False: the selected plan as it is
  validate.max_rel_logloss = NEUTRAL_REL_LOGLOSS   # held-out relative log-loss budget
  validate.shadow_steps = 200                      # shadow training steps (0: skip)
  # Training from a fresh initialization, plan vs bf16+Mods, with the probe's recipe (0: skip):
  # the other checks start from the probe's trained state and cannot see early training.
  validate.from_init_steps = 0
  validate.from_init_seeds = 1   # its seeds, both runs per seed; the verdict reads their mean

  # The arms trained after the plan: bf16+Mods and the plan always.
  config.arms = arms = ml_collections.ConfigDict()
  arms.naive_fp8 = True               # also the naive arm: arms.kernel at every site, same Mods
  arms.kernel = "xla_fp8_tensorwise"  # the naive arm's kernel

  # Persistent XLA compilation cache: unset, $JAX_COMPILATION_CACHE_DIR or
  # ~/.cache/loka_jax/jax_cache; '' turns it off. Reruns load executables instead of compiling.
  config.compilation_cache = config_dict.placeholder(str)
  return config
