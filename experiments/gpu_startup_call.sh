#!/bin/bash
# One GPU call measuring what a user of `experiments.train` waits for and gets: for each arm
# of a model preset (bf16+Mods, the LoKA plan, bf16+Mods with batches made in turn, then the
# LoKA plan again on the warm compilation cache), the seconds from process start to the first
# step, the set-up and the first step (final.json's time_split), and the steps/s of every
# metrics window after the first. Cold: the compilation cache starts empty.
#
#   bash experiments/gpu_startup_call.sh        (the device call carries .whl)
#
# Environment: MODEL (wukong), PRESET (large), PLAN (the committed plan of that preset),
# STEPS (150), ARM_LIMIT (seconds per arm, 240), WORK (/tmp/startup), OUT (set on the device;
# elsewhere $WORK/out), ARMS (the arms to run, in order; default "bf16_mods loka
# bf16_mods_in_turn loka_warm"). Arms with compiler variants, each on its own empty
# compilation cache: bf16_mods_autotune0 and loka_autotune0 (XLA's GPU autotuning off:
# --xla_gpu_autotune_level=0), bf16_mods_no_triton_gemm and loka_no_triton_gemm (cuBLAS for
# every GEMM fusion: --xla_gpu_enable_triton_gemm=false, experiments.train's
# --config.train.triton_gemm=false).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
MODEL=${MODEL:-wukong}
PRESET=${PRESET:-large}
PLAN=${PLAN:-docs/results/plan_wukong_large_wgrad0_h200_2026-12-02.json}
WORK=${WORK:-/tmp/startup}
OUT=${OUT:-$WORK/out}
rm -rf "$WORK/runs" "$WORK"/jax_cache*
mkdir -p "$WORK/runs" "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader) jax $(python3 -c 'import jax; print(jax.__version__)') $MODEL/$PRESET"
arm() {  # arm NAME ARGS...: one train run, its summary line
  local name=$1; shift
  local start; start=$(date +%s.%N)
  train_run "$WORK/runs/$name" "$OUT/$name.log" "$@"
  echo "rc=$?" >> "$OUT/$name.log"
  python3 - "$WORK/runs/$name" "$name" "$start" <<'PY'
import json, os, sys
run, name, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
final = json.load(open(os.path.join(run, "final.json")))
split = final.get("time_split", {})
lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
rates = [l["steps_per_sec"] for l in lines if "steps_per_sec" in l][1:]
started = os.path.getmtime(os.path.join(run, "config.json")) - start
first = started + split.get("setup_s", 0) + split.get("first_step_s", 0)
print(f"{name:18s} start->first step {first:6.1f} s (imports+build {started:5.1f}, setup "
      f"{split.get('setup_s', 0):5.1f}, first step {split.get('first_step_s', 0):5.1f}); "
      f"windows steps/s {' '.join(f'{r:.2f}' for r in rates)}; median "
      f"{sorted(rates)[len(rates) // 2] if rates else float('nan'):.2f}")
PY
}
variant() {  # variant NAME XLA_FLAG ARGS...: an arm compiled with XLA_FLAG on a cold cache
  local name=$1 flag=$2; shift 2
  XLA_FLAGS="${XLA_FLAGS:-} $flag" JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache_$name" \
    arm "$name" "$@"
}
BF16=(--config.run.precision=bf16)
LOKA=(--config.run.precision=loka --config.run.plan="$PLAN")
for name in ${ARMS:-bf16_mods loka bf16_mods_in_turn loka_warm}; do
  case $name in
    bf16_mods) arm bf16_mods "${BF16[@]}" ;;
    loka | loka_warm) arm "$name" "${LOKA[@]}" ;;
    bf16_mods_in_turn) arm bf16_mods_in_turn "${BF16[@]}" --config.train.prefetch=0 ;;
    bf16_mods_autotune0) variant "$name" --xla_gpu_autotune_level=0 "${BF16[@]}" ;;
    loka_autotune0) variant "$name" --xla_gpu_autotune_level=0 "${LOKA[@]}" ;;
    bf16_mods_no_triton_gemm) variant "$name" --xla_gpu_enable_triton_gemm=false "${BF16[@]}" ;;
    loka_no_triton_gemm) variant "$name" --xla_gpu_enable_triton_gemm=false "${LOKA[@]}" ;;
    *) echo "unknown arm $name" >&2; exit 2 ;;
  esac
done
