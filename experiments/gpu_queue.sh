#!/bin/bash
# One GPU call that runs a queue: several `experiments/gpu_suite_call.sh` runs in
# order, each until the bench prints "all selected rows are done", within BUDGET seconds.
# Device time is spent in whole calls, so the runs that belong together go in one; a queue
# written down as one command also survives a fresh checkout, where an uncommitted script
# would not.
#
#   QUEUE=s37 bash experiments/gpu_queue.sh \
#     "qi /tmp/qi .snap/qi 400 --config=experiments/configs/bench_quality.py \
#        --config.targets.models=interformer ..." \
#     "qk0 /tmp/qk .snap/qk 200 --config=experiments/configs/bench_quality.py \
#        --config.targets.models=dcnv2 --config.targets.seed=0 ..."
#
# Each argument is one stage: NAME WORK CARRY MIN_LEFT, then the bench's arguments (no
# spaces inside one). A stage starts only with MIN_LEFT seconds of the budget left; one that
# is not done ends this call (the next call resumes it, since the bench is resumable). A
# stage done on this host is skipped on the next call (marker /tmp/loka_queue_$QUEUE_NAME:
# a host may keep /tmp from an earlier lease, so QUEUE names this queue). Each stage's
# workdir comes back as $OUT/<CARRY's folder name>.tar.gz (stages sharing a carry: the last
# one's); copy it to CARRY/work.tar.gz before the next call.
# With CPU_SUITE=1 the CPU test suite runs last, once every stage is done and 250 s are
# left, into $OUT/tests_cpu_log.txt: without the network tests and the notebook tests, which
# need PyPI and the Jupyter stack that a GPU host lacks (CI runs both).
#
# Environment: QUEUE (required), BUDGET (575: seconds for the whole call), OUT (set on the
# device; elsewhere /tmp/loka_queue_$QUEUE/out).
set -u
QUEUE=${QUEUE:?set QUEUE to name this queue, e.g. the date}
T0=$(date +%s)
BUDGET=${BUDGET:-575}
OUT=${OUT:-/tmp/loka_queue_$QUEUE/out}
mkdir -p "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
marker() { echo "/tmp/loka_queue_${QUEUE}_$1"; }
echo "queue $QUEUE on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no GPU")"

all_done=1
for stage in "$@"; do
  read -r name work carry need args <<< "$stage"
  if [ -z "${need:-}" ]; then
    echo "stage '$stage': give NAME WORK CARRY MIN_LEFT then the bench's arguments" >&2
    exit 2
  fi
  [ -f "$(marker "$name")" ] && { echo "== $name: done on this host"; continue; }
  if [ "$(left)" -le "$need" ]; then
    echo "== $name: not started ($(left) s left, it needs $need)"
    all_done=0
    break
  fi
  echo "== $name ($(left) s left)"
  # word splitting of the bench's arguments is intended: they hold no spaces
  # shellcheck disable=SC2086
  LIMIT=$(( $(left) - 15 )) WORK=$work CARRY=$carry OUT="$OUT/$name" \
    bash experiments/gpu_suite_call.sh $args | tail -12
  mv "$OUT/$name/work.tar.gz" "$OUT/$(basename "$carry").tar.gz" && rm -rf "${OUT:?}/$name"
  if tail -3 "$work/log.txt" | grep -q "all selected rows are done"; then
    touch "$(marker "$name")"
  else
    echo "== $name: not done; the next call resumes it"
    all_done=0
    break
  fi
done

if [ "${CPU_SUITE:-0}" = 1 ] && [ "$all_done" = 1 ] && [ ! -f "$(marker cpu_suite)" ] \
   && [ "$(left)" -gt 250 ]; then
  echo "== CPU suite ($(left) s left)"
  # each stage installs the carried wheels in its own shell; the suite's shell needs them too
  source experiments/gpu_common.sh
  ensure_wheels || exit 1
  timeout $(( $(left) - 10 )) env JAX_PLATFORMS=cpu python3 -m pytest tests -q -n 16 \
    -m "not network" --ignore=tests/notebooks > "$OUT/tests_cpu_log.txt" 2>&1
  echo "cpu suite rc=$?"
  tail -3 "$OUT/tests_cpu_log.txt"
  touch "$(marker cpu_suite)"
fi
echo "left: $(left) s"
