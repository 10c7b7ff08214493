#!/bin/bash
# One device call running the CPU test suite under the GPU host's jax (newer than CI's) on the
# host's cores: JAX_PLATFORMS=cpu, WORKERS xdist workers, each test's outcome written to the log
# as it ends, so a call its limit cuts short still names every failure so far. The notebook
# tests are left out (the host lacks nbclient), and so are those marked `network` (the host
# reaches no network).
#
#   bash experiments/gpu_cpu_suite_call.sh        (the device call carries .whl)
#
# Environment: WORKERS (16), LIMIT (seconds for pytest, 400), OUT (set on the device;
# elsewhere /tmp/cpu_suite/out). Arguments go to pytest (e.g. a test path or -k EXPR).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
OUT=${OUT:-/tmp/cpu_suite/out}
mkdir -p "$OUT"
echo "jax $(python3 -c 'import jax; print(jax.__version__)'), $(nproc) cores"
JAX_PLATFORMS=cpu timeout "${LIMIT:-400}" python3 -m pytest -v -n "${WORKERS:-16}" \
  --dist loadfile -p no:cacheprovider --ignore=tests/notebooks -m "not network" "${@:-tests}" \
  > "$OUT/cpu_suite.log" 2>&1
rc=$?
echo "pytest rc $rc$([ $rc = 124 ] && echo ' (cut by LIMIT)')"
grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$OUT/cpu_suite.log" | sed 's/^\[gw[0-9]*\] *//' | head -n 20
grep -E "^(FAILED|ERROR) " "$OUT/cpu_suite.log" | head -n 20
tail -n 1 "$OUT/cpu_suite.log"
