#!/bin/bash
# One GPU call measuring the probe's statistics pass against the training step
# (`experiments.measure probe_overhead`) for several models, presets and probe settings, each
# in its own process on one shared compilation cache, killed after its own limit. Each
# measurement goes to $OUT/probe_overhead_<n>.json, their RESULTS rows (`experiments.report
# probe_overhead`) to $OUT/rows.jsonl, the logs to $OUT/logs.tgz; a table is printed last.
#
#   VARIANTS="wukong:small:one_program=1,weight_every=4 wukong:large:weight_every=4:parts" \
#     bash experiments/gpu_probe_overhead_call.sh        (the device call carries .whl)
#
# Environment: VARIANTS (MODEL:PRESET:PROBE_CONFIG[:parts], space-separated; PROBE_CONFIG as
# --probe_config, '-' for none), LIMITS (seconds per variant, space-separated in the same
# order; default 150 each), REPEATS (10), COMMIT (recorded in the rows), WORK
# (/tmp/probe_overhead), OUT (set on the device; elsewhere $WORK/out).
set -u
source experiments/gpu_common.sh
ensure_wheels || exit 1
WORK=${WORK:-/tmp/probe_overhead}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK/logs" "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="$WORK/jax_cache"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu)"
read -r -a limits <<< "${LIMITS:-}"
n=0
for variant in ${VARIANTS:?set VARIANTS}; do
  IFS=: read -r model preset config parts <<< "$variant"
  args=(--model="$model" --preset="$preset" --repeats="${REPEATS:-10}"
        --out="$OUT/probe_overhead_$n.json")
  [ "$config" != - ] && args+=(--probe_config="$config")
  [ "${parts:-}" = parts ] && args+=(--parts)
  began=$(date +%s)
  timeout "${limits[$n]:-150}" python3 -m experiments.measure probe_overhead "${args[@]}" \
    > "$WORK/logs/probe_overhead_$n.log" 2>&1
  rc=$?
  echo "$variant rc=$rc $(( $(date +%s) - began )) s"
  # Why it ended without a measurement: the log's last line (the error, or where the limit
  # cut it), since the logs come back packed.
  [ $rc != 0 ] && echo "  $(tail -n 1 "$WORK/logs/probe_overhead_$n.log" | cut -c1-240)"
  n=$((n + 1))
done
python3 - "$OUT" <<'PY'
import glob, json, sys
print(f"{'model/preset':18s} {'config':66s} {'step ms':>8s} {'pass ms':>8s} {'1st s':>6s} "
      f"{'@25':>7s} {'@100':>7s} {'@200':>7s}  parts")
for path in sorted(glob.glob(f"{sys.argv[1]}/probe_overhead_*.json")):
  r = json.load(open(path))
  c = r["probe_config"]
  config = ",".join(f"{k}={c.get(k)}" for k in ("weight_every", "one_program", "group_sites",
                                                  "pass_compile"))
  f = r["fraction"]
  print(f"{r['model'] + '/' + r['preset']:18s} {config:66s} {r['step_ms']:8.1f} "
        f"{r['pass_ms']:8.1f} {r.get('pass_first_call_s', 0):6.1f} {100 * f['25']:6.1f}% {100 * f['100']:6.1f}% "
        f"{100 * f['200']:6.1f}%  {r['parts_ms']}")
PY
measured=$(ls "$OUT"/probe_overhead_*.json 2>/dev/null | paste -sd, -)
[ -n "$measured" ] && python3 -m experiments.report probe_overhead --measured="$measured" \
  --commit="${COMMIT:-unknown}" --out="$OUT/rows.jsonl"
tar czf "$OUT/logs.tgz" -C "$WORK" logs
