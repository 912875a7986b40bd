//! Snapshots of every counter, published to Prometheus and returned by the Stats RPC.

use std::sync::Arc;

use kvtier_core::Tier;
use kvtier_proto::proto;
use kvtier_store::TieredStoreStats;
use kvtier_transfer::{QueueStats, Route, RouteStats};
use metrics::{counter, gauge};
use serde::Serialize;

use crate::metric_names as m;
use crate::session::SessionStats;
use crate::state::ServerState;

/// Every figure of the sidecar at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// Host and disk tiers.
    pub tiers: TieredStoreStats,
    /// The load queue.
    pub load_queue: QueueStats,
    /// The store queue.
    pub store_queue: QueueStats,
    /// Totals per route.
    pub routes: RouteStats,
    /// Sessions, pools, pins.
    pub sessions: SessionStats,
}

impl Snapshot {
    /// Reads every counter. Cost: a walk over the host tier's page states.
    pub fn take(state: &Arc<ServerState>) -> Self {
        let tiers = state.store.stats();
        Self {
            tiers,
            load_queue: state.queues.load.stats(),
            store_queue: state.queues.store.stats(),
            routes: state.queues.routes().with_remote(tiers.remote.as_ref()),
            sessions: state.sessions.stats(),
        }
    }

    /// Sets every exported metric from this snapshot.
    pub fn publish(&self) {
        for r in Route::ALL {
            let f = self.routes.get(r);
            counter!(m::TRANSFER_BYTES, "route" => r.name()).absolute(f.bytes_total);
            counter!(m::TRANSFER_BLOCKS, "route" => r.name()).absolute(f.blocks_total);
        }
        for (name, q) in [("load", &self.load_queue), ("store", &self.store_queue)] {
            gauge!(m::QUEUE_DEPTH, "queue" => name).set(q.active_requests as f64);
            gauge!(m::QUEUE_INFLIGHT_BYTES, "queue" => name).set(q.inflight_bytes as f64);
            for (outcome, n) in [
                ("completed", q.completed_total),
                ("cancelled", q.cancelled_total),
                ("failed", q.failed_total),
            ] {
                counter!(m::TRANSFER_REQUESTS, "queue" => name, "outcome" => outcome).absolute(n);
            }
        }
        gauge!(m::DISK_PENDING_WRITES).set(self.store_queue.pending_disk_blocks as f64);
        let unsynced = self.tiers.disk.map_or(0, |d| d.unsynced_blocks);
        gauge!(m::NOT_DURABLE_BLOCKS).set((self.store_queue.pending_disk_blocks + unsynced) as f64);
        let h = &self.tiers.host;
        gauge!(m::TIER_USED_BYTES, "tier" => Tier::Host.name())
            .set((u64::from(h.used_pages) * h.page_bytes) as f64);
        gauge!(m::TIER_CAPACITY_BYTES, "tier" => Tier::Host.name())
            .set((u64::from(h.capacity_pages) * h.page_bytes) as f64);
        gauge!(m::TIER_BLOCKS, "tier" => Tier::Host.name()).set(h.resident_blocks as f64);
        gauge!(m::TIER_BLOCKS, "tier" => Tier::Device.name()).set(self.sessions.device_blocks as f64);
        counter!(m::EVICTIONS, "tier" => Tier::Host.name()).absolute(h.evictions_total);
        let s = &self.store_queue;
        counter!(m::DROPPED_STORES, "reason" => "queue_full").absolute(s.rejected_blocks_total);
        counter!(m::DROPPED_STORES, "reason" => "no_space").absolute(s.no_space_blocks_total);
        counter!(m::DROPPED_DISK_WRITES, "reason" => "queue_full").absolute(s.persist_rejected_blocks_total);
        let d = self.tiers.disk;
        gauge!(m::TIER_USED_BYTES, "tier" => Tier::Disk.name()).set(d.map_or(0, |d| d.bytes) as f64);
        gauge!(m::TIER_CAPACITY_BYTES, "tier" => Tier::Disk.name())
            .set(d.map_or(0, |d| d.capacity_bytes) as f64);
        gauge!(m::TIER_BLOCKS, "tier" => Tier::Disk.name()).set(d.map_or(0, |d| d.entries) as f64);
        counter!(m::EVICTIONS, "tier" => Tier::Disk.name())
            .absolute(d.map_or(0, |d| d.reclaimed_entries_total));
        counter!(m::DROPPED_DISK_WRITES, "reason" => "no_space")
            .absolute(d.map_or(0, |d| d.dropped_writes_no_space_total));
        counter!(m::DROPPED_DISK_WRITES, "reason" => "io_error")
            .absolute(d.map_or(0, |d| d.dropped_writes_io_error_total));
        counter!(m::CORRUPT_BLOCKS, "tier" => Tier::Disk.name()).absolute(d.map_or(0, |d| d.corrupt_total));
        // Without a remote tier its series exist at zero, so every family is listed.
        let r = self.tiers.remote.unwrap_or_default();
        for reason in kvtier_store::DropReason::ALL {
            counter!(m::DROPPED_REMOTE_WRITES, "reason" => reason.name()).absolute(r.dropped(reason));
        }
        for (outcome, n) in [
            ("hit", r.hits_total),
            ("miss", r.misses_total),
            ("corrupt", r.corrupt_total),
            ("timeout", r.read_timeouts_total),
            ("error", r.read_errors_total),
        ] {
            counter!(m::REMOTE_READS, "outcome" => outcome).absolute(n);
        }
        counter!(m::REMOTE_DIRECT_READS).absolute(r.direct_reads_total);
        counter!(m::REMOTE_DIRECT_WRITES).absolute(r.direct_writes_total);
        counter!(m::CORRUPT_BLOCKS, "tier" => Tier::Remote.name()).absolute(r.corrupt_total);
        gauge!(m::REMOTE_PENDING_WRITES).set(r.pending_writes as f64);
        gauge!(m::REMOTE_CONNECTED).set(if r.connected { 1.0 } else { 0.0 });
        gauge!(m::PINNED_BLOCKS).set(h.pinned_pages as f64);
        gauge!(m::SESSIONS).set(self.sessions.sessions as f64);
        gauge!(m::POOLS).set(self.sessions.pools as f64);
    }

    /// The Stats RPC's answer.
    pub fn to_proto(&self) -> proto::StatsResponse {
        let h = &self.tiers.host;
        proto::StatsResponse {
            json: serde_json::to_string(self).unwrap_or_default(),
            sessions: self.sessions.sessions,
            pools: self.sessions.pools,
            pinned_blocks: u64::from(h.pinned_pages),
            host_used_bytes: u64::from(h.used_pages) * h.page_bytes,
            host_capacity_bytes: u64::from(h.capacity_pages) * h.page_bytes,
            disk_used_bytes: self.tiers.disk.map_or(0, |d| d.bytes),
            disk_capacity_bytes: self.tiers.disk.map_or(0, |d| d.capacity_bytes),
        }
    }
}
