#!/usr/bin/env bash
# The engine connector tests (python/connector_tests) against a real `kvtier serve`, through
# the engines' own classes: kvtier.integrations.sglang made by SGLang's storage backend factory
# over SGLang's real host KV pools. Needs the heavy venv (sglang + torch, ~6 GiB, made once by
# scripts/sglang_venv.sh under target/), so CI does not run it; run it by hand.
# Usage: scripts/test_connectors.sh [path/to/kvtier] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/kvtier}
shift || true
[ -x "$bin" ] || { echo "test_connectors: $bin: no kvtier binary (cargo build --release first)" >&2; exit 2; }
. scripts/sglang_venv.sh
KVTIER_BIN=$(realpath "$bin") exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/connector_tests "$@"
