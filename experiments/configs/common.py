"""The settings groups several configs share."""
import ml_collections
from ml_collections import config_dict


def run_group() -> ml_collections.ConfigDict:
  """A tower run (the library's RunSpec): the tower, its data, the precision arm, the Mods,
  the length."""
  run = ml_collections.ConfigDict()
  run.model = "wukong"         # tower: dlrm, dcnv2, wukong, dhen, interformer
  run.preset = "tiny"          # model size: tiny, small or large
  run.data = "synthetic"       # synthetic, movielens or criteo
  run.data_spec = config_dict.placeholder(str)   # JSON spec of the synthetic data
  run.data_path = config_dict.placeholder(str)   # input file or directory (criteo TSV)
  run.data_cache = config_dict.placeholder(str)  # cache directory of downloaded data (MovieLens)
  # fp32 | bf16 | fp8_all (run.kernel at every site) | loka (the kernels of run.plan).
  run.precision = "bf16"
  run.kernel = "xla_fp8_tensorwise"          # the kernel of every site with fp8_all
  run.plan = config_dict.placeholder(str)    # plan JSON (loka.plan/1) for loka
  # Mods to turn on, comma-separated: no_bias, blocknorm, hard_swish (or all); keep_bias:PATTERN
  # keeps No Bias's biases at the dense sites whose path matches the glob (e.g.
  # keep_bias:cross_*; repeatable). Empty: none.
  run.mods = ""
  run.seed = 0                 # parameters, data order (and a probe's draws)
  run.steps = 200              # training steps
  run.batch_size = 0           # training batch; 0: the preset's
  run.num_eval = 0             # held-out examples; 0: the data source's default
  return run
