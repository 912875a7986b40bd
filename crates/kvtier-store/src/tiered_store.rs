//! The tiers of one KV geometry together: the host tier, an optional disk tier, an optional
//! remote tier, and the write policies that decide which blocks go to each.

use kvtier_core::{BlockKey, KvGeometry, NamespaceFingerprint, Tier};
use serde::{Deserialize, Serialize};

use crate::{
    DiskTier, DiskTierConfig, DiskTierStats, HostTier, HostTierConfig, HostTierStats, RecoveryReport,
    RemoteTier, RemoteTierConfig, RemoteTierStats, RemovalFeed, Removed, StoreError,
};

/// Which blocks are written to the disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// Blocks that pass the admission filter (hit at least `admit_min_hits` times while in host
    /// memory) are written when they pass it; the disk keeps them after the host evicts them.
    /// Protects disk bandwidth and endurance from blocks used once. The default.
    #[default]
    WriteThrough,
    /// Every stored block is written right after it reaches host memory.
    All,
    /// Nothing is written; an existing disk tier is only read.
    None,
}

impl std::str::FromStr for WritePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "write_through" | "write-through" => Ok(WritePolicy::WriteThrough),
            "all" => Ok(WritePolicy::All),
            "none" => Ok(WritePolicy::None),
            _ => Err(format!(
                "unknown write policy {s:?} (expected write_through, all or none)"
            )),
        }
    }
}

/// Configuration of a tiered store (plain data; defaults documented per field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TieredStoreConfig {
    /// The host tier.
    pub host: HostTierConfig,
    /// The disk tier; `None` (default) for host memory only.
    pub disk: Option<DiskTierConfig>,
    /// Which blocks go to disk (default `write_through`).
    pub write_policy: WritePolicy,
    /// Hits that admit a block to disk under `write_through` (default 2).
    pub admit_min_hits: u32,
    /// The remote tier (with its own write policy); `None` (default) for none.
    pub remote: Option<RemoteTierConfig>,
}

impl Default for TieredStoreConfig {
    fn default() -> Self {
        Self {
            host: HostTierConfig::default(),
            disk: None,
            write_policy: WritePolicy::default(),
            admit_min_hits: 2,
            remote: None,
        }
    }
}

/// The leading run of keys found in some tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tier of each leading block found, [`Tier::Host`], [`Tier::Disk`] or [`Tier::Remote`]
    /// (a block in no tier ends the run).
    pub tiers: Vec<Tier>,
    /// Blocks this match admitted to disk (write-through): the caller should persist them.
    pub admitted: Vec<BlockKey>,
    /// Blocks this match admitted to the remote tier (write-through): the caller should
    /// write them ([`TieredStore::write_remote`]).
    pub admitted_remote: Vec<BlockKey>,
}

impl PrefixMatch {
    /// Matched blocks in the host tier.
    pub fn host_blocks(&self) -> usize {
        self.tiers.iter().filter(|t| **t == Tier::Host).count()
    }
    /// Matched blocks only on disk.
    pub fn disk_blocks(&self) -> usize {
        self.tiers.iter().filter(|t| **t == Tier::Disk).count()
    }
    /// Matched blocks only in the remote tier.
    pub fn remote_blocks(&self) -> usize {
        self.tiers.iter().filter(|t| **t == Tier::Remote).count()
    }
}

/// What [`TieredStore::clear_tiers`] removed, tier by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClearedBlocks {
    /// Blocks removed from host memory.
    pub host_blocks: u64,
    /// Host blocks kept because they were pinned.
    pub kept_pinned: u64,
    /// Blocks removed from disk.
    pub disk_blocks: u64,
    /// Blocks removed from the remote tier.
    pub remote_blocks: u64,
}

/// Counters of every tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TieredStoreStats {
    /// The host tier.
    pub host: HostTierStats,
    /// The disk tier, if any.
    pub disk: Option<DiskTierStats>,
    /// The remote tier, if any.
    pub remote: Option<RemoteTierStats>,
}

/// The host tier, an optional disk tier, an optional remote tier and the policies between
/// them. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TieredStore {
    host: HostTier,
    disk: Option<DiskTier>,
    write_policy: WritePolicy,
    admit_min_hits: u32,
    remote: Option<RemoteTier>,
    removals: RemovalFeed,
}

