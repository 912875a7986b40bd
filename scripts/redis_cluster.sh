#!/usr/bin/env bash
# A local Redis Cluster for kvtier's remote tier: 3 masters + 3 replicas of Debian's
# redis-server on loopback, without persistence, evicting allkeys-lru. Tests, benchmarks and
# .ci/run use it; nothing is started by hand.
#
# Usage:
#   scripts/redis_cluster.sh install            installs Debian's redis-server (and redis-cli)
#                                               if missing (root, or sudo without a password)
#   scripts/redis_cluster.sh start DIR [OPTS]   starts the six nodes with their files in DIR
#                                               (made if missing), creates the cluster, waits
#                                               until every node says cluster_state:ok, and
#                                               writes DIR/nodes (the masters' host:port, one
#                                               line each) and DIR/<port>.pid; prints the
#                                               nodes as one comma-separated line
#       --port-base N   client ports N..N+5 and bus ports N+10000..N+10005 (default: a free
#                       base in 11000..15990, so both stay below Linux's ephemeral range
#                       where outgoing connections would take them; retried on a clash)
#       --password P    requirepass/masterauth P on every node
#       --maxmemory M   per node (default 256mb)
#       --tls DIR       TLS only (clients, cluster bus, replication) with DIR/redis-node.pem,
#                       DIR/redis-node.key and DIR/redis-ca.pem (tests/data/tls holds test-only
#                       ones; the bus authenticates both ends, so the node certificate is good
#                       for clientAuth too)
#   scripts/redis_cluster.sh stop DIR           stops every node DIR/*.pid names (by PID) and
#                                               removes DIR's node files
set -euo pipefail

die() { echo "redis_cluster: $*" >&2; exit 1; }

install() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "redis_cluster: installing Debian's redis-server" >&2
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q redis-server >/dev/null 2>&1 ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q redis-server >/dev/null; } ||
        die "could not install redis-server (apt-get failed; run as root or install it)"
    command -v redis-server >/dev/null || die "redis-server is still missing after apt-get"
}

