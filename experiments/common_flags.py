"""The common flags of the absl scripts under experiments/ (docs/FORMATS.md), defined once.

A script imports this module for its flags; the library defines none, so importing loka_jax
adds nothing to a program's command line.
"""
from __future__ import annotations

from absl import flags

MODELS = ("dlrm", "dcnv2", "wukong", "dhen", "interformer")
PRECISIONS = ("fp32", "bf16", "fp8_all", "loka")

MODEL = flags.DEFINE_enum("model", "wukong", MODELS, "Recommendation tower to build.")
PRESET = flags.DEFINE_enum("preset", "tiny", ("tiny", "small", "large"), "Model size preset.")
DATA = flags.DEFINE_enum("data", "synthetic", ("synthetic", "movielens", "criteo"), "Data source.")
DATA_SPEC = flags.DEFINE_string("data_spec", None, "JSON spec of the synthetic data (optional).")
DATA_PATH = flags.DEFINE_string("data_path", None, "Input file or directory (criteo TSV).")
DATA_CACHE = flags.DEFINE_string("data_cache", None,
                                 "Cache directory for downloaded data (MovieLens wheel).")
WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: metrics, checkpoints, reports.")
SEED = flags.DEFINE_integer("seed", 0, "Random seed (parameters and data order).")
STEPS = flags.DEFINE_integer("steps", 200, "Training steps.")
PRECISION = flags.DEFINE_enum("precision", "bf16", PRECISIONS,
                              "fp32 | bf16 | fp8_all (one FP8 kernel everywhere) | loka (plan).")
KERNEL = flags.DEFINE_string("kernel", "xla_fp8_tensorwise",
                             "Kernel used at every site with --precision=fp8_all.")
PLAN = flags.DEFINE_string("plan", None, "Plan JSON (loka.plan/1) for --precision=loka.")
MODS = flags.DEFINE_list("mods", [], "Mods to turn on: no_bias, blocknorm, hard_swish (or 'all'); "
                        "keep_bias:PATTERN keeps No Bias's biases at the dense sites whose "
                        "path matches the glob (e.g. keep_bias:cross_*; repeatable).")


def reference_run(num_eval: int, batch_size: int):
  """(RunSpec, TrainConfig) of the bf16 model (with --mods) the measurement scripts train
  for --steps and read FP8 against (`experiments.measure held_out_sites`, `shadow_arms`)."""
  from loka_jax.train import TrainConfig, experiment
  spec = experiment.RunSpec(model=MODEL.value, preset=PRESET.value, data=DATA.value,
                            data_spec=DATA_SPEC.value, data_path=DATA_PATH.value,
                            data_cache=DATA_CACHE.value, mods=experiment.parse_mods(MODS.value),
                            seed=SEED.value, num_eval=num_eval)
  config = TrainConfig(steps=STEPS.value, seed=SEED.value, batch_size=batch_size,
                       progress=False, log_every=max(1, STEPS.value // 10))  # its progress
  return spec, config