impl TieredStore {
    /// Builds the tiers (recovering the disk tier, connecting the remote tier if configured).
    ///
    /// # Blocking
    /// Up to the remote tier's connect timeout.
    ///
    /// # Errors
    /// The host, disk or remote tier's errors.
    pub fn open(
        geometry: KvGeometry,
        config: &TieredStoreConfig,
    ) -> Result<(Self, Option<RecoveryReport>), StoreError> {
        let host = HostTier::new(geometry, &config.host)?;
        let (disk, report) = match &config.disk {
            Some(d) => {
                let (t, r) = DiskTier::open(geometry, d)?;
                (Some(t), Some(r))
            }
            None => (None, None),
        };
        let remote = config
            .remote
            .as_ref()
            .map(|r| RemoteTier::open(geometry, r))
            .transpose()?;
        Ok((
            Self::new(host, disk, config.write_policy, config.admit_min_hits).with_remote(remote),
            report,
        ))
    }

    /// Composes existing tiers.
    pub fn new(
        host: HostTier,
        disk: Option<DiskTier>,
        write_policy: WritePolicy,
        admit_min_hits: u32,
    ) -> Self {
        let removals = RemovalFeed::new();
        // A block leaves kvtier when the last of host and disk drops it. Each tier's hook
        // holds the other weakly (no cycle keeps the tiers alive).
        let disk_ref = disk.as_ref().map(DiskTier::downgrade);
        let host_ref = host.downgrade();
        let feed = removals.clone();
        host.set_eviction_hook(Box::new(move |ns, key| {
            if !feed.watched() {
                return;
            }
            // Called after the eviction, outside the host's allocation lock: the block may be
            // back in host memory (stored again) by now, or on disk.
            let back = host_ref
                .upgrade()
                .is_some_and(|h| h.contains(ns, key) || h.is_writing(key));
            let on_disk = disk_ref
                .as_ref()
                .and_then(|d| d.upgrade())
                .is_some_and(|d| d.contains(ns, key));
            if !back && !on_disk {
                feed.send(Removed::Block(ns, key));
            }
        }));
        if let Some(d) = &disk {
            let host_ref = host.downgrade();
            let feed = removals.clone();
            d.set_reclaim_hook(Box::new(move |ns, key| {
                if feed.watched() && !host_ref.upgrade().is_some_and(|h| h.contains(ns, key)) {
                    feed.send(Removed::Block(ns, key));
                }
            }));
        }
        Self {
            host,
            disk,
            write_policy,
            admit_min_hits: admit_min_hits.max(1),
            remote: None,
            removals,
        }
    }

    /// Blocks leaving kvtier's host and disk tiers ([`RemovalFeed`]): evicted from the last
    /// of them that held them, or cleared. Subscribe to watch.
    pub fn removals(&self) -> &RemovalFeed {
        &self.removals
    }

    /// The same tiers with `remote` as the remote tier.
    pub fn with_remote(mut self, remote: Option<RemoteTier>) -> Self {
        self.remote = remote;
        self
    }

    /// The remote tier, if any.
    pub fn remote(&self) -> Option<&RemoteTier> {
        self.remote.as_ref()
    }

    /// The remote tier if every stored block is to be written to it (its policy `all`).
    pub fn remote_on_store(&self) -> Option<&RemoteTier> {
        self.remote
            .as_ref()
            .filter(|r| r.config().write_policy == WritePolicy::All)
    }

    /// Queues the resident host blocks among `keys` (of `ns`) for the remote tier; returns how
    /// many were queued (the rest are not resident, or dropped and counted by the tier).
    ///
    /// Cost: one pin per key; the writes run in the background.
    pub fn write_remote(&self, ns: NamespaceFingerprint, keys: &[BlockKey]) -> usize {
        let Some(remote) = &self.remote else { return 0 };
        keys.iter()
            .filter_map(|&k| self.host.pin(ns, k))
            .filter_map(|p| remote.write_behind(ns, p).ok())
            .count()
    }

    /// Host memory only.
    pub fn host_only(host: HostTier) -> Self {
        Self::new(host, None, WritePolicy::None, 1)
    }

    /// The host tier.
    pub fn host(&self) -> &HostTier {
        &self.host
    }

    /// The disk tier, if any.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// The geometry of every block.
    pub fn geometry(&self) -> &KvGeometry {
        self.host.geometry()
    }

    /// The write policy.
    pub fn write_policy(&self) -> WritePolicy {
        self.write_policy
    }