port_free() {
    # Nothing accepts on it (bash's /dev/tcp connect fails).
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

pick_base() {
    local base p ok
    for _ in $(seq 1 50); do
        base=$((11000 + (RANDOM % 500) * 10))
        ok=1
        for p in $(seq "$base" $((base + 5))); do
            port_free "$p" && port_free $((p + 10000)) || { ok=0; break; }
        done
        [ $ok = 1 ] && { echo "$base"; return 0; }
    done
    die "no free port base found in 11000..15990"
}

cli() {
    # redis-cli against PORT with the password and TLS when there are.
    local port=$1; shift
    local tls=()
    [ -n "$tls_dir" ] && tls=(--tls --cacert "$tls_dir/redis-ca.pem")
    if [ -n "$password" ]; then
        REDISCLI_AUTH="$password" redis-cli "${tls[@]}" -p "$port" "$@"
    else
        redis-cli "${tls[@]}" -p "$port" "$@"
    fi
}

start() {
    local dir=$1; shift
    local base="" maxmemory=256mb
    password=""
    tls_dir=""
    while [ $# -gt 0 ]; do
        case $1 in
            --port-base) base=$2; shift 2 ;;
            --password) password=$2; shift 2 ;;
            --maxmemory) maxmemory=$2; shift 2 ;;
            --tls) tls_dir=$(cd "$2" && pwd); shift 2 ;;
            *) die "unknown option $1" ;;
        esac
    done
    install
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    ls "$dir"/*.pid >/dev/null 2>&1 && die "$dir already has running nodes (stop them first)"
    if [ -n "$base" ]; then
        start_nodes "$dir" "$base" "$maxmemory"
    else
        # Another process may take a port between the check and the bind: try other bases.
        local try
        for try in 1 2 3 4 5; do
            start_nodes "$dir" "$(pick_base)" "$maxmemory" && break
            [ $try = 5 ] && die "could not start the nodes (see above)"
        done
    fi
    create_cluster "$dir"
}

# start_nodes DIR BASE MAXMEMORY: the six nodes, each answering PING; on failure they are
# stopped again and the status is 1.
start_nodes() {
    local dir=$1 base=$2 maxmemory=$3
    ports=()
    local p
    for p in $(seq "$base" $((base + 5))); do
        ports+=("$p")
        mkdir -p "$dir/$p"
        local auth=() listen=(--port "$p")
        [ -n "$password" ] && auth=(--requirepass "$password" --masterauth "$password")
        [ -n "$tls_dir" ] && listen=(--port 0 --tls-port "$p" --tls-cluster yes --tls-replication yes
            --tls-auth-clients no --tls-cert-file "$tls_dir/redis-node.pem" --tls-key-file "$tls_dir/redis-node.key"
            --tls-ca-cert-file "$tls_dir/redis-ca.pem")
        setsid redis-server --bind 127.0.0.1 "${listen[@]}" --cluster-port $((p + 10000)) \
            --cluster-enabled yes --cluster-config-file "$dir/$p/nodes.conf" \
            --cluster-node-timeout 2000 --save '' --appendonly no --daemonize no \
            --maxmemory "$maxmemory" --maxmemory-policy allkeys-lru \
            --dir "$dir/$p" --logfile "$dir/$p/redis.log" "${auth[@]}" </dev/null >/dev/null 2>&1 &
        echo $! >"$dir/$p.pid"
    done
    for p in "${ports[@]}"; do
        for _ in $(seq 1 100); do
            cli "$p" ping 2>/dev/null | grep -q PONG && break
            kill -0 "$(cat "$dir/$p.pid")" 2>/dev/null ||
                { grep '#' "$dir/$p/redis.log" >&2; echo "redis_cluster: node $p exited" >&2; stop "$dir"; return 1; }
            sleep 0.05
        done
    done
    # A node that lost its port to another server exits right after binding fails; the PONG
    # may have come from that other server.
    sleep 0.2
    for p in "${ports[@]}"; do
        kill -0 "$(cat "$dir/$p.pid")" 2>/dev/null ||
            { grep '#' "$dir/$p/redis.log" >&2; echo "redis_cluster: node $p exited" >&2; stop "$dir"; return 1; }
    done
}

create_cluster() {
    local dir=$1 p addrs=()
    for p in "${ports[@]}"; do addrs+=("127.0.0.1:$p"); done
    cli "${ports[0]}" --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 ||
        { cat "$dir/create.log" >&2; stop "$dir"; die "cluster create failed"; }
    for p in "${ports[@]}"; do
        for i in $(seq 1 200); do
            cli "$p" cluster info 2>/dev/null | grep -q "cluster_state:ok" && break
            [ "$i" = 200 ] && { stop "$dir"; die "node $p not ok after 20 s"; }
            sleep 0.1
        done
    done
    # Replicas are attached once every master sees one (the failover test relies on them).
    for i in $(seq 1 200); do
        [ "$(cli "${ports[0]}" cluster nodes 2>/dev/null | grep -c ' slave ')" = 3 ] &&
            [ "$(cli "${ports[0]}" info replication 2>/dev/null | grep -c '^slave[0-9]*:.*state=online')" -ge 1 ] && break
        [ "$i" = 200 ] && { stop "$dir"; die "replicas not attached after 20 s"; }
        sleep 0.1
    done
    cli "${ports[0]}" cluster nodes | awk '/master/ && !/fail/ {split($2, a, "@"); print a[1]}' | sort >"$dir/nodes"
    paste -sd, "$dir/nodes"
}

stop() {
    local dir=$1 f pid
    [ -d "$dir" ] || return 0
    for f in "$dir"/*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        kill "$pid" 2>/dev/null || true
    done
    for f in "$dir"/*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$f"
    done
    rm -rf "${dir:?}"/[0-9]* "$dir/nodes" "$dir/create.log"
}

case ${1:-} in
    install) install ;;
    start) [ $# -ge 2 ] || die "usage: $0 start DIR [--port-base N] [--password P] [--maxmemory M]"; start "${@:2}" ;;
    stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
    *) die "usage: $0 install | start DIR [options] | stop DIR" ;;
esac
