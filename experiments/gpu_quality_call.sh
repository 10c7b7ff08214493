#!/bin/bash
# One GPU call of more paired quality seeds for the `large` models (synthetic data, 500 steps,
# 50-step warm-up: the recipe of the committed rows): every arm at each of SEEDS, namely bf16,
# bf16+Mods, naive FP8, Flax delayed scaling everywhere and, where a plan is given, LoKA under
# it. The rows append to $WORK/quality.jsonl, which starts from the carried file, else from the
# committed rows of these targets, so no run is repeated and each call goes on where the last
# one stopped. After each call copy $OUT/quality.jsonl to $CARRY/quality.jsonl; rerun until
# every model's log ends in "all selected rows are done", then commit the rows under
# docs/results/ and list them in the manifest (rows of a card other than the manifest's under
# its `quality_other_cards`, with the commit and this command).
#
#   CARRY=.snap/quality bash experiments/gpu_quality_call.sh   (the call carries .snap, .whl)
#
# Arguments go to the bench, after the call's own, as config overrides.
# Environment: CARRY (.snap/quality), MODELS (wukong,dhen,interformer; dlrm and dcnv2 too),
# SEEDS (0,1,2,3,4,5), PLAN_<MODEL> (the committed `large` plan; InterFormer has none, so its
# LoKA arm is left out: its plan ran xla_bf16 at every site, so its LoKA verdict is "not
# applicable" and needs no run), MODS (the Mods set of the Mods arms, e.g. no_bias,blocknorm:
# the bench's targets.mods; the plan goes to that set's own plans folder), LIMIT (540: hard
# seconds of the call), ARMS (the arms to run, in this order; by default the four references,
# and LoKA where a plan is given), MAXMIN (7.5), WORK (/tmp/qcall), OUT (set on the device;
# elsewhere $WORK/out); COOLDOWN (0: the steps over which both rates decay to 0 at the end, a
# recipe of its own); PRESET (large), STEPS (500), WARMUP (50) and EVAL (200000) for a CPU
# smoke run.
# A quality run of these targets took 17-360 s on an H200, compiles included, so a call
# finishes two to five of them.
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1
START=$(date +%s)
LIMIT=${LIMIT:-540}
CARRY=${CARRY:-.snap/quality}
WORK=${WORK:-/tmp/qcall}
OUT=${OUT:-$WORK/out}
PRESET=${PRESET:-large}
R=docs/results
if [ "$PRESET" = large ]; then   # the committed plans are of `large`
  PLAN_WUKONG=${PLAN_WUKONG-$R/plan_wukong_large_wgrad0_h200_2026-12-02.json}
  PLAN_DHEN=${PLAN_DHEN-$R/plan_dhen_large_h200_2026-11-28.json}
  PLAN_DLRM=${PLAN_DLRM-$R/plan_dlrm_large_h200_2026-11-28.json}
  PLAN_DCNV2=${PLAN_DCNV2-$R/plan_dcnv2_large_h200_2026-11-28.json}
fi
MODS=${MODS:-}
# The plans folder of the Mods set (`mods_set.plans_root`): the default set's is plans/ itself.
PLANS=$(python3 -c "import sys; from experiments.bench import mods_set as m
print(m.plans_root(sys.argv[1], m.of_flag([v for v in sys.argv[2].split(',') if v])))" \
  "$WORK/plans" "$MODS") || exit 1
mkdir -p "$WORK" "$OUT" "$CARRY"
# A warm host's rows are the newest; a fresh host takes the carried ones, or the committed.
if [ ! -f "$WORK/quality.jsonl" ]; then
  if [ -f "$CARRY/quality.jsonl" ]; then
    cp "$CARRY/quality.jsonl" "$WORK/quality.jsonl"
  elif [ "$PRESET" = large ]; then
    cat $R/quality_synthetic_wukong_large_wgrad0_seeds_h200_2026-12-03.jsonl \
      $R/quality_synthetic_dhen_large_h200_2026-11-28.jsonl \
      $R/quality_synthetic_dlrm_large_h200_2026-11-28.jsonl \
      $R/quality_synthetic_dlrm_large_no_bias_blocknorm_h200_2026-12-01.jsonl \
      $R/quality_synthetic_dcnv2_large_h200_2026-11-28.jsonl \
      $R/quality_synthetic_dcnv2_large_keep_bias_h200_2026-12-01.jsonl \
      $R/quality_synthetic_interformer_large_h200_2026-11-29.jsonl > "$WORK/quality.jsonl"
  fi
fi
echo "=== $(date +%T) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)," \
  "jax $(python3 -c 'import jax; print(jax.__version__)'), commit ${COMMIT:-unknown}" \
  | tee -a "$OUT/log.txt"

IFS=, read -r -a models <<< "${MODELS:-wukong,dhen,interformer}"
for model in "${models[@]}"; do
  var="PLAN_$(echo "$model" | tr a-z A-Z)"
  plan=${!var:-}
  arms=${ARMS:-bf16,bf16_mods,fp8_naive,fp8_delayed}
  if [ -n "$plan" ]; then
    mkdir -p "$PLANS/${model}_$PRESET"
    cp "$plan" "$PLANS/${model}_$PRESET/plan.json"
    [ -z "${ARMS:-}" ] && arms=$arms,loka
  fi
  left=$(( LIMIT - ($(date +%s) - START) - 10 ))
  if [ "$left" -lt 90 ]; then
    echo "$model: left for the next call ($left s left)" | tee -a "$OUT/log.txt"
    continue
  fi
  echo "--- $model ($arms), $left s left" >> "$OUT/log.txt"
  # Each model's process gets what the call has left: its pacing starts no run that would
  # not end by then (`pace.may_start`).
  LIMIT=$left timeout "$left" python3 -m experiments.bench \
    --config=experiments/configs/bench_quality.py --config.quality.data=synthetic \
    --config.quality.preset="$PRESET" --config.quality.steps="${STEPS:-500}" \
    --config.quality.eval="${EVAL:-200000}" \
    --config.quality.warmup_steps="${WARMUP:-50}" --config.quality.seeds="${SEEDS:-0,1,2,3,4,5}" \
    --config.quality.cooldown_steps="${COOLDOWN:-0}" \
    --config.quality.arms="$arms" --config.targets.models="$model" \
    ${MODS:+--config.targets.mods="$MODS"} \
    --config.probe.enabled=false --workdir="$WORK" --config.plans_dir="$WORK/plans" \
    --config.compile_cache=/tmp/jc \
    --config.pacing.max_minutes="$(LIMIT=$left max_minutes)" \
    --config.pacing.end_by_minutes="$(LIMIT=$left end_by_minutes)" "$@" >> "$OUT/log.txt" 2>&1
  echo "$model rc=$?" | tee -a "$OUT/log.txt"
done
cp "$WORK/quality.jsonl" "$OUT/quality.jsonl" 2>/dev/null
grep -v -e '^W[0-9]' -e '^I[0-9]' "$OUT/log.txt" | grep -e '^===' -e '^---' -e 'rc=' \
  -e 'held-out log loss [0-9n]' -e 'deadline' -e 'all selected' -e 'left for' -e '^error:' \
  | tail -40
