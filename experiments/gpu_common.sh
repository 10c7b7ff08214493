# Shared by the GPU call scripts; sourced from the repository root (the device's working
# tree), never run on its own.

# The GPU host lacks ml_collections: install the carried wheels (WHEELS, .whl) into WHEEL_SITE
# (/tmp/site) and put it on PYTHONPATH. Two call scripts started together on one host (a CPU
# suite beside a GPU job) would each install into the same folder, and pip, moving its copy
# there, fails when the other's is half in place: one installs under a lock while the others
# wait, then find its copy and use it.
ensure_wheels() {
  local wheels=${WHEELS:-.whl} site=${WHEEL_SITE:-/tmp/site}
  if python3 -c "import ml_collections" 2>/dev/null || [ ! -d "$wheels" ]; then
    return 0
  fi
  mkdir -p "$site" || return 1
  (
    flock 9 || exit 1
    PYTHONPATH="$site" python3 -c "import ml_collections" 2>/dev/null ||
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl
  ) 9> "$site.lock" && export PYTHONPATH="$site"
}

# The bench's hard end in minutes (its `pacing.end_by_minutes`): the `timeout` of LIMIT
# seconds less 20 s for its report (at least half a minute). A quality run or speed row still
# starts past pacing.max_minutes when the longest recorded one would end by it, and none
# starts that would not (`pace.may_start`).
end_by_minutes() {
  awk -v l="${LIMIT:-575}" 'BEGIN { e = (l - 20) / 60; print (e > 0.5 ? e : 0.5) }'
}

# The bench's pacing.max_minutes: MAXMIN, but never past the hard end. A short LIMIT (a queue's
# later stage) must shorten it too: the bench sizes a probe's budget by it, and a probe
# sized past the `timeout` is killed midway (a queue stage with 221 s left, given 5.5
# minutes, was).
max_minutes() {
  awk -v m="${MAXMIN:-7.5}" -v e="$(end_by_minutes)" 'BEGIN { print (m < e ? m : e) }'
}

# train_run DIR LOG ARGS...: `experiments.train` of MODEL/PRESET (all Mods) for STEPS (150)
# steps into DIR, a metrics window every 25 steps, no checkpoints, batches made in
# BATCH_WORKERS processes (-1: as many as the step needs; 0: the prefetch thread), killed
# after ARM_LIMIT (240) seconds; its output goes to LOG, ARGS are config overrides (the arm).
train_run() {
  local dir=$1 log=$2; shift 2
  timeout "${ARM_LIMIT:-240}" python3 -m experiments.train --workdir="$dir" \
    --config.run.model="$MODEL" --config.run.preset="$PRESET" --config.run.mods=all \
    --config.run.steps="${STEPS:-150}" --config.train.log_every=25 \
    --config.train.checkpoint_every=0 --config.train.keep_checkpoints=0 \
    --config.train.progress=false --config.train.batch_workers="${BATCH_WORKERS:--1}" \
    "$@" > "$log" 2>&1
}
