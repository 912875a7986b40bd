#!/usr/bin/env bash
# The Python tests (python/tests) against real kvtier processes, in a venv of their own
# (target/venv, made here from python/requirements-test.txt and requirements-client.txt, with
# the kvtier package from python/ installed editable; a second run reuses it).
# Usage: scripts/test_python.sh [path/to/kvtier] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/debug/kvtier}
shift || true
[ -x "$bin" ] || { echo "test_python: $bin: no kvtier binary (cargo build first)" >&2; exit 2; }
venv=target/venv
want=$(cat python/requirements-test.txt python/requirements-client.txt python/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -r python/requirements-test.txt -r python/requirements-client.txt
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e ./python
    echo "$want" >"$venv/.requirements"
    echo "test_python: venv made in $(($(date +%s) - start)) s" >&2
fi
KVTIER_BIN=$(realpath "$bin") exec "$venv/bin/python" -m pytest -q python/tests "$@"
