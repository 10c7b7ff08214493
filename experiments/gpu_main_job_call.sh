#!/bin/bash
# One GPU call timing the main job as a new user meets it: `python3 -m experiments.loka` with
# its defaults on a cold host (empty compilation cache, no timing cache), then the same command
# again on the warm workdir. Each output line is stamped with the seconds since its start.
#
#   bash experiments/gpu_main_job_call.sh        (the device call carries .whl)
#
# Environment: WORK (/tmp/main_job), LIMIT (seconds for the cold run, 500), RUNS ("cold warm";
# "cold" alone gives a long cold run the whole call, and a second such call on the same warm
# host resumes it from the workdir; with "warm" after it, a cold run LIMIT cuts is first
# finished by a rerun of at most RESUME_LIMIT seconds, 120, logged as resume.log), OUT (set on
# the device; elsewhere $WORK/out). Arguments go to every run, as config overrides.
set -u
WORK=${WORK:-/tmp/main_job}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
source experiments/gpu_common.sh
ensure_wheels || exit 1
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
stamp() { python3 -c "
import sys, time
t = time.time()
for line in sys.stdin:
  print(f'{time.time() - t:7.1f} {line}', end='', flush=True)"; }
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader) jax $(python3 -c 'import jax; print(jax.__version__)')"
# job NAME LIMIT ARGS...: the main job on the workdir, stamped into $OUT/NAME.log; sets rc.
job() {
  local name=$1 limit=$2 start; shift 2
  start=$(date +%s.%N)
  timeout "$limit" python3 -m experiments.loka --workdir="$WORK/run" "$@" 2>&1 \
    | stamp > "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name: rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $start, 1))") s"
}
for run in ${RUNS:-cold warm}; do
  job "$run" "$([ "$run" = cold ] && echo "${LIMIT:-500}" || echo 120)" "$@"
  # A cold run its limit cut is finished by a rerun on its workdir (resume.log) before the
  # warm run, which then times a rerun of the whole finished job, not the cold run's rest.
  if [ "$run" = cold ] && [ "$rc" = 124 ] && [[ " ${RUNS:-cold warm} " == *" warm "* ]]; then
    job resume "${RESUME_LIMIT:-120}" "$@"
  fi
done
cp "$WORK/run/report.md" "$WORK/run/probe_report.json" "$OUT/" 2>/dev/null
# The card's kernel timings the probe measured, saved after each shape, so a run cut by its
# limit brings back the shapes it finished: `python3 -m experiments.timing_cache table` commits
# them into the card's timing table, which the next run on such a card reads.
find "$WORK/run" -path '*/timing_cache/*.json' | while read -r f; do
  cp "$f" "$OUT/timing_cache_$(basename "$f")"
done
grep -h -e "^ *[0-9.]* \(==\|\[pipeline\]\|\[probe\] timing\|\[probe\] timed\)" "$OUT/cold.log" | tail -40
