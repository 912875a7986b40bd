# Sourced by scripts/test_connectors.sh: makes (once) the venv with vllm 0.34.0 (--no-deps: its
# scheduler, KV connector base and KV cache allocation, not its GPU server), the packages those
# import (scripts/vllm-requirements.txt), the kvtier client's packages and the kvtier package
# from python/ (editable). Sets $venv. About 2 min and 6 GiB here (torch and its CUDA libraries).
venv=${VLLM_VENV:-target/vllm-venv}
vllm_version=0.34.0
want="$vllm_version $(cat scripts/vllm-requirements.txt python/requirements-client.txt python/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$venv/.made" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "vllm==$vllm_version"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -r scripts/vllm-requirements.txt -r python/requirements-client.txt 2>&1 |
        grep -v "dependency resolver\|^vllm .* requires " || true
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e ./python
    "$venv/bin/python" -c "import vllm.v1.core.sched.scheduler, kvtier.integrations.vllm" 2>/dev/null
    echo "$want" >"$venv/.made"
    echo "vllm venv: made in $(($(date +%s) - start)) s ($(du -sh "$venv" | cut -f1))" >&2
fi
