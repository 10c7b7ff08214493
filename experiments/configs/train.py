"""Settings of one training run, `python3 -m experiments.train --workdir=DIR`.

  python3 -m experiments.train --workdir=/tmp/wukong_fp8 --config.run.precision=fp8_all \
      --config.run.steps=500

--workdir is a flag of the main, not a setting: the run directory (rerunning resumes).
"""
import ml_collections
from ml_collections import config_dict

from experiments.configs import common
from loka_jax.train.optim import OptimConfig


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # What is trained: the tower, its data, the precision arm, the Mods, the length.
  config.run = run = common.run_group()
  run.id_policy = "error"  # out-of-vocabulary ids in the data: error, hash or clip

  # The training loop: evaluation, logging, checkpoints, non-finite steps.
  config.train = train = ml_collections.ConfigDict()
  train.eval_every = 0          # steps between held-out evals; 0: at the end
  train.eval_batch_size = 0     # eval batch; 0: the training batch
  train.log_every = 50          # steps between metrics lines
  train.checkpoint_every = 1000  # steps between checkpoints (always one at the end)
  train.keep_checkpoints = 3    # checkpoints kept (0: none is written; needs checkpoint_every=0)
  # On a non-finite loss or gradient: stop (keeping the last good checkpoint) or skip the step.
  train.nan_policy = "stop"
  train.progress = True         # progress bar on stderr (when a terminal)
  train.prefetch = 2            # batches made and put on the device ahead (0: in turn)
  # Processes making those batches: where a step is shorter than making a batch on one core
  # (DLRM and DCNv2 `large` on an H200). -1: started when the loop waits on the prefetch
  # thread, as many as the step needs (none on a CPU backend); 0: the thread alone.
  train.batch_workers = -1
  # Read a step's metrics after dispatching the next one, where nothing else needs the step
  # (not at eval, checkpoint or drift-valve steps): host and device overlap. Same numbers.
  train.run_ahead = True
  # Each module's gradient, parameter and update norms and its output's RMS with every
  # metrics line (with log_every=1: every step), to read a loss spike with
  # `experiments.report spikes`. Adds a forward to each step.
  train.module_norms = False
  # Deterministic GPU ops (--xla_gpu_deterministic_ops): a run repeats bit for bit, so a loss
  # spike can be run again and read. It slows the step a little.
  train.xla_deterministic = False
  # False: XLA gives every GEMM fusion to cuBLAS and autotunes no Triton GEMM configurations
  # (--xla_gpu_enable_triton_gemm=false). A plan's FP8 GEMMs then compile in a fraction of
  # the time (Wukong large's LoKA plan on an H200: 55 s to the first step instead of 124 s
  # on a cold cache) at some step speed (7.86 instead of 8.16 steps/s); see RESULTS.
  train.triton_gemm = True

  # The optimizers: Adam(W) on the dense towers, row-wise Adagrad on the embedding tables.
  config.optim = optim = ml_collections.ConfigDict()
  optim.lr = OptimConfig.learning_rate                     # Adam(W) learning rate
  optim.embedding_lr = OptimConfig.embedding_learning_rate  # Adagrad learning rate
  # Linear learning-rate warmup steps. The `large` presets want about 50 (without, their first
  # steps spike, in bf16 too); a run without prints a note.
  optim.warmup_steps = 0
  # A linear decay of both learning rates to 0 over the run's last this many steps (0: none).
  optim.cooldown_steps = 0
  optim.weight_decay = 0.0      # AdamW weight decay (dense towers)

  # The drift valve of a loka run: refresh the probe's statistics every `every` steps (less
  # often when refreshes would take more than 2% of the training time) and switch sites whose
  # statistics drifted and whose kernel is no longer safe.
  config.drift = drift = ml_collections.ConfigDict()
  drift.every = 0               # 0: off
  drift.max_overhead = 0.02     # refreshes' share of training time, at most (0: no budget)
  # Compile the statistics pass on background threads from the first step (a refresh due
  # earlier waits for it, training does not); false: the first refresh compiles it inline.
  drift.compile_ahead = True
  # The probe report the plan was selected on (unset: the one its provenance names): the
  # valve's baseline statistics and timings.
  drift.report = config_dict.placeholder(str)

  # Sharded training over a device mesh.
  config.parallel = parallel = ml_collections.ConfigDict()
  # The mesh, e.g. data:2,model:2 (dense towers data-parallel over every device, tables
  # row-sharded over model; multi-host from JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/
  # JAX_PROCESS_ID); unset: one device.
  parallel.mesh = config_dict.placeholder(str)
  # Payload of the gradient all-reduce and the embedding exchange: fp32, bf16, or fp8 (e4m3
  # with block scales, summed in fp32).
  parallel.collectives = "bf16"
  return config
