#!/usr/bin/env bash
# Regenerates kernels/kv_copy.ptx from kernels/kv_copy.cu with NVRTC, in a venv of its own
# (target/nvrtc-venv, made here with the pip package nvidia-cuda-nvrtc 13.x and xxhash; a
# second run reuses it). No CUDA toolkit or GPU needed.
# Usage: scripts/gen_kernels_ptx.sh [--check | --print-lib]
#   --check      exit 0 if the PTX's header hash matches the .cu, else 1
#   --print-lib  print the NVRTC library path (for KVTIER_NVRTC_LIB)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/nvrtc-venv
pins=("nvidia-cuda-nvrtc==13.0.*" "xxhash")
want=$(echo "${pins[*]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.made" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"
    echo "$want" >"$venv/.made"
    echo "gen_kernels_ptx: venv made in $(($(date +%s) - start)) s" >&2
fi
exec "$venv/bin/python" scripts/gen_kernels_ptx.py "$@"
