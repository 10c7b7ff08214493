#!/bin/bash
# One GPU call that profiles a target's training and inference steps (experiments.profile_step)
# from a committed plan and probe report, and brings back the tables, the plot and the
# training HLOs of the variants named in HLO (for `experiments.report hlo_scope` on any
# machine).
#
#   MODEL=dcnv2 PRESET=large VARIANTS=bf16_mods,pallas_delayed,loka HLO=bf16_mods,loka \
#   PLAN=docs/results/plan_dcnv2_large_h200_2026-11-28.json \
#   REPORT=docs/results/probe_report_dcnv2_large_h200_2026-11-28.json.gz \
#     bash experiments/gpu_profile_call.sh        (the device call carries .whl)
#
# Environment: MODEL, PRESET (required); VARIANTS (bf16_mods,loka); HLO (the training HLOs to
# bring back, gzipped; default none); PLAN and REPORT (needed when VARIANTS has loka; REPORT
# may be gzipped); MODS (the Mods arms' set, as the bench's targets.mods, e.g. no_bias,blocknorm;
# default every Mod; PLAN and REPORT go to that set's plans folder); OWN_STATES (1: every
# variant on a state of its own model's parameters, as the training loop runs it; default 0:
# on bf16's shared state, as the bench times them); WORK (/tmp/profile);
# LIMIT (540: hard seconds); OUT (set on the device; elsewhere $WORK/out). Writes
# $OUT/profile_$MODEL.{md,json,png}, $OUT/profile_$MODEL.log and
# $OUT/hlo_${MODEL}_${variant}_train.txt.gz.
set -u
MODEL=${MODEL:?set MODEL} PRESET=${PRESET:?set PRESET}
WORK=${WORK:-/tmp/profile}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
source experiments/gpu_common.sh
ensure_wheels || exit 1
MODS=${MODS:-all}
# The set's plans folder, as the bench and profile_step name it (mods_set.plans_root).
ROOT=$(python3 -c "import sys; from experiments.bench import mods_set as m
print(m.plans_root(sys.argv[1], sys.argv[2].split(',')))" "$WORK/plans" "$MODS") || exit 1
PLANS="$ROOT/${MODEL}_${PRESET}"
if [ -n "${PLAN:-}" ]; then
  mkdir -p "$PLANS" && cp "$PLAN" "$PLANS/plan.json" || exit 1
  case "${REPORT:?set REPORT beside PLAN}" in
    *.gz) gunzip -c "$REPORT" > "$PLANS/probe_report.json" ;;
    *) cp "$REPORT" "$PLANS/probe_report.json" ;;
  esac || exit 1
fi
timeout "${LIMIT:-540}" python3 -m experiments.profile_step --workdir="$WORK/run" \
  --config.target.model="$MODEL" --config.target.preset="$PRESET" \
  --config.variants.names="${VARIANTS:-bf16_mods,loka}" --config.variants.mods="$MODS" \
  --config.variants.plans_dir="$WORK/plans" \
  --config.variants.own_states="$( [ "${OWN_STATES:-0}" = 1 ] && echo true || echo false )" \
  > "$OUT/profile_$MODEL.log" 2>&1
rc=$?
for ext in md json png; do
  [ -f "$WORK/run/profile.$ext" ] && cp "$WORK/run/profile.$ext" "$OUT/profile_$MODEL.$ext"
done
for v in ${HLO//,/ }; do
  [ -f "$WORK/run/hlo/${v}_train.txt" ] && gzip -c "$WORK/run/hlo/${v}_train.txt" \
    > "$OUT/hlo_${MODEL}_${v}_train.txt.gz"
done
echo "profile rc=$rc"
grep -v -e '^W[0-9]' -e '^I[0-9]' "$OUT/profile_$MODEL.log" | tail -40
