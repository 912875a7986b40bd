# Sourced by scripts/sglang_bench.sh and scripts/test_connectors.sh: makes (once) the venv with
# sglang 0.5.14 (--no-deps: its benchmark client and memory pools, not its GPU server), the
# packages those import (scripts/sglang-requirements.txt), the kvtier client's packages and
# the kvtier package from python/ (editable). Sets $venv.
venv=${SGLANG_VENV:-target/sglang-venv}
sglang_version=0.5.14
want="$sglang_version $(cat scripts/sglang-requirements.txt python/requirements-client.txt python/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$venv/.made" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "sglang==$sglang_version"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -r scripts/sglang-requirements.txt -r python/requirements-client.txt 2>&1 |
        grep -v "dependency resolver\|^sglang .* requires " || true
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e ./python
    "$venv/bin/python" -m sglang.bench_serving --help >/dev/null
    echo "$want" >"$venv/.made"
    echo "sglang venv: made in $(($(date +%s) - start)) s ($(du -sh "$venv" | cut -f1))" >&2
fi
