"""Settings of the headline benchmark, `python3 -m experiments.bench --workdir=DIR`: bf16 vs
the FP8 peers vs LoKA, speed (towers, models) and quality, resumable over several calls.

  python3 -m experiments.bench --config=experiments/configs/bench_towers.py --workdir=DIR \
      --config.targets.only=4096x256x8 --config.speed.variants=bf16,loka

This file holds the settings every suite shares, with the models suite; bench_towers.py,
bench_models.py and bench_quality.py start from it and set their suite. Lists are
comma-separated strings (an empty one: the default the field names). --workdir is a flag of
the main, not a setting: the results directory (rerunning resumes).
"""
import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # Which suite runs: towers or models (speed rows, WORKDIR/bench.jsonl), quality (trained
  # arms, WORKDIR/quality.jsonl) or all three.
  config.suite = "models"

  # What is measured, in every suite.
  config.targets = targets = ml_collections.ConfigDict()
  # Tower shapes BxWIDTHxDEPTH of the towers suite. Empty: the five (4096x256x8, 4096x512x8,
  # 8192x1024x8, 8192x2048x8, 16384x4096x4).
  targets.towers = ""
  targets.models = ""               # models of the models and quality suites; empty: all five
  targets.presets = "small,large"   # model presets of the models suite
  # Only these targets: 'model/preset', a model, a preset, a tower shape or (quality) a data
  # source. Empty: every target of the suite.
  targets.only = ""
  targets.batch_size = 0   # batch of every target and synthetic quality run; 0: its own
  # Seed of the timed models' parameters and data, and of the synthetic quality runs.
  targets.seed = 0
  # Mods of the Mods arms (bf16_mods, bf16_mods_served, loka; quality's bf16_mods and loka)
  # and of LoKA's probe, e.g. no_bias,blocknorm to see whether a plan holds without Hard
  # Swish; keep_bias:PATTERN keeps No Bias's biases at the dense sites whose path matches the
  # glob. Another set than all is its own subject: its rows carry `mods_set`, are compared
  # only with one another, and its plans live under PLANS/mods_<set>/. The quality arms
  # without Mods are the same runs in every set.
  targets.mods = "all"

  # The speed suites' timing: one row per (target, variant), bf16 timed interleaved beside it.
  config.speed = speed = ml_collections.ConfigDict()
  # Variants timed (all: every one; bf16 always runs): fp32, bf16, bf16_mods,
  # bf16_mods_served (inference from exported bf16 weights, as LoKA's), flax_fp8_delayed,
  # flax_fp8_delayed_fwd, flax_fp8_delayed_grad_lhs, fp8_tensorwise, fp8_rowwise, pallas,
  # pallas_delayed (the one-pass delayed ops), loka.
  speed.variants = "all"
  speed.repeats = 20     # timed repeats per variant (interleaved with bf16)
  # Steps shorter than this run N times in one jitted loop per timed call (N from the bf16
  # step, per mode), so host dispatch jitter is spread over N steps. Unset: 5 ms.
  speed.min_call_ms = config_dict.placeholder(float)
  # Train calls dispatched back to back in a timed sample, blocked on the last: the host's work
  # between steps overlaps the device's as in the training loop (1: every step blocked).
  speed.train_calls = 4
  # Every variant on a training state of its own model's parameters, as experiments.train
  # runs it (False: all thread bf16's state, so the largest presets fit one GPU, and a Mods
  # arm's step also takes the biases it drops). One more state on the device per variant,
  # which the largest presets may not fit (Wukong `large` on an H100: a variant that cannot
  # is refused before its state is made, its row an error). Every row but bf16's then reads
  # `shared_state: false`. A workdir's finished rows are kept whichever way they were timed:
  # switch it in a fresh workdir.
  speed.own_states = False
  # Variants also timed against bf16+Mods, served bf16+Mods and the best peer, in one
  # interleaving per pair (they run last in a target; the other arms stay alive until then).
  # Empty: targets use the ratio of rows only.
  speed.head_to_head = "loka"

  # The probe that makes a target's missing LoKA plan (WORKDIR/plans/<model>_<preset>/), and
  # the selection of the plan from its report.
  config.probe = probe = ml_collections.ConfigDict()
  probe.enabled = True   # probe targets whose plan is missing (False: their LoKA rows wait)
  probe.steps = 100      # training steps of each probe
  # Seed of the probe run, apart from targets.seed: quality runs at every seed share one plan
  # and resume one probe.
  probe.seed = 0
  probe.samples = 32     # draws per site of the error evaluation (fewer: faster, wider CIs)
  probe.kernels = ""     # candidate kernels; empty: every registered candidate
  # Timings measured ahead by `experiments.probe --config.timing.only=true` (a directory, e.g.
  # carried to the GPU host): the probes skip their timing phase where it holds the shapes.
  probe.timing_cache = config_dict.placeholder(str)
  # Threads compiling the error evaluation of upcoming sites, and the statistics pass, ahead
  # (-1: the CPUs, up to 16; 0: compile each function on its first call).
  probe.compile_workers = -1
  # Threads compiling one site shape's timed kernel programs before any is timed (1: each in
  # turn, just before its warm-up). Keep 1 on the GPU: each compile autotunes its GEMMs on the
  # device, and concurrent autotuning slows every kernel it times.
  probe.timing_compile_workers = 1
  # Site shapes whose forward product is below this many GFLOP are not timed and stay in bf16
  # (0: time every shape); a shape's timing is mostly compiles.
  probe.min_timing_gflops = 0.0
  # The selection's pessimistic-SQNR bar for FP8 weight gradients (unset: the input
  # gradients' 20 dB); a plan selected under another bar is selected again.
  probe.min_sqnr_wgrad_db = config_dict.placeholder(float)

  # Validation of a new plan (`ValidationConfig`, the field of the same name).
  config.validation = validation = ml_collections.ConfigDict()
  # Steps of the shadow check from the probe's state; 0 skips it, leaving the training
  # verdict to from_init_steps (for a probe's state on a loss plateau).
  validation.shadow_steps = 200
  validation.shadow_windows = 1   # data windows of the shadow check; it judges their mean
  # The shadow check also trains bf16+Mods from a jittered checkpoint in each window and
  # widens its bounds to two standard errors of that run's change.
  validation.shadow_noise_floor = False
  # Warm both learning rates up again over N steps after switching the probe's state to the
  # plan, in every shadow run (unset: none; for a probe state from early training).
  validation.shadow_warmup_steps = config_dict.placeholder(int)
  # Training from a fresh initialization, plan vs bf16+Mods, with the probe's recipe (0: skip).
  validation.from_init_steps = 0
  # That training's learning-rate warm-up steps (unset: the probe's recipe, none), e.g. the
  # quality runs' quality.warmup_steps, so the check trains as the model is trained.
  validation.from_init_warmup_steps = config_dict.placeholder(int)
  # That training's global-norm clipping of the dense gradients (unset: none), e.g.
  # quality.clip_norm.
  validation.from_init_clip_norm = config_dict.placeholder(float)
  # Seeds of that training, both runs per seed; the verdict reads their mean.
  validation.from_init_seeds = 1
  # That training also judges held-out log loss by the quality targets' rule (the plan
  # against bf16+Mods by seed, bound 0.02%): a missed verdict fails the round (one seed: a
  # change above the bound), not only a run that diverges; an unresolved one passes.
  validation.from_init_quality_bound = False
  # The held-out check measures a round's sites in one compiled program of switched sites
  # instead of one program per site.
  validation.held_out_one_program = False
  # The training checks rank a round's sites by gradient change in one compiled program
  # instead of one gradient program per site.
  validation.gradient_one_program = False
  # Kernels the speed promotion proposes per kernel sort (per-pass kernels, fused ops), each
  # timed in the whole step.
  validation.promotion_per_sort = 1
  # A training check's round whose back-off took back less than this fraction of each
  # diverged loss's excess steps down every FP8 gradient pass at once (0: one site a round).
  validation.stalled_fraction = 0.1

  # The quality suite: held-out NE, log loss and AUC of each arm and seed after fixed steps.
  config.quality = quality = ml_collections.ConfigDict()
  quality.data = "synthetic,movielens"   # synthetic (every targets.models) and/or movielens
  # Arms trained: bf16, bf16_mods, fp8_naive, fp8_delayed, loka; also, when named,
  # fp8_naive_mods (naive FP8 with the Mods: bf16+Mods' architecture, so its change is FP8's
  # alone) and loka_accuracy (LoKA's plan under the error budget alone, the speed rule off:
  # its own probe and plan under plans/accuracy_only).
  quality.arms = "bf16,bf16_mods,fp8_naive,fp8_delayed,loka"
  quality.preset = "small"    # preset of the synthetic runs
  quality.steps = 500         # training steps of every synthetic arm
  quality.eval = 200_000      # held-out examples of the synthetic runs (at least)
  # Linear warm-up of both learning rates in the synthetic runs (0: none). Rows of each
  # recipe are compared only with rows of the same one.
  quality.warmup_steps = 0
  # Global-norm clipping of the dense gradients in the synthetic runs (unset: none); a recipe
  # of its own, like the warm-up.
  quality.clip_norm = config_dict.placeholder(float)
  # A linear decay of both learning rates to 0 over the last this many steps of the synthetic
  # runs (0: none): a recipe of its own, like the warm-up; its last iterate is settled.
  quality.cooldown_steps = 0
  # bf16 alone at these seeds beside targets.seed, when quality.seeds is empty (unpaired:
  # the quality verdicts pair arms by seed and judge none of these).
  quality.noise_seeds = "1,2"
  # Every arm at each of these seeds, in place of targets.seed and the bf16 noise seeds: the
  # paired seeds the quality verdicts need (at least 2). Empty: targets.seed and noise_seeds.
  quality.seeds = "0,1,2"
  # Deterministic GPU ops (--xla_gpu_deterministic_ops): a run repeats bit for bit, so a loss
  # spike can be run again and read. Quality suite only, since it slows the steps; rows
  # record it.
  quality.xla_deterministic = False
  # The MovieLens runs (quality.data holding movielens).
  quality.movielens = movielens = ml_collections.ConfigDict()
  movielens.models = "wukong,interformer"   # models trained on MovieLens
  movielens.preset = "tiny"     # their preset
  movielens.steps = 600         # training steps
  movielens.batch_size = 256    # training batch
  movielens.seeds = 5           # seeds per arm (0 .. seeds-1)
  movielens.cooldown_steps = 0  # as quality.cooldown_steps, for the MovieLens runs
  movielens.data_cache = config_dict.placeholder(str)  # cache directory of the downloaded data

  # LoKA's inference in the speed suites.
  config.serving = serving = ml_collections.ConfigDict()
  # Serve the export of a serving plan (per site the fastest eligible forward judged on the
  # forward alone, selected from the same probe report; plans/<target>/plan_serve.json)
  # instead of the training plan's.
  serving.plan = False
  # When the serving plan is first selected: time the export of its serving proposal (more
  # forwards in FP8, judged on accuracy alone) against it and keep the faster. auto: on a GPU
  # only; on; off.
  serving.promotion = "auto"
  # Before a serving plan is first written: score the serving proposal, the selected serving
  # plan and the training plan served from their exports on the probe's trained parameters
  # against served bf16+Mods, and serve the first within serving.quality_budget
  # (plans/<target>/serve_quality.json).
  serving.quality_gate = True
  # That gate's budget: relative held-out log-loss change against served bf16+Mods (unset:
  # the 0.02% quality budget).
  serving.quality_budget = config_dict.placeholder(float)

  # When rows start inside a call of fixed length (`experiments.bench.pace`).
  config.pacing = pacing = ml_collections.ConfigDict()
  pacing.max_minutes = 6.5   # no new row starts after this long (unless end_by_minutes says)
  # The call's hard end, in minutes from its start (e.g. a GPU call's limit less its upload).
  # A quality run then starts whenever it is expected to end by it (the longest run recorded
  # for its arm, else its model, with a margin), also past max_minutes, and a speed row the
  # same way (the longest row of its variant, else of its target; a head-to-head row only
  # before max_minutes); before the first is recorded max_minutes rules. Unset: none.
  pacing.end_by_minutes = config_dict.placeholder(float)

  # Persistent XLA compilation cache (unset: WORKDIR/jax_cache).
  config.compile_cache = config_dict.placeholder(str)
  # The targets' LoKA plans (unset: WORKDIR/plans).
  config.plans_dir = config_dict.placeholder(str)
  return config
