#!/usr/bin/env bash
# Put/get throughput from Python: the kvtier package against Redis on the same bytes in the
# same run (scripts/python_bench.py says what is measured). Makes the venv target/bench-venv
# (python/requirements-client.txt + python/requirements-bench.txt + the package from python/,
# editable) when its inputs changed, installs Debian's redis-server if there is none, starts
# two `kvtier serve` sidecars on Unix sockets in a temp dir — one per block size: 128 KiB
# blocks (1 layer of the default 4 heads x 128 x bf16 x 64 tokens) and 6 MiB blocks (the
# default 48 layers) — and a redis-server on a loopback port without persistence, runs the
# benchmark, and stops the three by PID.
#
# Usage: scripts/python_bench.sh [--full] [path/to/kvtier] [-- python_bench.py args...]
#   default: 256 MiB per client, 5 passes, clients 1 and 4, batches of 128 x 128 KiB and
#            4 x 6 MiB blocks (16 / 24 MiB per call), plus a one-block-per-call reference
#            (~2 min on 2 cores; ~5 GiB of memory);
#   --full:  512 MiB per client, 9 passes, clients 1, 2 and 4 (~11 GiB of memory).
#   Arguments after -- go to python_bench.py (e.g. -- --batch 16 --no-pipeline).
# Environment: BENCH_VENV (default target/bench-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
if [ "${1:-}" = "--full" ]; then full=1; shift; fi
bin=target/release/kvtier
if [ $# -gt 0 ] && [ "$1" != "--" ]; then bin=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
[ -x "$bin" ] || { echo "python_bench: $bin: no kvtier binary (cargo build --release first)" >&2; exit 2; }
bin=$(realpath "$bin")

venv=${BENCH_VENV:-target/bench-venv}
want=$(cat python/requirements-client.txt python/requirements-bench.txt python/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    start=$(date +%s%N)
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        -r python/requirements-client.txt -r python/requirements-bench.txt
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e ./python
    echo "$want" >"$venv/.requirements"
    ms=$((($(date +%s%N) - start) / 1000000))
    echo "python_bench: venv $venv made in $((ms / 1000)).$((ms % 1000 / 100)) s" >&2
fi

if ! command -v redis-server >/dev/null; then
    echo "python_bench: installing Debian's redis-server" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q redis-server >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }
fi

. scripts/lib.sh
start_processes python-bench

if [ $full = 1 ]; then
    ws=512; reps=9; clients=1,2,4; capacity=2304MiB
else
    ws=256; reps=5; clients=1,4; capacity=1280MiB   # 4 clients x 256 MiB (6 MiB: 4 x 288 MiB)
fi
# Host capacity covers every client's working set; the transfer threads are the default (one
# per CPU). 128 KiB blocks: 1 layer x 2 x 64 tokens x 4 heads x 128 x 2 bytes (bf16);
# 6 MiB blocks: the same with the default 48 layers.
for name in 128k:1 6m:48; do
    "$bin" serve --socket "$work/kvtier-${name%%:*}.sock" --metrics off --host-capacity "$capacity" \
        --set model.layers="${name##*:}" --set model.kv_heads=4 --set model.head_dim=128 \
        --set model.dtype=bf16 --set model.block_tokens=64 >"$work/serve-${name%%:*}.log" 2>&1 &
    pids+=($!)
    wait_for "$work/serve-${name%%:*}.log" "kvtier: serving" "${pids[-1]}"
done
rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --bind 127.0.0.1 --port "$rport" --save '' --appendonly no --daemonize no \
    --dir "$work" --logfile "$work/redis.log" &
pids+=($!)
for _ in $(seq 1 100); do
    "$venv/bin/python" -c "import redis,sys; redis.Redis(port=$rport).ping()" 2>/dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$work/redis.log" >&2; exit 1; }
    sleep 0.1
done

"$venv/bin/python" scripts/python_bench.py --kvtier "unix://$work/kvtier-128k.sock" \
    --kvtier "unix://$work/kvtier-6m.sock" --redis-port "$rport" --ws "$ws" --reps "$reps" \
    --clients "$clients" --detail "$@"
