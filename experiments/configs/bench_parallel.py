"""Settings of the sharded-training benchmark, `python3 -m experiments.bench_parallel
--workdir=DIR`: step time, scaling efficiency and loss on 1 and N devices, with bf16 or FP8
collectives.

  python3 -m experiments.bench_parallel --workdir=DIR --config.run.presets=small,large \
      --config.parallel.devices=1,2 --config.parallel.collective_modes=bf16,fp8

--workdir is a flag of the main, not a setting: the directory of parallel.jsonl (a rerun skips
finished rows).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # What is trained: the tower, its presets, the precision arm and the Mods.
  config.run = run = ml_collections.ConfigDict()
  run.model = "wukong"          # tower: dlrm, dcnv2, wukong, dhen, interformer
  run.presets = "small"         # comma-separated presets, each a speed row and loss rows
  run.precision = "bf16"        # fp32 | bf16 | fp8_all (run.kernel at every site) | loka
  run.kernel = "xla_fp8_tensorwise"  # the kernel of every site with fp8_all
  run.seed = 0                  # parameters and data order
  # Comma-separated Mods: no_bias, blocknorm, hard_swish (or all); keep_bias:PATTERN keeps
  # No Bias's biases at the dense sites whose path matches the glob.
  run.mods = ""
  # Precision loka: the plan of each preset, comma-separated PRESET:PLAN_FILE pairs.
  run.plans = ""

  # The variants: device counts, collectives, table sharding and batch.
  config.parallel = parallel = ml_collections.ConfigDict()
  parallel.devices = "1,2"      # comma-separated device counts (1: the plain step)
  # Comma-separated payloads of the sharded variants' collectives: fp32, bf16, fp8.
  parallel.collective_modes = "bf16,fp8"
  # Tables row-sharded over every device ('all': data:1,model:n, rows padded to a multiple
  # of n) or replicated ('1': data:n,model:1).
  parallel.model_axis = "1"
  # weak: n devices train on n x batch_size examples per step; strong: every variant uses
  # the same global batch.
  parallel.scaling = "weak"
  parallel.batch_size = 0       # batch of one device; 0: the preset's

  # The speed rows.
  config.speed = speed = ml_collections.ConfigDict()
  speed.repeats = 20            # timed repeats per variant (interleaved)
  # Comma-separated presets timed one variant at a time: their states do not fit side by side.
  speed.sequential = "large"

  # The loss rows.
  config.loss = loss = ml_collections.ConfigDict()
  loss.steps = 100              # training steps of every loss row

  # What one invocation runs, for how long, and where compiled programs are kept.
  config.limits = limits = ml_collections.ConfigDict()
  limits.only = ""              # comma-separated presets or variants to run; empty: all
  limits.max_minutes = 8.0      # start no new row after this many minutes (0: no limit)
  # Persistent compilation cache directory, outside --workdir (only results go there).
  limits.compile_cache = "/tmp/jc"
  return config
