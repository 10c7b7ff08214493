#!/bin/bash
# One GPU call of any `experiments.bench` run, resumable on the same host AND on a fresh one:
# the workdir's small files (rows, plans, probe reports, evaluation and timing caches) travel
# both ways as one archive, so a run over many targets needs no per-target carry folders and
# stays within the eight files a call may bring back. Checkpoints and compile caches stay on
# the host (a fresh host retrains a probe's steps and takes every site evaluated before from
# its evaluation cache). Rerun until the log ends in "all selected rows are done"; after each
# call copy what came back under $OUT (work.tar.gz, log.txt) into $CARRY.
#
#   CARRY=.snap/small bash experiments/gpu_suite_call.sh \
#     --config=experiments/configs/bench_models.py --config.targets.presets=small ...
#     (the device call carries .snap and .whl)
#
# Environment: CARRY (required), WORK (/tmp/suite), CARRY_WINS (0; 1: the carried workdir
# replaces a warm host's, after the carry was edited by hand), LIMIT (575: hard seconds),
# MAXMIN (7.5, 5.5 for the quality suite: minutes after which no new row starts, never past
# LIMIT less 20 s (`max_minutes` in gpu_common.sh); a quality arm takes up to
# 3.5 minutes, and one the limit kills loses the steps since its last checkpoint; once a
# model's quality run is recorded, its runs start by their expected length until LIMIT
# instead: `pacing.end_by_minutes`), OUT (set
# on the device; elsewhere $WORK/out),
# MODULE (experiments.bench; or experiments.probe for a timing-only call, which times a
# model's site shapes into the carried timing cache with no training, so a fresh host's
# bench call finds them there:
#   MODULE=experiments.probe CARRY=.snap/x bash experiments/gpu_suite_call.sh \
#     --config.timing.only=true --config.run.model=interformer --config.run.preset=small \
#     --config.run.mods=all --config.evaluate.kernels=...).
# Arguments: passed to `experiments.bench` after --workdir and the overrides of
# compile_cache, pacing.max_minutes, pacing.end_by_minutes and probe.timing_cache, their
# --config=FILE moved first (ml_collections reads it before any override), so a later
# override of the same field wins (to `experiments.probe` after its timing cache and
# time budget).
set -u
CARRY=${CARRY:?set CARRY to the folder that carries this run between calls}
WORK=${WORK:-/tmp/suite}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK/tc" "$OUT" "$CARRY"
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1
# A warm host's own files are newer than the carried ones: never overwrite them, unless
# CARRY_WINS=1 says the carry was edited by hand (rows forgotten, a plan put in): then the
# carried workdir replaces the host's, checkpoints and all (otherwise a warm host keeps its
# own and runs nothing new).
if [ "${CARRY_WINS:-0}" = 1 ] && [ -f "$CARRY/work.tar.gz" ]; then
  find "$WORK" -mindepth 1 -maxdepth 1 ! -path "$OUT" -exec rm -rf {} +
  mkdir -p "$WORK/tc"
fi
[ -f "$CARRY/work.tar.gz" ] && tar -xzf "$CARRY/work.tar.gz" -C "$WORK" --skip-old-files

echo "=== call $(date +%T) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null):" \
  "$*" >> "$WORK/log.txt"
MODULE=${MODULE:-experiments.bench}
if [ "$MODULE" = experiments.bench ]; then
  case " $* " in *"bench_quality.py "*|*" --config.suite=quality "*) : "${MAXMIN:=5.5}" ;; esac
  CONFIG=() ARGS=()  # the config file goes first: ml_collections refuses an override before it
  for arg in "$@"; do
    case "$arg" in --config=*) CONFIG=("$arg") ;; *) ARGS+=("$arg") ;; esac
  done
  set -- ${CONFIG[@]+"${CONFIG[@]}"} --workdir="$WORK" --config.compile_cache=/tmp/jc \
    --config.pacing.max_minutes="$(max_minutes)" \
    --config.pacing.end_by_minutes="$(end_by_minutes)" \
    --config.probe.timing_cache="$WORK/tc" ${ARGS[@]+"${ARGS[@]}"}
else  # no shape starts that would not end within the budget at the slowest shape's pace so
  # far (20-150 s a shape at Wukong large's on the H200); the rest is the process's start
  set -- --config.timing.cache="$WORK/tc" --config.budget_s=$(( ${LIMIT:-575} - 45 )) "$@"
fi
timeout "${LIMIT:-575}" python3 -m "$MODULE" "$@" >> "$WORK/log.txt" 2>&1
echo "rc=$?" >> "$WORK/log.txt"

tar -czf "$OUT/work.tar.gz" -C "$WORK" --exclude=checkpoints --exclude=out --exclude=jax_cache \
  --exclude='*.orbax-checkpoint-tmp*' .
cp "$WORK/log.txt" "$OUT/log.txt"
grep -v -e '^W[0-9]' -e '^I[0-9]' -e '^If this' -e '^Current allocation' -e '^\*\*\*' \
  "$WORK/log.txt" | tail -40
