#!/bin/bash
# One GPU call of several that bring a newer jax to the host (experiments/gpu_jax_next_pack.sh
# packs it here into .jaxnext/part-NN and .jaxnext/MANIFEST; each call carries one part).
# While parts are missing the call says which and ends. Once every part is there and matches
# its sha256, they are unpacked into SITE, put first on PYTHONPATH, and the call runs the GPU
# tests (tests/gpu) and the kernel benchmark under that jax, the baseline of each shape timed
# in the same call. Rows go to $OUT/kernels/results.jsonl, logs to $OUT, the table last.
#
#   bash experiments/gpu_jax_next_call.sh        (each call carries the MANIFEST and one part)
#
# Environment: DEST (.jaxnext), SITE (/tmp/site_jaxnext), TESTS_LIMIT (seconds for the tests,
# 300; 0 skips them), MAXMIN (the benchmark's minutes, 4; 0 skips it), ONLY (its
# select.only tokens), SMOKE (1: the benchmark's tiny shapes, which run on a CPU too), WORK
# (/tmp/jax_next), OUT (set on the device; elsewhere $WORK/out).
set -u
DEST=${DEST:-.jaxnext}
SITE=${SITE:-/tmp/site_jaxnext}
WORK=${WORK:-/tmp/jax_next}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK/kernels" "$OUT/kernels"
export PYTHONUNBUFFERED=1
if [ ! -f "$DEST/MANIFEST" ]; then
  echo "no $DEST/MANIFEST: pack with experiments/gpu_jax_next_pack.sh and carry it"; exit 1
fi
if [ ! -f "$SITE/.complete" ]; then
  missing=$(cd "$DEST" && grep -v '^#' MANIFEST | while read -r sum part; do
    [ -f "$part" ] && [ "$(sha256sum "$part" | cut -d' ' -f1)" = "$sum" ] || echo "$part"
  done)
  if [ -n "$missing" ]; then
    total=$(grep -vc '^#' "$DEST/MANIFEST")
    echo "parts here: $(( total - $(echo "$missing" | wc -l) )) of $total;" \
      "carry next: $(echo $missing)"
    exit 0
  fi
  rm -rf "$SITE" && mkdir -p "$SITE"
  (cd "$DEST" && cat $(grep -v '^#' MANIFEST | awk '{print $2}')) | xz -d | tar -C "$SITE" -xf - \
    || { echo "unpacking the parts failed"; exit 1; }
  touch "$SITE/.complete"
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu);" \
  "$(python3 -c 'import jax, jaxlib, flax, orbax.checkpoint as o; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__, "orbax", o.__version__, "on", jax.default_backend())' 2>&1 | tail -n 1)"
if [ "${TESTS_LIMIT:-300}" != 0 ]; then
  timeout "${TESTS_LIMIT:-300}" python3 -m pytest tests/gpu -m gpu -q -n 0 -p no:cacheprovider \
    > "$OUT/tests.log" 2>&1
  echo "tests (rc $?): $(tail -n 1 "$OUT/tests.log")"
fi
if [ "${MAXMIN:-4}" != 0 ]; then
  EXTRA_ARGS=()
  [ "${SMOKE:-0}" = 1 ] && EXTRA_ARGS=(--config.select.smoke=true --config.timing.repeats=3)
  python3 -m experiments.bench_kernels --out="$WORK/kernels" \
    --config.select.only="${ONLY:-xla_fp8_rowwise,pallas_mosaic_fp8_rowwise,pallas_fp8_rowwise}" \
    --config.limits.max_minutes="${MAXMIN:-4}" --config.limits.compile_cache="$WORK/jax_cache" \
    ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} > "$OUT/bench.log" 2>&1
  echo "bench_kernels rc $?"
  cp "$WORK/kernels/results.jsonl" "$OUT/kernels/" 2>/dev/null
  cat "$WORK/kernels/table.md" 2>/dev/null || tail -n 20 "$OUT/bench.log"
fi
