#!/bin/bash
# One call on a 2-GPU host measuring sharded training: Wukong and DLRM `small` and `large`
# with every table row-sharded over `model` (mesh data:1,model:2, rows padded to even) and
# the dense towers data-parallel over both GPUs. Per model and preset, two precision arms
# (bf16+Mods, and the committed LoKA plan with Mods), each timed as 1dev (the training
# loop's step on one GPU), 2dev_bf16 and 2dev_fp8 (the sharded step with bf16 or FP8
# collectives), interleaved: step time, steps/s, throughput ratio and scaling efficiency
# (throughput_2 / (2 throughput_1)) with CIs, and the training loss after 100 steps. Also
# writes the bytes model of each step (experiments.parallel_bytes) to set against measured
# NVLink traffic. Run from the repository root on the device (carry .whl for ml_collections).
#
#   CARRY=.snap/parallel bash experiments/gpu_parallel_call.sh
#
# Resumable: rows go to $WORK/parallel/parallel.jsonl and to $OUT/parallel.jsonl; copy that
# file into $CARRY after each call and rerun until the log ends in "all arms done". The
# last lines printed are the benchmark's table of every row so far (one line per model,
# preset, arm and variant).
# Environment: CARRY (.snap/parallel), WORK (/tmp/parallel), OUT (on the device; elsewhere
# $WORK/out), MODELS ("wukong dlrm"), PRESETS (small,large), LIMIT (575: hard seconds),
# MAXMIN (7.5: minutes after which no new row starts), PLANS_wukong / PLANS_dlrm (the LoKA
# arm's plans, PRESET:FILE pairs; default: the committed H200 plans).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1
CARRY=${CARRY:-.snap/parallel}
WORK=${WORK:-/tmp/parallel}
OUT=${OUT:-$WORK/out}
MODELS=${MODELS:-wukong dlrm}
PRESETS=${PRESETS:-small,large}
PLANS_wukong=${PLANS_wukong:-small:docs/results/plan_wukong_small_h200_2026-11-27.json,large:docs/results/plan_wukong_large_wgrad0_h200_2026-12-02.json}
PLANS_dlrm=${PLANS_dlrm:-small:docs/results/plan_dlrm_small_h200_2026-11-27.json,large:docs/results/plan_dlrm_large_h200_2026-11-28.json}
mkdir -p "$WORK/parallel" "$OUT" "$CARRY"
# A warm host keeps its own (newer) rows; a fresh one starts from the carried ones.
[ -f "$WORK/parallel/parallel.jsonl" ] || cp "$CARRY/parallel.jsonl" "$WORK/parallel/" 2>/dev/null
START=$(date +%s)
BUDGET=$(max_minutes)
echo "=== $(date +%T) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)," \
  "jax $(python3 -c 'import jax; print(jax.__version__)'), commit ${COMMIT:-unknown}"
for model in $MODELS; do   # the bytes model: shapes only, seconds
  [ -f "$OUT/bytes_$model.txt" ] || python3 -m experiments.parallel_bytes \
    --config.run.model="$model" --config.run.presets="$PRESETS" --config.run.mods=all \
    --config.parallel.meshes="data:1,model:2" --config.parallel.modes=bf16,fp8 \
    --config.output="$OUT/bytes_$model.json" > "$OUT/bytes_$model.txt" 2>/dev/null
done
DONE=1
for model in $MODELS; do
  plans_var="PLANS_$model"
  for arm in mods loka; do
    left=$(awk -v b="$BUDGET" -v s="$START" -v n="$(date +%s)" 'BEGIN { print b - (n - s) / 60 }')
    if awk -v l="$left" 'BEGIN { exit !(l < 0.5) }'; then DONE=0; break 2; fi
    ARGS=(--config.run.model="$model" --config.run.presets="$PRESETS" --config.run.mods=all
          --config.parallel.devices=1,2 --config.parallel.model_axis=all
          --config.parallel.collective_modes=bf16,fp8 --config.limits.compile_cache=/tmp/jc
          --config.limits.max_minutes="$left")
    [ "$arm" = loka ] && ARGS+=(--config.run.precision=loka --config.run.plans="${!plans_var}")
    echo "--- $model $arm (${left} min left)"
    python3 -m experiments.bench_parallel --workdir="$WORK/parallel" "${ARGS[@]}" \
      > "$OUT/log_${model}_$arm.txt" 2>&1
    rc=$?
    grep -q "finished after" "$OUT/log_${model}_$arm.txt" || DONE=0
    echo "$model $arm rc=$rc"
    [ $rc = 0 ] || tail -n 5 "$OUT/log_${model}_$arm.txt"
  done
done
cp "$WORK/parallel/parallel.jsonl" "$OUT/" 2>/dev/null
LAST=$(ls -t "$OUT"/log_*.txt 2>/dev/null | head -1)
[ -n "$LAST" ] && grep "model/preset" -A 100 "$LAST" | sed 's/^\[bench_parallel\] //'
if [ $DONE = 1 ]; then echo "all arms done"; else echo "stopped at the time limit; copy $OUT/parallel.jsonl into $CARRY and rerun"; fi
