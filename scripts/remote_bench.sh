#!/usr/bin/env bash
# `kvtier bench offload --tier remote` against a local Redis Cluster (3 masters + 3 replicas,
# started by scripts/redis_cluster.sh on loopback and stopped by PID when this exits), at the
# peer harness's two block sizes: 128 KiB (1 layer of the default 4 heads x 128 x bf16 x 64
# tokens) and 6 MiB (48 layers).
#
# Then the two-node demo: `kvtier bench serve --remote-nodes`, two engine + sidecar pairs on
# the cluster; node B's TTFT for a 90% prefix node A computed (remote) next to B recomputing
# it, B's own host tier and B's device cache.
#
# Usage: scripts/remote_bench.sh [path/to/kvtier] [-- extra offload bench flags]
#   default: 128 KiB blocks, batches of 16 requests of 10,000 tokens (2,240 hit blocks,
#            280 MiB per batch); 6 MiB blocks, batches of 2 requests of 2,048 tokens (56 hit
#            blocks, 336 MiB per batch); 20 measured rounds each; then the serving demo at
#            batch 4 of 4,096-token prompts (~3 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/kvtier
if [ $# -gt 0 ] && [ "$1" != "--" ]; then bin=$1; shift; fi
[ "${1:-}" = "--" ] && shift
[ -x "$bin" ] || { echo "remote_bench: no $bin (cargo build --release)" >&2; exit 1; }

dir=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-remote-bench.XXXXXX")
trap 'scripts/redis_cluster.sh stop "$dir"; rm -rf "$dir"' EXIT
nodes=$(scripts/redis_cluster.sh start "$dir" --maxmemory 1gb)
echo "remote_bench: cluster $nodes" >&2

echo "== 128 KiB blocks"
"$bin" bench offload --tier remote --remote-nodes "$nodes" "$@"
echo "== 6 MiB blocks"
"$bin" bench offload --tier remote --remote-nodes "$nodes" --layers 48 --tokens 2048 --batch 2 "$@"
echo "== two nodes sharing the cluster: node B serving a prefix node A computed"
"$bin" bench serve --remote-nodes "$nodes" --scenarios recompute,remote,host,hbm
