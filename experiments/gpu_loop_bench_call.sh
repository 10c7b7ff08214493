#!/bin/bash
# One GPU call comparing the training loop a user runs with the bench's step, in the same call:
# for each model of MODELS at PRESET, the bench's timed training step of bf16+Mods and (where a
# plan is given) LoKA, then `experiments.train` of the same arms for STEPS steps on the bench's
# warm compilation cache, then one JSON row per arm (kind loop_vs_bench: the bench's step as
# steps/s, the loop's 25-step windows after the first, their ratio, and LoKA's speedup over
# bf16+Mods in both) appended to $OUT/loop_vs_bench.jsonl and printed as a table.
#
#   bash experiments/gpu_loop_bench_call.sh        (the device call carries .whl)
#
# Environment: MODELS (wukong; several by commas or spaces), PRESET (large), STEPS (150),
# PLAN_<MODEL> (a plan file; the defaults are the committed large plans of wukong, dlrm, dcnv2
# and dhen; empty: no LoKA arm) and REPORT_<MODEL> (the probe report it was selected on, which
# the bench's LoKA arm reads to calibrate its exported model; defaults: the committed wukong,
# dcnv2 and dhen large reports; without one the LoKA arm is left out), BATCH_WORKERS (the loop's
# batch-making processes; -1, the default: as many as the step needs), ARM_LIMIT (seconds per
# loop arm, 240), MAXMIN (3: the bench's minutes per model; on an H100 DHEN and InterFormer
# `large` compile their bf16 step alone in 97 and 133 s, so give them 5: a bench that measured
# nothing leaves the model's loop arms out), OWN_STATES (1: the bench times each arm on a
# state of its own model's parameters, as the loop runs it, `speed.own_states`; default 0:
# on bf16's shared state; Wukong `large` needs an H200 for it: two of its states exceed what
# JAX takes of an H100, and the bench refuses the second), COMMIT (recorded in the rows), WORK
# (/tmp/loop_bench), OUT (set on the device; elsewhere $WORK/out). An arm the bench did not
# time (its row an error, or no row) gets no loop.
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
R=docs/results
WORK=${WORK:-/tmp/loop_bench}
OUT=${OUT:-$WORK/out}
PRESET=${PRESET:-large}
MODELS=${MODELS:-wukong}
STEPS=${STEPS:-150}
case ${OWN_STATES:-0} in
  0|1) ;;
  *) echo "error: OWN_STATES=${OWN_STATES}: use 1 (each arm on its own state) or 0"; exit 2 ;;
esac
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu)
echo "card: $CARD jax $(python3 -c 'import jax; print(jax.__version__)') $PRESET"
default_plan() {
  case $1 in
    wukong) echo "$R/plan_wukong_large_wgrad0_h200_2026-12-02.json" ;;
    dlrm) echo "$R/plan_dlrm_large_h200_2026-11-28.json" ;;
    dcnv2) echo "$R/plan_dcnv2_large_h200_2026-11-28.json" ;;
    dhen) echo "$R/plan_dhen_large_h200_2026-11-28.json" ;;
  esac
}
default_report() {  # the probe report a committed large plan was selected on, where committed
  case $1 in
    wukong) echo "$R/probe_report_wukong_large_h200_2026-11-27.json.gz" ;;
    dcnv2) echo "$R/probe_report_dcnv2_large_h200_2026-11-28.json.gz" ;;
    dhen) echo "$R/probe_report_dhen_large_h200_2026-11-28.json.gz" ;;
  esac
}
for MODEL in ${MODELS//,/ }; do
  var="PLAN_${MODEL^^}"
  PLAN=${!var-$( [ "$PRESET" = large ] && default_plan "$MODEL")}
  rvar="REPORT_${MODEL^^}"
  REPORT=${!rvar-$( [ "$PRESET" = large ] && default_report "$MODEL")}
  variants=bf16_mods
  rm -rf "$WORK/$MODEL"
  if [ -n "$PLAN" ] && [ -z "$REPORT" ]; then
    echo "$MODEL: no probe report for $PLAN (the bench's LoKA arm calibrates its exported" \
      "model with it; set $rvar): LoKA left out"
  elif [ -n "$PLAN" ]; then
    mkdir -p "$WORK/$MODEL/plans/${MODEL}_$PRESET"
    cp "$PLAN" "$WORK/$MODEL/plans/${MODEL}_$PRESET/plan.json"
    cp "$REPORT" "$WORK/$MODEL/plans/${MODEL}_$PRESET/probe_report.json"
    variants=bf16_mods,loka
  fi
  python3 -m experiments.bench --config=experiments/configs/bench_models.py \
    --config.targets.models="$MODEL" --config.targets.presets="$PRESET" \
    --config.speed.variants="$variants" --config.speed.head_to_head= \
    --config.probe.enabled=false --workdir="$WORK/$MODEL/bench" \
    --config.plans_dir="$WORK/$MODEL/plans" --config.pacing.max_minutes="${MAXMIN:-3}" \
    --config.speed.own_states="$( [ "${OWN_STATES:-0}" = 1 ] && echo true || echo false )" \
    > "$OUT/${MODEL}_bench.log" 2>&1
  echo "$MODEL bench rc=$?"
  if [ ! -s "$WORK/$MODEL/bench/bench.jsonl" ]; then
    echo "$MODEL: the bench timed no step within MAXMIN=${MAXMIN:-3} minutes (its log:" \
      "${MODEL}_bench.log): loop arms left out; raise MAXMIN"
    continue
  fi
  # Only the arms the bench timed get a loop: one it did not time (its row an error, e.g. an
  # own state that cannot fit the card, or no row) has nothing to compare with.
  timed=$(python3 -c 'import sys
from experiments.tools import loop_rows
print(",".join(loop_rows.timed_arms(sys.argv[1])))' "$WORK/$MODEL/bench/bench.jsonl")
  for arm in ${variants//,/ }; do
    case ",$timed," in
      *",$arm,"*) ;;
      *) echo "$MODEL loop $arm: left out, the bench timed no step of it (see" \
           "${MODEL}_bench.log)"; continue ;;
    esac
    args=(--config.run.precision=bf16)
    [ "$arm" = loka ] && args=(--config.run.precision=loka --config.run.plan="$PLAN")
    train_run "$WORK/$MODEL/loop_$arm" "$OUT/${MODEL}_loop_$arm.log" "${args[@]}"
    echo "$MODEL loop $arm rc=$?"
  done
  python3 -m experiments.report loop_vs_bench --bench="$WORK/$MODEL/bench/bench.jsonl" \
    --loops="$WORK/$MODEL/loop_bf16_mods,$WORK/$MODEL/loop_loka" --plan="$PLAN" \
    --command="MODELS=$MODEL PRESET=$PRESET STEPS=$STEPS MAXMIN=${MAXMIN:-3} BATCH_WORKERS=${BATCH_WORKERS:--1} ARM_LIMIT=${ARM_LIMIT:-240}${OWN_STATES:+ OWN_STATES=$OWN_STATES} bash experiments/gpu_loop_bench_call.sh" \
    --commit="${COMMIT:-unknown}" --out="$OUT/loop_vs_bench.jsonl"
done
