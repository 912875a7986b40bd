//! Every Prometheus metric kvtier exports, defined in one place. Names carry the `kvtier_`
//! prefix and their unit; labels stay low-cardinality (tier, route, queue, reason, method,
//! code). `deploy/grafana/kvtier.json` is built on exactly these names.

/// Blocks looked up by Match requests.
pub const MATCH_LOOKUPS: &str = "kvtier_match_lookup_blocks_total";
/// Blocks Match found, by `tier` (device, host, disk, remote).
pub const MATCH_HITS: &str = "kvtier_match_hit_blocks_total";
/// Bytes moved, by `route` (host_to_device, device_to_host, disk_to_host, host_to_disk,
/// remote_to_host, host_to_remote).
pub const TRANSFER_BYTES: &str = "kvtier_transfer_bytes_total";
/// Blocks moved, by `route`.
pub const TRANSFER_BLOCKS: &str = "kvtier_transfer_blocks_total";
/// Seconds from a transfer's first copy to its last, histogram by `route` (host_to_device for
/// loads, device_to_host for stores).
pub const TRANSFER_SECONDS: &str = "kvtier_transfer_seconds";
/// Requests queued or running, by `queue` (load, store).
pub const QUEUE_DEPTH: &str = "kvtier_queue_depth";
/// Bytes admitted and not yet finished, by `queue`.
pub const QUEUE_INFLIGHT_BYTES: &str = "kvtier_queue_inflight_bytes";
/// Transfer requests that ended, by `queue` and `outcome` (completed, cancelled: the requester
/// went away or its deadline passed, failed).
pub const TRANSFER_REQUESTS: &str = "kvtier_transfer_requests_total";
/// Blocks acknowledged to engines whose disk write (under the write policy) has not finished.
pub const DISK_PENDING_WRITES: &str = "kvtier_disk_pending_write_blocks";
/// Blocks acknowledged to engines on their way to disk that a crash or power cut could still
/// lose: waiting for their disk write, or written and not yet fdatasynced. Durable stores
/// reply only once theirs left this count.
pub const NOT_DURABLE_BLOCKS: &str = "kvtier_acknowledged_not_durable_blocks";
/// Bytes of blocks held, by `tier` (host, disk).
pub const TIER_USED_BYTES: &str = "kvtier_tier_used_bytes";
/// Bytes a tier may hold, by `tier`.
pub const TIER_CAPACITY_BYTES: &str = "kvtier_tier_capacity_bytes";
/// Blocks held, by `tier` (device: reported by engines).
pub const TIER_BLOCKS: &str = "kvtier_tier_blocks";
/// Blocks evicted to make room, by `tier` (host; disk counts reclaimed blocks).
pub const EVICTIONS: &str = "kvtier_evictions_total";
/// Store blocks dropped, by `reason` (queue_full, no_space).
pub const DROPPED_STORES: &str = "kvtier_dropped_stores_total";
/// Disk writes dropped, by `reason` (queue_full, no_space, io_error).
pub const DROPPED_DISK_WRITES: &str = "kvtier_dropped_disk_writes_total";
/// Blocks found corrupt (dropped, never served), by `tier` (disk, remote).
pub const CORRUPT_BLOCKS: &str = "kvtier_corrupt_blocks_total";
/// Remote-tier writes dropped, by `reason` (queue_full, unavailable, timeout, error).
pub const DROPPED_REMOTE_WRITES: &str = "kvtier_dropped_remote_writes_total";
/// Remote-tier block reads, by `outcome` (hit, miss, corrupt, timeout, error).
pub const REMOTE_READS: &str = "kvtier_remote_reads_total";
/// Remote-tier block reads answered straight off the owning master's socket (the rest of
/// `kvtier_remote_reads_total` went through the cluster client: TLS, a redirection, a master
/// that failed).
pub const REMOTE_DIRECT_READS: &str = "kvtier_remote_direct_reads_total";
/// Remote-tier blocks written straight from the host page to the owning master's socket (the
/// rest of route `host_to_remote` went through the cluster client).
pub const REMOTE_DIRECT_WRITES: &str = "kvtier_remote_direct_writes_total";
/// Blocks waiting for their remote-tier write (each holds its host page pinned).
pub const REMOTE_PENDING_WRITES: &str = "kvtier_remote_pending_write_blocks";
/// 1 while the remote tier's cluster is connected, 0 while it is not (or there is none).
pub const REMOTE_CONNECTED: &str = "kvtier_remote_connected";
/// Load blocks in no tier (reported to the engine, which recomputes them).
pub const MISSING_BLOCKS: &str = "kvtier_load_missing_blocks_total";
/// Blocks pinned now (transfers and soft pins).
pub const PINNED_BLOCKS: &str = "kvtier_pinned_blocks";
/// Open sessions.
pub const SESSIONS: &str = "kvtier_sessions";
/// Registered device pools.
pub const POOLS: &str = "kvtier_pools";
/// 1 when this sidecar can serve CUDA pools (a driver and a GPU), 0 when not (its start-up
/// log says why).
pub const CUDA_AVAILABLE: &str = "kvtier_cuda_available";
/// Bytes of the host tier page-locked for GPU copies (0 without CUDA or when pinning failed).
pub const HOST_PINNED_BYTES: &str = "kvtier_host_pinned_bytes";
/// Times pinning the host tier for GPU copies was refused (copies then use pageable memory).
pub const HOST_PIN_FAILURES: &str = "kvtier_host_pin_failures_total";
/// gRPC requests, by `method` and `code`.
pub const GRPC_REQUESTS: &str = "kvtier_grpc_requests_total";
/// gRPC request handling seconds (to the first response message), histogram by `method`.
pub const GRPC_SECONDS: &str = "kvtier_grpc_request_seconds";

