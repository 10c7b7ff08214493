# Shared by the GPU call scripts; sourced from the repository root (the device's working
# tree), never run on its own.

# The GPU host lacks ml_collections: install the carried wheel (.whl) into /tmp/site.
ensure_wheels() {
  if ! python3 -c "import ml_collections" 2>/dev/null && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
}

# The bench's hard end in minutes (`--end_by_minutes`): LIMIT seconds less 20 s for its
# report, never before MAXMIN. A quality run or speed row still starts past MAXMIN when the
# longest recorded one would end by it, and none starts that would not (`pace.may_start`).
end_by_minutes() {
  awk -v l="${LIMIT:-575}" -v m="${MAXMIN:-7.5}" 'BEGIN { e = (l - 20) / 60; print (e > m ? e : m) }'
}
