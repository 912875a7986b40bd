#!/usr/bin/env bash
# Regenerates the Python client's gRPC stubs (python/kvtier/_proto/) from
# proto/kvtier/v1/kvtier.proto with grpcio-tools, or with --check verifies that the stubs in the
# tree are exactly what the proto gives (exit 1 and a diff when they are not).
#
# The generator is grpcio-tools as pinned in python/requirements-client.txt; its Python is
# $PYTHON, else target/pyclient-venv/bin/python, else python3. Another grpcio-tools version
# writes other version stamps, so --check with it reports a difference: use the pinned one.
# Usage: scripts/gen_python_stubs.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
case "${1:-}" in
    --check) check=1 ;;
    "") ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
py=${PYTHON:-}
if [ -z "$py" ]; then
    if [ -x target/pyclient-venv/bin/python ]; then py=target/pyclient-venv/bin/python; else py=python3; fi
fi
"$py" -c 'import grpc_tools' 2>/dev/null || {
    echo "gen_python_stubs: $py has no grpcio-tools (pip install -r python/requirements-client.txt)" >&2
    exit 2
}
dest=python/kvtier/_proto
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# -I proto keeps the descriptor's file name kvtier/v1/kvtier.proto (what the server's
# reflection serves); the modules land in $tmp/kvtier/v1/.
"$py" -m grpc_tools.protoc -I proto --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
    proto/kvtier/v1/kvtier.proto
mkdir -p "$tmp/out"
for f in kvtier_pb2.py kvtier_pb2.pyi kvtier_pb2_grpc.py; do
    # The generated import names the proto's package path (kvtier.v1); inside this Python
    # package the stubs import each other relatively.
    sed -e 's/^from kvtier\.v1 import kvtier_pb2 as /from . import kvtier_pb2 as /' \
        "$tmp/kvtier/v1/$f" >"$tmp/out/$f"
done
if grep -q '^from kvtier\.v1\|^import kvtier' "$tmp/out/"*.py; then
    echo "gen_python_stubs: an absolute import of the proto package is left in the stubs" >&2
    exit 1
fi
if [ "$check" = 1 ]; then
    status=0
    for f in kvtier_pb2.py kvtier_pb2.pyi kvtier_pb2_grpc.py; do
        if ! diff -u "$dest/$f" "$tmp/out/$f" >"$tmp/diff" 2>&1; then
            echo "gen_python_stubs: $dest/$f differs from what proto/kvtier/v1/kvtier.proto gives:" >&2
            head -40 "$tmp/diff" >&2
            status=1
        fi
    done
    [ "$status" = 0 ] && echo "gen_python_stubs: $dest matches proto/kvtier/v1/kvtier.proto"
    exit "$status"
fi
mkdir -p "$dest"
cp "$tmp/out/"* "$dest/"
echo "gen_python_stubs: wrote $dest/{kvtier_pb2.py,kvtier_pb2.pyi,kvtier_pb2_grpc.py}"
