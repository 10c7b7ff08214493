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
# STEPS (150), WORK (/tmp/startup), OUT (set on the device; elsewhere $WORK/out).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
MODEL=${MODEL:-wukong}
PRESET=${PRESET:-large}
PLAN=${PLAN:-docs/results/plan_wukong_large_wgrad0_h200_2026-12-02.json}
WORK=${WORK:-/tmp/startup}
OUT=${OUT:-$WORK/out}
rm -rf "$WORK/runs" "$WORK/jax_cache"
mkdir -p "$WORK/runs" "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader) jax $(python3 -c 'import jax; print(jax.__version__)') $MODEL/$PRESET"
arm() {  # arm NAME ARGS...: one train run, its summary line
  local name=$1; shift
  local start; start=$(date +%s.%N)
  timeout 240 python3 -m experiments.train --workdir="$WORK/runs/$name" \
    --config.run.model="$MODEL" --config.run.preset="$PRESET" --config.run.mods=all \
    --config.run.steps="${STEPS:-150}" --config.train.log_every=25 \
    --config.train.checkpoint_every=0 --config.train.keep_checkpoints=0 \
    --config.train.progress=false "$@" > "$OUT/$name.log" 2>&1
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
arm bf16_mods --config.run.precision=bf16
arm loka --config.run.precision=loka --config.run.plan="$PLAN"
arm bf16_mods_in_turn --config.run.precision=bf16 --config.train.prefetch=0
arm loka_warm --config.run.precision=loka --config.run.plan="$PLAN"
