#!/bin/bash
# Packs a newer jax for the GPU host, run HERE (where pip reaches an index), never on the device.
# The host holds jax 0.11.2 for CUDA 13 and fetches nothing; jax 0.12's wheels (jaxlib, the
# CUDA plugin and its PJRT library: about 230 MB) are far over one call's 64 MiB. So the wheels
# are unpacked into one xz tar (about a quarter smaller than the wheels) and split into parts
# of PART_MIB; each device call carries one part beside the working tree, and the host keeps
# the parts it was given while it stays warm (experiments/gpu_jax_next_call.sh).
#
#   bash experiments/gpu_jax_next_pack.sh
#
# Environment: JAX (0.12.0.1), FLAX (0.12.12), ORBAX (0.12.8), CUDA (13), PART_MIB (48; the
# working tree takes the rest of a call's 64 MiB; PART_BYTES overrides it), WHEELS (a folder
# of wheels to pack instead of downloading them), DEST (.jaxnext, which .gitignore leaves out).
# Writes DEST/part-NN and DEST/MANIFEST (each part's sha256, then the packed wheels), and
# prints the device calls to make, in order.
set -eu
JAX=${JAX:-0.12.0.1}
CUDA=${CUDA:-13}
DEST=${DEST:-.jaxnext}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
if [ -z "${WHEELS:-}" ]; then
  WHEELS=$STAGE/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "jax==$JAX" "jaxlib==$JAX" \
    "jax-cuda$CUDA-plugin==$JAX" "jax-cuda$CUDA-pjrt==$JAX" "flax==${FLAX:-0.12.12}" \
    "orbax-checkpoint==${ORBAX:-0.12.8}" "ml_collections==1.1.0"
fi
mkdir -p "$STAGE/site"
for wheel in "$WHEELS"/*.whl; do   # what `pip install --target` makes of a wheel
  python3 -m zipfile -e "$wheel" "$STAGE/site"
done
for data in "$STAGE"/site/*.data; do   # a wheel's purelib/platlib files go to the top
  [ -d "$data" ] || continue
  for lib in "$data"/purelib "$data"/platlib; do
    [ -d "$lib" ] && cp -r "$lib"/. "$STAGE/site/"
  done
  rm -rf "$data"
done
rm -rf "$DEST"
mkdir -p "$DEST"
PART_BYTES=${PART_BYTES:-$(( ${PART_MIB:-48} * 1048576 ))}
tar -C "$STAGE/site" -cf - . | xz -T0 -6 | split -b "$PART_BYTES" -d -a 2 - "$DEST/part-"
(cd "$DEST" && sha256sum part-* > MANIFEST)
(cd "$WHEELS" && ls *.whl | sed 's/^/# /') >> "$DEST/MANIFEST"
parts=$(ls "$DEST" | grep -c '^part-')
echo "packed $(ls "$WHEELS" | grep -c '\.whl$') wheels into $parts part(s) under $DEST:"
for part in "$DEST"/part-*; do
  echo "  run: carry [\"$DEST/MANIFEST\", \"$part\"]; command:" \
    "bash experiments/gpu_jax_next_call.sh"
done
echo "the host drops the parts when it goes back (idle): make the calls back to back"
