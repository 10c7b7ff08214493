#!/bin/bash
# One GPU call that measures the headline again with the same commands: Wukong `large` under
# its committed LoKA plan against bf16 and bf16+Mods (training step and inference), and one
# tower row; the rows land in $OUT/rows/ with the log. Run from the repository root on the
# device (carry .whl for ml_collections).
#
#   PLAN=docs/results/plan_wukong_large_wgrad0_h200_2026-12-02.json \
#     bash experiments/gpu_headline_call.sh
#
# Environment: PLAN (the committed Wukong `large` plan), REPORT (its probe report), COMMIT
# (the commit measured, recorded in the log), OUT (on the device; elsewhere
# /tmp/headline/out), PRESETS (large), TOWER (16384x4096x4), MAXMIN (8: minutes after
# which no new row starts).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/headline}
OUT=${OUT:-$WORK/out}
PLAN=${PLAN:-docs/results/plan_wukong_large_wgrad0_h200_2026-12-02.json}
REPORT=${REPORT:-docs/results/probe_report_wukong_large_h200_2026-11-27.json.gz}
TARGET="$WORK/plans/wukong_${PRESETS:-large}"
rm -rf "$WORK/models" "$WORK/towers"   # every call measures afresh, baselines in the same run
mkdir -p "$TARGET" "$OUT/rows"
cp "$PLAN" "$TARGET/plan.json"            # the plan and the report it was selected from
gunzip -c "$REPORT" > "$TARGET/probe_report.json"
echo "=== $(date +%T) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)," \
  "jax $(python3 -c 'import jax; print(jax.__version__)'), commit ${COMMIT:-unknown}"
python3 -m experiments.bench --config=experiments/configs/bench_models.py \
  --config.targets.models=wukong --config.targets.presets="${PRESETS:-large}" \
  --config.speed.variants=bf16,bf16_mods,loka --config.probe.enabled=false \
  --workdir="$WORK/models" --config.plans_dir="$WORK/plans" \
  --config.pacing.max_minutes="${MAXMIN:-8}" > "$OUT/models_log.txt" 2>&1
echo "models rc=$?"
[ "${SKIP_TOWERS:-0}" = 1 ] || python3 -m experiments.bench \
  --config=experiments/configs/bench_towers.py --config.targets.towers="${TOWER:-16384x4096x4}" \
  --config.speed.variants=bf16,flax_fp8_delayed --config.probe.enabled=false \
  --workdir="$WORK/towers" --config.pacing.max_minutes=2 > "$OUT/towers_log.txt" 2>&1
echo "towers rc=$?"
for suite in models towers; do
  cp "$WORK/$suite/bench.jsonl" "$OUT/rows/bench_$suite.jsonl" 2>/dev/null
  cp "$WORK/$suite/report.md" "$OUT/rows/report_$suite.md" 2>/dev/null
done
tail -n 25 "$OUT/models_log.txt" "$OUT/towers_log.txt"
