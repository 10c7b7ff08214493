#!/bin/bash
# One GPU call of a model's LoKA benchmark row (probe -> plan -> validate -> timed rows; made
# for Wukong `large`), resumable on the same host AND on a fresh one. Rerun until it prints
# "all selected rows are done".
#
# The large files (the probe's ~41 GB checkpoint, the validation state) live in $WORK on the
# GPU host and are lost when the host goes back. Everything needed to go on elsewhere is small
# and travels through $CARRY both ways: the probe's evaluation cache (a fresh host retrains
# the probe's 50 steps and takes every site evaluated before from it), its kernel timings,
# the probe report, the plans at each stage (validation retrains the probe's state when its
# checkpoint is absent) and the benchmark rows. After each call, copy what came back under
# $OUT into $CARRY (tc/ included) before the next.
#
#   CARRY=.snap/wl bash experiments/gpu_loka_call.sh     (the device call carries .snap, .whl)
#
# Environment: TARGET (wukong/large; MODEL/PRESET or tower/BxWxD), CARRY (.snap/wl), WORK (/tmp/bench), VARIANTS
# (bf16,bf16_mods,loka), PROBE_KERNELS (xla_bf16,xla_fp8_rowwise,flax_fp8_delayed,flax_fp8_delayed_fwd,
# flax_fp8_delayed_grad_lhs: the probe's
# candidates), MAXMIN (7.5: minutes after which no new row starts unless the rows recorded
# say it ends in time), LIMIT (575: hard seconds; the bench starts no row that the longest
# recorded one says would end past it, less 20 s: `experiments/bench/pace.py`), TIMING_CACHE
# (.snap/tc: shapes timed ahead by `experiments.probe` with `config.timing.only`),
# OUT (set on the device; elsewhere $WORK/out). Arguments go to `experiments.bench` last, as
# overrides of its config, e.g. --config.serving.plan=true (LoKA serves its serving plan's
# export; plan_serve.json is made again from the carried report on each host, so it need not
# come back).
set -u
CARRY=${CARRY:-.snap/wl}
WORK=${WORK:-/tmp/bench}
OUT=${OUT:-$WORK/out}
TARGET=${TARGET:-wukong/large}
PLANS=$WORK/plans/${TARGET/\//_}
mkdir -p "$PLANS/probe" "$OUT"
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1

# Carried files never overwrite this host's own (a warm host's are newer).
copy_new() {  # copy_new FILE DIR: FILE into DIR unless DIR has one of that name
  [ -f "$1" ] && [ ! -e "$2/$(basename "$1")" ] && cp "$1" "$2/"
  return 0
}
for f in probe_report.json plan_selected.json plan_validating.json plan.json; do
  copy_new "$CARRY/$f" "$PLANS"
done
copy_new "$CARRY/probe_eval.jsonl" "$PLANS/probe"
copy_new "$CARRY/bench.jsonl" "$WORK"
# Kernel timings: shapes timed ahead, then what earlier calls measured.
TC=$WORK/tc
mkdir -p "$TC"
for f in "${TIMING_CACHE:-.snap/tc}"/*.json "$CARRY"/tc/*.json; do
  copy_new "$f" "$TC"
done

# Host memory (GiB used), GPU memory (MiB, includes JAX's preallocation) and disk used, every 5 s.
(while true; do
  echo "$(date +%T) $(free -g | awk 'NR==2{print $3}')" \
       "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null)" \
       "$(df -BG "$WORK" | awk 'NR==2{print $3}')" >> "$WORK/hostmem.txt"
  sleep 5
done) > /dev/null 2>&1 &  # its sleep must not hold the caller's output open
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null' EXIT

echo "=== call $(date +%T) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" \
  >> "$WORK/log.txt"
touch "$WORK/.call_start"  # timing caches written after this come back
case "$TARGET" in
  tower/*) SUITE=(--config=experiments/configs/bench_towers.py
                  --config.targets.towers="${TARGET#tower/}") ;;
  *) SUITE=(--config=experiments/configs/bench_models.py --config.targets.presets="${TARGET#*/}"
            --config.targets.only="$TARGET") ;;
esac
timeout "${LIMIT:-575}" python3 -m experiments.bench "${SUITE[@]}" \
  --workdir="$WORK" --config.speed.variants="${VARIANTS:-bf16,bf16_mods,loka}" \
  --config.probe.steps=50 --config.probe.samples=8 --config.probe.kernels="${PROBE_KERNELS:-xla_bf16,xla_fp8_rowwise,flax_fp8_delayed,flax_fp8_delayed_fwd,flax_fp8_delayed_grad_lhs}" \
  --config.probe.timing_cache="$TC" --config.compile_cache=/tmp/jc \
  --config.pacing.max_minutes="$(max_minutes)" --config.pacing.end_by_minutes="$(end_by_minutes)" \
  "$@" >> "$WORK/log.txt" 2>&1
echo "rc=$?" >> "$WORK/log.txt"

# Eight files at most come back from the device (a caller may add one): the samples ride at
# the log's end, only the timing caches this call wrote come back, and the validating plan
# only while no validated plan supersedes it.
{ cat "$WORK/log.txt"; echo "=== samples: time, host GiB, GPU MiB, disk"; cat "$WORK/hostmem.txt"; } \
  > "$OUT/log.txt"
mkdir -p "$OUT/tc"
find "$TC" -name '*.json' -newer "$WORK/.call_start" -exec cp {} "$OUT/tc/" \;
cp "$WORK/bench.jsonl" "$OUT/" 2>/dev/null
cp "$PLANS/probe/probe_eval.jsonl" "$OUT/" 2>/dev/null
for f in probe_report.json plan_selected.json plan.json; do
  [ -f "$PLANS/$f" ] && cp "$PLANS/$f" "$OUT/"
done
[ -f "$PLANS/plan.json" ] || { [ -f "$PLANS/plan_validating.json" ] && cp "$PLANS/plan_validating.json" "$OUT/"; }
df -h "$WORK" | tail -1
sort -k2 -n "$WORK/hostmem.txt" | tail -1 | sed 's/^/peak host memory (GiB) at: /'
grep -v -e '^W[0-9]' -e '^I[0-9]' -e '^If this' -e '^Current allocation' -e '^\*\*\*' "$WORK/log.txt" | tail -40
