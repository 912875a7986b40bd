//! The tiers of one KV geometry together: the host tier, an optional disk tier, and the write
//! policy that decides which blocks go to disk.

use kvtier_core::{BlockKey, KvGeometry, NamespaceFingerprint, Tier};
use serde::{Deserialize, Serialize};

use crate::{
    DiskTier, DiskTierConfig, DiskTierStats, HostTier, HostTierConfig, HostTierStats, RecoveryReport,
    StoreError,
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
}

impl Default for TieredStoreConfig {
    fn default() -> Self {
        Self {
            host: HostTierConfig::default(),
            disk: None,
            write_policy: WritePolicy::default(),
            admit_min_hits: 2,
        }
    }
}

/// The leading run of keys found in some tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tier of each leading block found, [`Tier::Host`] or [`Tier::Disk`] (a block in no tier
    /// ends the run).
    pub tiers: Vec<Tier>,
    /// Blocks this match admitted to disk (write-through): the caller should persist them.
    pub admitted: Vec<BlockKey>,
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
}

/// Counters of every tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TieredStoreStats {
    /// The host tier.
    pub host: HostTierStats,
    /// The disk tier, if any.
    pub disk: Option<DiskTierStats>,
}

/// The host tier, an optional disk tier and the policy between them. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TieredStore {
    host: HostTier,
    disk: Option<DiskTier>,
    write_policy: WritePolicy,
    admit_min_hits: u32,
}

impl TieredStore {
    /// Builds the tiers (recovering the disk tier if configured).
    ///
    /// # Errors
    /// The host or disk tier's errors.
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
        Ok((
            Self::new(host, disk, config.write_policy, config.admit_min_hits),
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
        Self {
            host,
            disk,
            write_policy,
            admit_min_hits: admit_min_hits.max(1),
        }
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

    /// The leading run of `keys` found in host memory or on disk, counting host hits for the
    /// admission filter.
    ///
    /// Cost: one host index lookup per key, one disk index lookup per key not in host memory.
    pub fn match_prefix(&self, ns: NamespaceFingerprint, keys: &[BlockKey]) -> PrefixMatch {
        let threshold = match (&self.disk, self.write_policy) {
            (Some(_), WritePolicy::WriteThrough) => self.admit_min_hits,
            _ => 0,
        };
        let (pages, reached) = self.host.match_prefix_counting(ns, keys, threshold);
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
        let admitted = match &self.disk {
            Some(d) => reached
                .into_iter()
                .map(|i| keys[i])
                .filter(|&k| !d.contains(ns, k))
                .collect(),
            None => Vec::new(),
        };
        PrefixMatch { tiers, admitted }
    }

    /// Forgets every block of `ns` (or of all namespaces) in every tier, except host blocks
    /// pinned right now. Returns blocks removed from host memory and from disk.
    ///
    /// # Errors
    /// The disk tier's errors.
    pub fn clear(&self, ns: Option<NamespaceFingerprint>) -> Result<(u64, u64), StoreError> {
        let (host, _) = self.host.clear(ns);
        let disk = match &self.disk {
            Some(d) => d.clear(ns)?,
            None => 0,
        };
        Ok((host, disk))
    }

    /// Counters of every tier.
    pub fn stats(&self) -> TieredStoreStats {
        TieredStoreStats {
            host: self.host.stats(),
            disk: self.disk.as_ref().map(DiskTier::stats),
        }
    }
}
