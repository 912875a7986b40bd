#!/usr/bin/env bash
# The engine connector tests (python/connector_tests) against a real `kvtier serve`, through
# the engines' own classes: kvtier.integrations.sglang made by SGLang's storage backend factory
# over SGLang's real host KV pools, and kvtier.integrations.vllm made by vLLM's real Scheduler
# with vLLM's own CPU KV caches. Needs two heavy venvs (sglang + torch and vllm + torch, ~6 GiB
# each, made once by scripts/sglang_venv.sh and scripts/vllm_venv.sh under target/), so CI does
# not run it; run it by hand.
# Usage: scripts/test_connectors.sh [path/to/kvtier] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/kvtier}
shift || true
[ -x "$bin" ] || { echo "test_connectors: $bin: no kvtier binary (cargo build --release first)" >&2; exit 2; }
export KVTIER_BIN=$(realpath "$bin")
. scripts/sglang_venv.sh
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/connector_tests/test_sglang_hicache.py "$@" || rc=$?
# The vLLM connector in its own venv (vllm 0.34.0 + torch, ~6 GiB, scripts/vllm_venv.sh).
. scripts/vllm_venv.sh
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/connector_tests/test_vllm_connector.py "$@" || rc=$?
exit $rc
