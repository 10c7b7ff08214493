#!/bin/bash
# One GPU call for the Mosaic GPU kernels: their compiled numerics on the card
# (tests/gpu/test_pallas_mosaic_gpu.py), then the kernel benchmark's Mosaic GPU variants beside
# bf16, XLA's FP8 dot (cuBLASLt) and the Triton kernels at every benchmark shape, each shape's
# baseline timed again in the same call. Rows go to $OUT/kernels/results.jsonl (append them
# to a docs/results/bench_kernels_*.jsonl file), the table last.
#
#   bash experiments/gpu_mosaic_call.sh        (the device call carries .whl)
#
# Environment: TESTS_LIMIT (seconds for the tests, 240; 0 skips them), TESTS_K (a pytest -k
# expression: only those tests, e.g. "warp_specialized or output_quantization"), MAXMIN (the
# benchmark's minutes, 5), ONLY (its select.only tokens: which variants run beside each
# shape's baseline), CARRY (a folder holding an earlier call's results.jsonl: its shapes are
# not timed again), TUNE (1: the Pallas kernels' tiles are tuned per shape first, cached
# under $WORK/kernels/pallas_tune and brought back), SMOKE (1: the benchmark's tiny shapes,
# which run on a CPU too), WORK
# (/tmp/mosaic), OUT (set on the device; elsewhere $WORK/out).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
WORK=${WORK:-/tmp/mosaic}
OUT=${OUT:-$WORK/out}
ONLY=${ONLY:-mosaic,xla_fp8_rowwise,pallas_fp8_rowwise,pallas_fp8_batched,pallas_fused_chain}
mkdir -p "$WORK/kernels" "$OUT/kernels"
export PYTHONUNBUFFERED=1
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu)" \
  "jax $(python3 -c 'import jax; print(jax.__version__)')"
if [ "${TESTS_LIMIT:-240}" != 0 ]; then
  SELECT=()
  [ -n "${TESTS_K:-}" ] && SELECT=(-k "$TESTS_K")
  timeout "${TESTS_LIMIT:-240}" python3 -m pytest tests/gpu/test_pallas_mosaic_gpu.py -m gpu \
    -q -n 0 -p no:cacheprovider ${SELECT[@]+"${SELECT[@]}"} > "$OUT/tests.log" 2>&1
  echo "tests (rc $?): $(tail -n 1 "$OUT/tests.log")"
fi
if [ -n "${CARRY:-}" ] && [ -f "$CARRY/results.jsonl" ] && [ ! -f "$WORK/kernels/results.jsonl" ]; then
  cp "$CARRY/results.jsonl" "$WORK/kernels/results.jsonl"
fi
EXTRA_ARGS=()
[ "${SMOKE:-0}" = 1 ] && EXTRA_ARGS=(--config.select.smoke=true --config.timing.repeats=3)
[ "${TUNE:-0}" = 1 ] && EXTRA_ARGS+=(--config.timing.tune=true)
python3 -m experiments.bench_kernels --out="$WORK/kernels" --config.select.only="$ONLY" \
  --config.limits.max_minutes="${MAXMIN:-5}" --config.limits.compile_cache="$WORK/jax_cache" \
  ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} > "$OUT/bench.log" 2>&1
echo "bench_kernels rc $?"
cp "$WORK/kernels/results.jsonl" "$OUT/kernels/" 2>/dev/null
cp "$WORK"/kernels/pallas_tune/*.json "$OUT/kernels/" 2>/dev/null
cat "$WORK/kernels/table.md" 2>/dev/null || tail -n 20 "$OUT/bench.log"
