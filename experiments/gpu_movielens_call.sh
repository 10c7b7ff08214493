#!/bin/bash
# One GPU call of the MovieLens-100K quality runs: for each model of MODELS at `tiny`, a LoKA
# plan probed, selected and validated on MovieLens on this GPU (its kernel timings measured
# here), then bf16, bf16+Mods, naive FP8, Flax delayed scaling everywhere and LoKA at each of
# SEEDS seeds, paired by seed. The host reaches no network, so the data's cache (the recbole
# wheel that ships MovieLens-100K, and its parsed arrays) is carried; fetch it once here:
#
#   python3 -c "from loka_jax.data import movielens; movielens.MovieLensSource(data_cache='.snap/movielens')"
#   CARRY=.snap/mlq bash experiments/gpu_movielens_call.sh   (the call carries .snap, .whl)
#
# Rows append to $WORK/quality.jsonl and plans live under $WORK/plans, both started from
# $CARRY, so no run or probe is repeated and each call goes on where the last stopped. Every
# probe keeps its kernel timings in one cache, $WORK/plans/timing_cache, which the archive
# carries: the committed table a probe updates on the host is replaced by this tree's on the
# next call, so without it a model's second probe (loka_accuracy's) would time again what its
# first measured in an earlier call. After each call copy $OUT/quality.jsonl and
# $OUT/plans.tar.gz to $CARRY, and commit the card's timings of the cache into its table
# (`python3 -m experiments.timing_cache table` on plans/timing_cache/*.json of the archive):
# the table travels with the tree, so a CARRY lost between calls costs the runs and probes,
# not the kernel timings, which are most of a probe's GPU time here. Rerun until the log
# ends in "all selected rows are done", then commit the rows and each model's plan.json and
# probe_report.json (in plans.tar.gz) under docs/results/: rows of a card other than the
# manifest's go under its `quality_other_cards`, with the commit and this command. A model
# whose plan is committed runs on it without a probe: put the plan in CARRY as
# plans/movielens/MODEL_tiny/plan.json (and the rows it pairs with as quality.jsonl).
#
# Environment: CARRY (.snap/mlq), DATA (.snap/movielens: the data cache), MODELS
# (dlrm,dcnv2,dhen,wukong,interformer), SEEDS (5: seeds 0..4), STEPS (600), LIMIT (540: hard
# seconds of the call), MAXMIN (7.5), KERNELS (the probes' candidates: by default the main
# job's GPU list, the kernels validated plans select; empty: every registered candidate, whose
# timing at one `tiny` shape alone takes minutes of compiles), WORK (/tmp/mlcall), OUT (set on
# the device; elsewhere $WORK/out), ARMS (the quality arms, in order; by default the bench's,
# and fp8_naive_mods or loka_accuracy, LoKA under the error budget alone with a probe of its
# own, may be added), COOLDOWN (0: the steps over which both rates decay to 0 at the end, a
# recipe of its own), COMMIT (recorded in the log).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-540}
KERNELS=${KERNELS-$(python3 -c "from experiments.loka import GPU_KERNELS; print(','.join(GPU_KERNELS))")}
CARRY=${CARRY:-.snap/mlq}
DATA=${DATA:-.snap/movielens}
WORK=${WORK:-/tmp/mlcall}
OUT=${OUT:-$WORK/out}
if ! ls "$DATA"/recbole-*.whl > /dev/null 2>&1; then
  echo "error: $DATA holds no recbole wheel; fetch the data cache first (see the head of $0)"
  exit 1
fi
mkdir -p "$WORK" "$OUT"
# A warm host's rows and plans are the newest; a fresh host takes the carried ones.
if [ ! -f "$WORK/quality.jsonl" ] && [ -d "$CARRY" ]; then
  cp -r "$CARRY/." "$WORK/"
  [ -f "$WORK/plans.tar.gz" ] && tar -xzf "$WORK/plans.tar.gz" -C "$WORK"
fi
echo "=== $(date +%T) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)," \
  "jax $(python3 -c 'import jax; print(jax.__version__)'), commit ${COMMIT:-unknown}" \
  | tee -a "$OUT/log.txt"
timeout "$LIMIT" python3 -m experiments.bench \
  --config=experiments/configs/bench_quality.py --config.quality.data=movielens \
  --config.quality.movielens.models="${MODELS:-dlrm,dcnv2,dhen,wukong,interformer}" \
  --config.quality.movielens.seeds="${SEEDS:-5}" \
  ${ARMS:+--config.quality.arms="$ARMS"} \
  --config.quality.movielens.steps="${STEPS:-600}" \
  --config.quality.movielens.cooldown_steps="${COOLDOWN:-0}" \
  --config.quality.movielens.data_cache="$DATA" --config.probe.kernels="$KERNELS" \
  --workdir="$WORK" --config.plans_dir="$WORK/plans" --config.compile_cache=/tmp/jc \
  --config.probe.timing_cache="$WORK/plans/timing_cache" \
  --config.pacing.max_minutes="$(max_minutes)" \
  --config.pacing.end_by_minutes="$(end_by_minutes)" >> "$OUT/log.txt" 2>&1
echo "rc=$?" | tee -a "$OUT/log.txt"
cp "$WORK/quality.jsonl" "$OUT/quality.jsonl" 2>/dev/null
# The plans, probe reports and validation records as one archive (a call brings back files
# at most two folders under $OUT, and a plan's files lie deeper), without the probes'
# checkpoints (a probe killed midway starts again; at `tiny` it takes about a minute).
[ -d "$WORK/plans" ] && tar -czf "$OUT/plans.tar.gz" -C "$WORK" --exclude=checkpoints \
  --exclude='*.orbax-checkpoint-tmp*' plans
grep -v -e '^W[0-9]' -e '^I[0-9]' "$OUT/log.txt" | grep -e '^===' -e 'rc=' -e 'probing' \
  -e 'plan:' -e 'held-out log loss [0-9n]' -e 'deadline' -e 'all selected' | tail -40
