//! The routes a block moves along between tiers and the per-route figures (blocks, bytes,
//! busy time) both queues feed.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// The ways a block moves between tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// Host page → device slot (a load).
    HostToDevice,
    /// Device slot → host page (a store).
    DeviceToHost,
    /// Disk entry → host page (a load of a block only on disk).
    DiskToHost,
    /// Host page → disk entry (persistence under the write policy).
    HostToDisk,
    /// Remote value → host page (a load of a block only in the remote tier).
    RemoteToHost,
    /// Host page → remote value (write-behind under the remote write policy; counted by the
    /// remote tier itself, see [`RouteStats::host_to_remote`]).
    HostToRemote,
}

impl Route {
    /// Every route, in a fixed order.
    pub const ALL: [Route; 6] = [
        Route::HostToDevice,
        Route::DeviceToHost,
        Route::DiskToHost,
        Route::HostToDisk,
        Route::RemoteToHost,
        Route::HostToRemote,
    ];

    /// The metric label (`host_to_device`, …).
    pub const fn name(self) -> &'static str {
        match self {
            Route::HostToDevice => "host_to_device",
            Route::DeviceToHost => "device_to_host",
            Route::DiskToHost => "disk_to_host",
            Route::HostToDisk => "host_to_disk",
            Route::RemoteToHost => "remote_to_host",
            Route::HostToRemote => "host_to_remote",
        }
    }

    const fn index(self) -> usize {
        match self {
            Route::HostToDevice => 0,
            Route::DeviceToHost => 1,
            Route::DiskToHost => 2,
            Route::HostToDisk => 3,
            Route::RemoteToHost => 4,
            Route::HostToRemote => 5,
        }
    }
}

/// Totals of one route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RouteFigures {
    /// Blocks moved.
    pub blocks_total: u64,
    /// Bytes moved.
    pub bytes_total: u64,
    /// Nanoseconds worker threads spent moving them.
    pub busy_ns_total: u64,
}

/// Totals of every route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RouteStats {
    /// Host → device.
    pub host_to_device: RouteFigures,
    /// Device → host.
    pub device_to_host: RouteFigures,
    /// Disk → host.
    pub disk_to_host: RouteFigures,
    /// Host → disk.
    pub host_to_disk: RouteFigures,
    /// Remote → host.
    pub remote_to_host: RouteFigures,
    /// Host → remote: the queues do not write to the remote tier (its own write-behind
    /// does), so this is zero until [`RouteStats::with_remote`] fills it from the remote
    /// tier's counters.
    pub host_to_remote: RouteFigures,
}

impl RouteStats {
    /// These figures with `host_to_remote` taken from the remote tier's counters (if any).
    pub fn with_remote(mut self, remote: Option<&kvtier_store::RemoteTierStats>) -> Self {
        if let Some(r) = remote {
            self.host_to_remote = RouteFigures {
                blocks_total: r.written_blocks_total,
                bytes_total: r.written_bytes_total,
                busy_ns_total: r.write_busy_ns_total,
            };
        }
        self
    }

    /// The figures of `route`.
    pub fn get(&self, route: Route) -> RouteFigures {
        match route {
            Route::HostToDevice => self.host_to_device,
            Route::DeviceToHost => self.device_to_host,
            Route::DiskToHost => self.disk_to_host,
            Route::HostToDisk => self.host_to_disk,
            Route::RemoteToHost => self.remote_to_host,
            Route::HostToRemote => self.host_to_remote,
        }
    }
}

/// Route counters shared by both queues.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    counters: [[AtomicU64; 3]; 6],
}

impl Routes {
    pub(crate) fn add(&self, route: Route, blocks: u64, bytes: u64, busy_ns: u64) {
        let c = &self.counters[route.index()];
        c[0].fetch_add(blocks, Ordering::Relaxed);
        c[1].fetch_add(bytes, Ordering::Relaxed);
        c[2].fetch_add(busy_ns, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> RouteStats {
        let f = |r: Route| {
            let c = &self.counters[r.index()];
            RouteFigures {
                blocks_total: c[0].load(Ordering::Relaxed),
                bytes_total: c[1].load(Ordering::Relaxed),
                busy_ns_total: c[2].load(Ordering::Relaxed),
            }
        };
        RouteStats {
            host_to_device: f(Route::HostToDevice),
            device_to_host: f(Route::DeviceToHost),
            disk_to_host: f(Route::DiskToHost),
            host_to_disk: f(Route::HostToDisk),
            remote_to_host: f(Route::RemoteToHost),
            host_to_remote: f(Route::HostToRemote),
        }
    }
}