    /// Whether every stored block is to be written to disk after it reaches host memory.
    pub fn persists_on_store(&self) -> bool {
        self.disk.is_some() && self.write_policy == WritePolicy::All
    }

    /// The leading run of `keys` found in host memory, on disk or in the remote tier, counting
    /// host hits for the admission filters.
    ///
    /// Cost: one host index lookup per key, one disk index lookup per key not in host memory,
    /// and for the keys past both, one remote lookup each up to the first miss
    /// ([`RemoteTier::match_run`]: network round trips, bounded by its timeout).
    pub fn match_prefix(&self, ns: NamespaceFingerprint, keys: &[BlockKey]) -> PrefixMatch {
        let disk_threshold = match (&self.disk, self.write_policy) {
            (Some(_), WritePolicy::WriteThrough) => self.admit_min_hits,
            _ => 0,
        };
        let remote_threshold = match &self.remote {
            Some(r) if r.config().write_policy == WritePolicy::WriteThrough => {
                r.config().admit_min_hits.max(1)
            }
            _ => 0,
        };
        let (pages, [to_disk, to_remote]) =
            self.host
                .match_prefix_counting(ns, keys, [disk_threshold, remote_threshold]);
        let mut tiers = vec![Tier::Host; pages.len()];
        for &key in &keys[pages.len()..] {
            if self.disk.as_ref().is_some_and(|d| d.contains(ns, key)) {
                tiers.push(Tier::Disk);
            } else if self.host.contains(ns, key) {
                tiers.push(Tier::Host);
            } else {
                break;
            }
        }
        if let Some(r) = &self.remote
            && tiers.len() < keys.len()
        {
            let run = r.match_run(ns, &keys[tiers.len()..]);
            tiers.extend(std::iter::repeat_n(Tier::Remote, run));
        }
        let admitted = match &self.disk {
            Some(d) => to_disk
                .into_iter()
                .map(|i| keys[i])
                .filter(|&k| !d.contains(ns, k))
                .collect(),
            None => Vec::new(),
        };
        let admitted_remote = to_remote.into_iter().map(|i| keys[i]).collect();
        PrefixMatch {
            tiers,
            admitted,
            admitted_remote,
        }
    }

    /// Forgets every block of `ns` (or of all namespaces) in host memory and on disk, except
    /// host blocks pinned right now. Returns blocks removed from host memory and from disk.
    /// The remote tier, shared by the fleet, is cleared only by name
    /// ([`TieredStore::clear_tiers`]).
    ///
    /// # Errors
    /// The disk tier's errors.
    pub fn clear(&self, ns: Option<NamespaceFingerprint>) -> Result<(u64, u64), StoreError> {
        let c = self.clear_tiers(ns, &[Tier::Host, Tier::Disk])?;
        Ok((c.host_blocks, c.disk_blocks))
    }

    /// Forgets every block of `ns` (or of all namespaces) in the `tiers` named, except host
    /// blocks pinned right now; [`Tier::Device`] (engine memory, not the store's) and tiers the
    /// store lacks are passed over. The removal feed hears [`Removed::Cleared`] once if blocks
    /// left host memory or disk, even when a later tier's clear fails.
    ///
    /// # Errors
    /// The disk or remote tier's errors (the tiers before it are cleared by then).
    pub fn clear_tiers(
        &self,
        ns: Option<NamespaceFingerprint>,
        tiers: &[Tier],
    ) -> Result<ClearedBlocks, StoreError> {
        let mut out = ClearedBlocks::default();
        if tiers.contains(&Tier::Host) {
            (out.host_blocks, out.kept_pinned) = self.host.clear(ns);
        }
        let rest = (|| {
            if let Some(d) = self.disk.as_ref().filter(|_| tiers.contains(&Tier::Disk)) {
                out.disk_blocks = d.clear(ns)?;
            }
            if let Some(r) = self.remote.as_ref().filter(|_| tiers.contains(&Tier::Remote)) {
                out.remote_blocks = r.clear(ns)?;
            }
            Ok(())
        })();
        if out.host_blocks + out.disk_blocks > 0 {
            self.removals.send(Removed::Cleared);
        }
        rest.map(|()| out)
    }

    /// Counters of every tier.
    pub fn stats(&self) -> TieredStoreStats {
        TieredStoreStats {
            host: self.host.stats(),
            disk: self.disk.as_ref().map(DiskTier::stats),
            remote: self.remote.as_ref().map(RemoteTier::stats),
        }
    }
}
