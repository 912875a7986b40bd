#!/usr/bin/env bash
# Everything GPU-side in one run, for a machine with an NVIDIA GPU, the CUDA driver and Python
# with PyTorch, but possibly no Rust toolchain and no network:
#   - the CUDA pool's tests (the pool contract in the kvtier, vLLM and SGLang layouts with
#     each copy method; store → scrub → load through the real queues; bad pools refused);
#   - the IPC test: PyTorch allocates KV in vLLM's layout in another process, the sidecar
#     opens its handles, store → zero the tensors → load is checked bit-exact, then that
#     engine dies and the next one is served;
#   - the same from the Python package (scripts/gpu/in_place_cuda.py): PyTorch KV registered in
#     place by kvtier.integrations.in_place, as the vLLM connector's worker does;
#   - the connector's staging copies (scripts/gpu/staged_copies_cuda.py): each layer copied out
#     on the copy stream into the pinned staging pool after the GPU work writing it, and back;
#   - `kvtier bench offload --device cuda` for kvtier's and vLLM's layouts (128 KiB
#     block-layers, Qwen3-30B-A3B geometry), with the pinned cudaMemcpyAsync baselines and
#     ratios, each copy method for vLLM's split K/V planes, vLLM >= 0.34's interleaved
#     LBNHC layout (the run kernel against cuMemcpyAsync per run), and an equal-bytes duplex
#     run.
#
# Usage:
#   scripts/gpu-check.sh bundle       (on a build machine) builds the release binaries and
#                                     copies them, stripped, to target/gpu-bundle/ (carry that
#                                     path to the GPU machine)
#   scripts/gpu-check.sh [run] [DIR]  (on the GPU machine) runs everything from DIR
#                                     (default target/gpu-bundle; built first when cargo is
#                                     here and DIR is missing)
# Environment: KVTIER_TORCH_PYTHON (python with torch, default python3), ROUNDS (measured
# batches per benchmark run, default 30), KVTIER_NVRTC_LIB (an NVRTC library to compile the
# copy kernel with; otherwise the driver loads the kept PTX).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
bundle=${2:-target/gpu-bundle}

make_bundle() {
    local start
    start=$(date +%s)
    cargo build --release --bin kvtier
    # The test binaries: cargo prints each one's path as JSON.
    local tests
    tests=$(cargo test --release --no-run --message-format=json -p kvtier-cuda --test cuda_pool -p kvtier --test cuda_ipc 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda_pool", "cuda_ipc"):
        print(m["target"]["name"], m["executable"])')
    rm -rf "$bundle"
    mkdir -p "$bundle"
    strip -o "$bundle/kvtier" target/release/kvtier
    while read -r name exe; do strip -o "$bundle/$name" "$exe"; done <<<"$tests"
    cp scripts/gpu/torch_kv_pool.py scripts/gpu/in_place_cuda.py scripts/gpu/staged_copies_cuda.py "$bundle/"
    # The Python package and its runtime wheels (the GPU machine has Python 3.12, no network).
    mkdir -p "$bundle/python" "$bundle/wheels"
    (cd python && find kvtier -name '*.py' -o -name py.typed) | while read -r f; do
        mkdir -p "$bundle/python/$(dirname "$f")"; cp "python/$f" "$bundle/python/$f"; done
    python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
        --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$bundle/wheels" \
        $(grep -E '^(grpcio|protobuf|xxhash|numpy)==' python/requirements-client.txt)
    [ -x "$bundle/cuda_pool" ] && [ -x "$bundle/cuda_ipc" ] || { echo "gpu-check: test binaries missing from $bundle" >&2; exit 1; }
    echo "gpu-check: bundle in $bundle ($(du -sh "$bundle" | cut -f1)) made in $(($(date +%s) - start)) s" >&2
}

case "$mode" in
    bundle) make_bundle; exit 0 ;;
    run) ;;
    *) echo "usage: $0 [bundle | run [DIR]]" >&2; exit 2 ;;
esac
if [ ! -x "$bundle/kvtier" ]; then
    command -v cargo >/dev/null || { echo "gpu-check: no $bundle/kvtier and no cargo to build it (run '$0 bundle' where Rust is, and carry $bundle)" >&2; exit 2; }
    make_bundle
fi
export KVTIER_TORCH_PYTHON=${KVTIER_TORCH_PYTHON:-python3}
export KVTIER_TORCH_SCRIPT=$bundle/torch_kv_pool.py
rounds=${ROUNDS:-30}
start=$(date +%s)
status=0
step() { echo; echo "== $*"; }

step "GPU"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
"$KVTIER_TORCH_PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' || status=1

step "CUDA pool tests (every layout and copy method)"
"$bundle/cuda_pool" --include-ignored --test-threads 1 2>&1 || status=1

step "IPC test: a PyTorch pool in vLLM's layout from another process"
"$bundle/cuda_ipc" --include-ignored --nocapture 2>&1 | grep -v "^$" || status=1

step "Python: KV allocated by PyTorch registered in place (the vLLM connector's CUDA path)"
pydeps=$(mktemp -d)
# The wheels unpacked onto PYTHONPATH (numpy only where torch's Python has none).
"$KVTIER_TORCH_PYTHON" - "$bundle/wheels" "$pydeps" <<'EOF' || status=1
import glob, importlib.util, sys, zipfile
for w in sorted(glob.glob(sys.argv[1] + "/*.whl")):
    if w.rsplit("/", 1)[-1].startswith("numpy-") and importlib.util.find_spec("numpy"):
        continue
    zipfile.ZipFile(w).extractall(sys.argv[2])
EOF
PYTHONPATH="$pydeps:$bundle/python" "$KVTIER_TORCH_PYTHON" "$bundle/in_place_cuda.py" "$bundle/kvtier" 2>&1 || status=1
step "Python: the staging copies (the vLLM connector's path where KV cannot be reached in place)"
PYTHONPATH="$pydeps:$bundle/python" "$KVTIER_TORCH_PYTHON" "$bundle/staged_copies_cuda.py" 2>&1 || status=1
rm -rf "$pydeps"

bench() {
    step "bench offload --device cuda $*"
    "$bundle/kvtier" bench offload --device cuda --rounds "$rounds" "$@" 2>&1 | grep -v "offload \[" || status=1
}
# Seed 003's workload: 10,000-token requests, 90% hit, batches of 16, 128 KiB block-layers.
bench --layout kvtier
bench --layout vllm
bench --layout vllm --cuda-copy memcpy
bench --layout vllm --cuda-copy kernel
bench --layout kvtier --cuda-copy kernel
# vLLM >= 0.34's K||V rows: kvtier_copy_runs (auto) against one cuMemcpyAsync per run.
bench --layout vllm-lbnhc
bench --layout vllm-lbnhc --cuda-copy memcpy
# As many bytes each way: the duplex figure against one direction.
bench --layout vllm --hit-rate 0.5

echo
echo "gpu-check: $([ $status = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - start)) s"
exit $status
