//! Clear records: `CLEARED` holds, per namespace, the sequence number of its last clear, so a
//! clear by namespace is durable — recovery skips that namespace's older entries. Written with
//! a checksum, to a temporary file, synced, then renamed over the old one.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use kvtier_core::NamespaceFingerprint;

use crate::StoreError;

const CLEARED_FILE: &str = "CLEARED";

pub(super) fn read_cleared(dir: &Path) -> HashMap<NamespaceFingerprint, u64> {
    let Ok(bytes) = std::fs::read(dir.join(CLEARED_FILE)) else {
        return HashMap::new();
    };
    if bytes.len() < 8 || (bytes.len() - 8) % 24 != 0 {
        tracing::warn!(dir = %dir.display(), "ignoring a damaged CLEARED file");
        return HashMap::new();
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if kvtier_core::xxh3_64(body).to_le_bytes() != sum {
        tracing::warn!(dir = %dir.display(), "ignoring a CLEARED file with a bad checksum");
        return HashMap::new();
    }
    body.chunks_exact(24)
        .map(|c| {
            (
                NamespaceFingerprint(u128::from_le_bytes(c[..16].try_into().expect("16 bytes"))),
                u64::from_le_bytes(c[16..].try_into().expect("8 bytes")),
            )
        })
        .collect()
}

pub(super) fn write_cleared(
    dir: &Path,
    cleared: &HashMap<NamespaceFingerprint, u64>,
) -> Result<(), StoreError> {
    let mut body = Vec::with_capacity(cleared.len() * 24 + 8);
    for (ns, seq) in cleared {
        body.extend_from_slice(&ns.0.to_le_bytes());
        body.extend_from_slice(&seq.to_le_bytes());
    }
    let sum = kvtier_core::xxh3_64(&body);
    body.extend_from_slice(&sum.to_le_bytes());
    let path = dir.join(CLEARED_FILE);
    let tmp = dir.join("CLEARED.tmp");
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_data()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| StoreError::io("write", &path, e))
}
