//! Which tier a block is in: the one name every layer uses (the store's lookups, the
//! sidecar's Match replies, the engine's hits, the benchmarks' `--tier`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A tier, fastest first: the engine's device memory, kvtier's host memory, its local disk, a
/// remote store shared by a fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The engine's device pool (HBM): a hit there needs no copy.
    Device,
    /// kvtier's host memory: a load is one copy to the device.
    Host,
    /// kvtier's local disk: a load reads the block into a host page first.
    Disk,
    /// A remote store (Redis Cluster) every node shares: a load fetches the block into a host
    /// page first.
    Remote,
}

impl Tier {
    /// Every tier, in lookup order.
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::Remote];

    /// The lowercase name (`device`, `host`, `disk`, `remote`), as flags, JSON and metric labels write it.
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tier {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown tier {s:?}: choose device, host, disk or remote"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for t in Tier::ALL {
            assert_eq!(t.name().parse::<Tier>(), Ok(t));
            assert_eq!(serde_json::to_string(&t).unwrap(), format!("\"{t}\""));
        }
        assert!(
            "ssd"
                .parse::<Tier>()
                .unwrap_err()
                .contains("device, host, disk or remote")
        );
    }
}
