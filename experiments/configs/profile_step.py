"""Settings of the step profile, `python3 -m experiments.profile_step --workdir=DIR`: device time
per GEMM site and pass, per kernel class, of whole train and inference steps.

  python3 -m experiments.profile_step --workdir=DIR/profile --config.target.preset=large \
      --config.variants.names=bf16,flax_fp8_delayed,loka --config.variants.plans_dir=DIR/plans

--workdir is a flag of the main, not a setting: where the profile, traces and HLO go.
"""
import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # What is profiled: a model at a preset, or an MLP tower.
  config.target = target = ml_collections.ConfigDict()
  target.model = "wukong"      # tower: dlrm, dcnv2, wukong, dhen, interformer
  target.preset = "tiny"       # model size: tiny, small or large
  target.tower = config_dict.placeholder(str)  # an MLP tower BxWIDTHxDEPTH instead of the model
  target.batch_size = 0        # batch; 0: the target's
  target.seed = 0              # parameters and the batch

  # The variants, built as the headline benchmark builds them (`experiments.bench`).
  config.variants = variants = ml_collections.ConfigDict()
  # Variants as in the bench, comma-separated (bf16 is always first).
  variants.names = "bf16,bf16_mods"
  # The Mods of the Mods arms, comma-separated, as the bench's targets.mods (LoKA's plan is
  # then read from that set's folder under plans_dir); empty: every Mod.
  variants.mods = ""
  # The LoKA variant's plans, laid out as the bench's; unset: WORKDIR/plans.
  variants.plans_dir = config_dict.placeholder(str)
  # Every variant on a state of its own model's parameters, as experiments.train runs it (the
  # bench's speed.own_states); False: on bf16's shared state, as the bench times them.
  variants.own_states = False

  # The profiler run.
  config.profile = profile = ml_collections.ConfigDict()
  profile.iterations = 5       # profiled steps per variant and mode
  # Keep XLA's CUDA-graph command buffers. Off by default: a kernel launched from a command
  # buffer names the buffer (`command_buffer_N`) as its HLO op, not its own instruction, so its
  # time cannot be split by site.
  profile.command_buffers = False

  # A saved profile.json: draw its plot (FILE.png beside it) and print its tables with this
  # version's layout; nothing is measured (any machine).
  config.render = config_dict.placeholder(str)
  return config
