#!/bin/bash
# One GPU call measuring what the drift valve costs a user's training run: for each entry of
# VARIANTS, `experiments.train` of a LoKA plan with `--config.drift.every` (the valve refreshes
# the plan's statistics at cadence points until it has timed two refreshes, then as far apart
# as its overhead budget asks), then one drift_run row (`experiments.report drift_run`: where
# the refreshes fell, each one's seconds, the step, their share of training time with and
# without the first, which compiles) appended to $OUT/drift_runs.jsonl and printed.
#
#   bash experiments/gpu_drift_call.sh        (the device call carries .whl)
#
# The run must outlast the background compile of the statistics pass and the evaluation
# functions (minutes under autotuning on a cold host) before refreshes happen: Wukong `small`
# 6000 steps fits one call; `large` wants VARIANTS=wukong:large:3000 LIMITS=580 on its own.
#
# Environment: VARIANTS (space-separated MODEL:PRESET:STEPS[:EVERY[:MAX_OVERHEAD]]; default
# "wukong:small:6000"; EVERY 25, MAX_OVERHEAD 0.02), PLAN_<MODEL>_<PRESET>
# and REPORT_<MODEL>_<PRESET> (the plan and the probe report it was selected on; the defaults
# are the committed Wukong plans), LIMITS (seconds per run, one per variant; default 480
# each), COMMIT (recorded in the rows), WORK (/tmp/drift), OUT (set on the device; elsewhere
# $WORK/out). Each run's log is $OUT/<model>_<preset>.log.
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
R=docs/results
WORK=${WORK:-/tmp/drift}
OUT=${OUT:-$WORK/out}
VARIANTS=${VARIANTS:-"wukong:small:6000"}
read -r -a LIMIT_LIST <<< "${LIMITS:-}"
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu) jax $(python3 -c 'import jax; print(jax.__version__)')"
default_files() {  # default_files MODEL PRESET: "PLAN REPORT"
  case $1/$2 in
    wukong/small) echo "$R/plan_wukong_small_h200_2026-11-27.json $R/probe_report_wukong_small_h200_2026-11-27.json.gz" ;;
    wukong/large) echo "$R/plan_wukong_large_wgrad0_h200_2026-12-02.json $R/probe_report_wukong_large_h200_2026-11-27.json.gz" ;;
    *) echo "" ;;
  esac
}
i=0
for v in $VARIANTS; do
  IFS=: read -r MODEL PRESET STEPS EVERY BUDGET <<< "$v"
  EVERY=${EVERY:-25}; BUDGET=${BUDGET:-0.02}
  limit=${LIMIT_LIST[$i]:-480}; i=$((i + 1))
  key=$(echo "${MODEL}_${PRESET}" | tr a-z A-Z)
  read -r dplan dreport <<< "$(default_files "$MODEL" "$PRESET")"
  plan_var=PLAN_$key; report_var=REPORT_$key
  plan=${!plan_var:-$dplan}; report=${!report_var:-$dreport}
  if [ -z "$plan" ] || [ -z "$report" ]; then
    echo "$v: no plan or report (set PLAN_$key and REPORT_$key); left out"; continue
  fi
  name=${MODEL}_${PRESET}
  rm -rf "$WORK/$name"
  cmd="python3 -m experiments.train --workdir=$WORK/$name --config.run.model=$MODEL \
--config.run.preset=$PRESET --config.run.precision=loka --config.run.plan=$plan \
--config.drift.every=$EVERY --config.drift.max_overhead=$BUDGET --config.drift.report=$report \
--config.run.steps=$STEPS --config.train.log_every=25 --config.train.checkpoint_every=0 \
--config.train.keep_checkpoints=0 --config.train.progress=false"
  start=$(date +%s)
  timeout "$limit" $cmd > "$WORK/$name.final.json" 2> "$OUT/$name.log"
  rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - start )) s; $(grep '\[drift\]' "$OUT/$name.log" | tail -1)"
  [ $rc -eq 0 ] || { tail -5 "$OUT/$name.log"; continue; }
  python3 -m experiments.report drift_run --run="$WORK/$name" --final="$WORK/$name.final.json" \
    --command="VARIANTS=$v bash experiments/gpu_drift_call.sh" --commit="${COMMIT:-unknown}" \
    --out="$OUT/drift_runs.jsonl" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
done