/// Every name, for documentation and the dashboard test.
pub const ALL: &[&str] = &[
    MATCH_LOOKUPS,
    MATCH_HITS,
    TRANSFER_BYTES,
    TRANSFER_BLOCKS,
    TRANSFER_SECONDS,
    QUEUE_DEPTH,
    QUEUE_INFLIGHT_BYTES,
    TRANSFER_REQUESTS,
    DISK_PENDING_WRITES,
    NOT_DURABLE_BLOCKS,
    TIER_USED_BYTES,
    TIER_CAPACITY_BYTES,
    TIER_BLOCKS,
    EVICTIONS,
    DROPPED_STORES,
    DROPPED_DISK_WRITES,
    CORRUPT_BLOCKS,
    DROPPED_REMOTE_WRITES,
    REMOTE_READS,
    REMOTE_DIRECT_READS,
    REMOTE_DIRECT_WRITES,
    REMOTE_PENDING_WRITES,
    REMOTE_CONNECTED,
    MISSING_BLOCKS,
    PINNED_BLOCKS,
    SESSIONS,
    POOLS,
    CUDA_AVAILABLE,
    HOST_PINNED_BYTES,
    HOST_PIN_FAILURES,
    GRPC_REQUESTS,
    GRPC_SECONDS,
];

/// Creates the series that events (not the periodic snapshot) update, at zero: Match
/// lookups and hits by tier, missing blocks, transfer times by route, and every gRPC
/// method's requests by code. A fresh sidecar's `/metrics` lists every family.
pub fn register_event_series() {
    use metrics::{counter, histogram};
    counter!(MATCH_LOOKUPS).increment(0);
    for tier in kvtier_core::Tier::ALL {
        counter!(MATCH_HITS, "tier" => tier.name()).increment(0);
    }
    counter!(MISSING_BLOCKS).increment(0);
    // The routes whose transfers the handlers time.
    for route in [
        kvtier_transfer::Route::DeviceToHost,
        kvtier_transfer::Route::HostToDevice,
    ] {
        let _ = histogram!(TRANSFER_SECONDS, "route" => route.name());
    }
    crate::service::register_request_series();
}

/// Registers help texts with the recorder.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(MATCH_LOOKUPS, "Blocks looked up by Match requests");
    describe_counter!(MATCH_HITS, "Blocks Match found, by tier");
    describe_counter!(TRANSFER_BYTES, Unit::Bytes, "Bytes moved, by route");
    describe_counter!(TRANSFER_BLOCKS, "Blocks moved, by route");
    describe_histogram!(
        TRANSFER_SECONDS,
        Unit::Seconds,
        "First copy to last copy of a transfer, by route"
    );
    describe_gauge!(QUEUE_DEPTH, "Requests queued or running, by queue");
    describe_gauge!(
        QUEUE_INFLIGHT_BYTES,
        Unit::Bytes,
        "Bytes admitted and not finished, by queue"
    );
    describe_counter!(
        TRANSFER_REQUESTS,
        "Transfer requests that ended, by queue and outcome"
    );
    describe_gauge!(
        DISK_PENDING_WRITES,
        "Acknowledged blocks waiting for their disk write"
    );
    describe_gauge!(
        NOT_DURABLE_BLOCKS,
        "Acknowledged blocks on their way to disk not yet durable: waiting for their write, or written and not fdatasynced"
    );
    describe_gauge!(TIER_USED_BYTES, Unit::Bytes, "Bytes of blocks held, by tier");
    describe_gauge!(TIER_CAPACITY_BYTES, Unit::Bytes, "Bytes a tier may hold");
    describe_gauge!(TIER_BLOCKS, "Blocks held, by tier");
    describe_counter!(EVICTIONS, "Blocks evicted to make room, by tier");
    describe_counter!(DROPPED_STORES, "Store blocks dropped, by reason");
    describe_counter!(DROPPED_DISK_WRITES, "Disk writes dropped, by reason");
    describe_counter!(CORRUPT_BLOCKS, "Blocks found corrupt, by tier");
    describe_counter!(DROPPED_REMOTE_WRITES, "Remote-tier writes dropped, by reason");
    describe_counter!(REMOTE_READS, "Remote-tier block reads, by outcome");
    describe_counter!(
        REMOTE_DIRECT_READS,
        "Remote-tier block reads answered straight off the owning master's socket"
    );
    describe_counter!(
        REMOTE_DIRECT_WRITES,
        "Remote-tier blocks written straight from the host page to the owning master's socket"
    );
    describe_gauge!(
        REMOTE_PENDING_WRITES,
        "Blocks waiting for their remote-tier write"
    );
    describe_gauge!(REMOTE_CONNECTED, "1 while the remote tier's cluster is connected");
    describe_counter!(MISSING_BLOCKS, "Load blocks in no tier");
    describe_gauge!(PINNED_BLOCKS, "Blocks pinned now");
    describe_gauge!(SESSIONS, "Open sessions");
    describe_gauge!(POOLS, "Registered device pools");
    describe_gauge!(CUDA_AVAILABLE, "1 when CUDA pools can be served");
    describe_gauge!(
        HOST_PINNED_BYTES,
        Unit::Bytes,
        "Host tier bytes page-locked for GPU copies"
    );
    describe_counter!(HOST_PIN_FAILURES, "Refused pinnings of the host tier");
    describe_counter!(GRPC_REQUESTS, "gRPC requests, by method and code");
    describe_histogram!(
        GRPC_SECONDS,
        Unit::Seconds,
        "gRPC request handling time, by method"
    );
}
