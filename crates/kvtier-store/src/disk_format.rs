//! The on-disk format of the disk tier: region headers, entry headers and region index files.
//! All integers little-endian; every structure carries its own xxh3-64 checksum.
//!
//! ```text
//! region file  = region header (4 KiB) + slots × entry
//! entry        = entry header (4 KiB) + payload (one host page: the block, layer-major,
//!                padded to 4 KiB)
//! region index = written when a region is full (or at shutdown): the entries it holds, so a
//!                restart reads one small file per region instead of every header
//! ```

use kvtier_core::xxh3_64;
use kvtier_core::{BlockKey, Dtype, KvGeometry, NamespaceFingerprint};

/// Bytes of a region header and of an entry header (one O_DIRECT unit).
pub(crate) const HEADER_BYTES: usize = 4096;
/// Format version written by this kvtier; others are skipped with a log line.
pub(crate) const FORMAT_VERSION: u32 = 1;

const REGION_MAGIC: &[u8; 8] = b"KVTREGN\0";
const ENTRY_MAGIC: &[u8; 8] = b"KVTBLOK\0";
const INDEX_MAGIC: &[u8; 8] = b"KVTRIDX\0";

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}
fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16-byte slice"))
}

/// Why a header or index could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FormatError {
    /// All zero: nothing was ever written there.
    Empty,
    /// Not a kvtier structure of the expected kind.
    BadMagic,
    /// Written by another format version.
    Version(u32),
    /// The checksum does not match the bytes.
    Checksum,
    /// A structurally invalid field.
    Invalid(String),
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatError::Empty => f.write_str("never written"),
            FormatError::BadMagic => f.write_str("bad magic"),
            FormatError::Version(v) => write!(f, "format version {v} (this kvtier reads {FORMAT_VERSION})"),
            FormatError::Checksum => f.write_str("checksum mismatch"),
            FormatError::Invalid(s) => f.write_str(s),
        }
    }
}

/// The header at the start of every region file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionHeader {
    pub geometry: KvGeometry,
    pub slots: u32,
    pub entry_stride: u64,
    pub region_id: u64,
}

impl RegionHeader {
    pub(crate) fn encode(&self, out: &mut [u8]) {
        out[..HEADER_BYTES].fill(0);
        let g = &self.geometry;
        out[0..8].copy_from_slice(REGION_MAGIC);
        let words = [
            FORMAT_VERSION,
            HEADER_BYTES as u32,
            g.layers(),
            g.kv_heads(),
            g.head_dim(),
            g.dtype().code(),
            g.block_tokens(),
            self.slots,
        ];
        for (i, w) in words.iter().enumerate() {
            out[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        out[40..48].copy_from_slice(&self.entry_stride.to_le_bytes());
        out[48..56].copy_from_slice(&self.region_id.to_le_bytes());
        let sum = xxh3_64(&out[..56]);
        out[56..64].copy_from_slice(&sum.to_le_bytes());
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() < 64 {
            return Err(FormatError::Invalid(format!(
                "{} bytes, shorter than a region header",
                b.len()
            )));
        }
        if b[..64].iter().all(|&x| x == 0) {
            return Err(FormatError::Empty);
        }
        if &b[0..8] != REGION_MAGIC {
            return Err(FormatError::BadMagic);
        }
        if u32_at(b, 8) != FORMAT_VERSION {
            return Err(FormatError::Version(u32_at(b, 8)));
        }
        if u64_at(b, 56) != xxh3_64(&b[..56]) {
            return Err(FormatError::Checksum);
        }
        let dtype = Dtype::from_code(u32_at(b, 28))
            .ok_or_else(|| FormatError::Invalid(format!("unknown dtype code {}", u32_at(b, 28))))?;
        let geometry = KvGeometry::new(u32_at(b, 16), u32_at(b, 20), u32_at(b, 24), dtype, u32_at(b, 32))
            .map_err(|e| FormatError::Invalid(e.to_string()))?;
        Ok(Self {
            geometry,
            slots: u32_at(b, 36),
            entry_stride: u64_at(b, 40),
            region_id: u64_at(b, 48),
        })
    }
}

/// The header (commit record) in front of every block's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EntryHeader {
    pub ns: NamespaceFingerprint,
    pub key: BlockKey,
    pub payload_len: u64,
    pub seq: u64,
    pub payload_xxh3: u64,
}

impl EntryHeader {
    pub(crate) fn encode(&self, out: &mut [u8]) {
        out[..HEADER_BYTES].fill(0);
        out[0..8].copy_from_slice(ENTRY_MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[16..32].copy_from_slice(&self.ns.0.to_le_bytes());
        out[32..48].copy_from_slice(&self.key.0.to_le_bytes());
        out[48..56].copy_from_slice(&self.payload_len.to_le_bytes());
        out[56..64].copy_from_slice(&self.seq.to_le_bytes());
        out[64..72].copy_from_slice(&self.payload_xxh3.to_le_bytes());
        let sum = xxh3_64(&out[..72]);
        out[72..80].copy_from_slice(&sum.to_le_bytes());
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() < 80 {
            return Err(FormatError::Invalid(format!(
                "{} bytes, shorter than an entry header",
                b.len()
            )));
        }
        if b[..80].iter().all(|&x| x == 0) {
            return Err(FormatError::Empty);
        }
        if &b[0..8] != ENTRY_MAGIC {
            return Err(FormatError::BadMagic);
        }
        if u32_at(b, 8) != FORMAT_VERSION {
            return Err(FormatError::Version(u32_at(b, 8)));
        }
        if u64_at(b, 72) != xxh3_64(&b[..72]) {
            return Err(FormatError::Checksum);
        }
        Ok(Self {
            ns: NamespaceFingerprint(u128_at(b, 16)),
            key: BlockKey(u128_at(b, 32)),
            payload_len: u64_at(b, 48),
            seq: u64_at(b, 56),
            payload_xxh3: u64_at(b, 64),
        })
    }
}

/// One entry of a region index file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexRecord {
    pub slot: u32,
    pub ns: NamespaceFingerprint,
    pub key: BlockKey,
    pub seq: u64,
    pub payload_xxh3: u64,
}

const RECORD_BYTES: usize = 56;

/// Encodes a region index file: magic, version, count, region id, records, xxh3 trailer.
pub(crate) fn encode_index(region_id: u64, records: &[IndexRecord]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + records.len() * RECORD_BYTES + 8);
    out.extend_from_slice(INDEX_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(records.len() as u32).to_le_bytes());
    out.extend_from_slice(&region_id.to_le_bytes());
    for r in records {
        out.extend_from_slice(&r.slot.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&r.ns.0.to_le_bytes());
        out.extend_from_slice(&r.key.0.to_le_bytes());
        out.extend_from_slice(&r.seq.to_le_bytes());
        out.extend_from_slice(&r.payload_xxh3.to_le_bytes());
    }
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes a region index file written for region `region_id`.
pub(crate) fn decode_index(b: &[u8], region_id: u64) -> Result<Vec<IndexRecord>, FormatError> {
    if b.len() < 32 {
        return Err(FormatError::Invalid(format!(
            "{} bytes, shorter than an index",
            b.len()
        )));
    }
    if &b[0..8] != INDEX_MAGIC {
        return Err(FormatError::BadMagic);
    }
    if u32_at(b, 8) != FORMAT_VERSION {
        return Err(FormatError::Version(u32_at(b, 8)));
    }
    let (body, trailer) = b.split_at(b.len() - 8);
    if u64_at(trailer, 0) != xxh3_64(body) {
        return Err(FormatError::Checksum);
    }
    let count = u32_at(b, 12) as usize;
    if u64_at(b, 16) != region_id {
        return Err(FormatError::Invalid(format!(
            "index of region {} found for region {region_id}",
            u64_at(b, 16)
        )));
    }
    if body.len() != 24 + count * RECORD_BYTES {
        return Err(FormatError::Invalid(format!(
            "{count} records do not fill {} bytes",
            body.len()
        )));
    }
    Ok((0..count)
        .map(|i| {
            let r = &body[24 + i * RECORD_BYTES..24 + (i + 1) * RECORD_BYTES];
            IndexRecord {
                slot: u32_at(r, 0),
                ns: NamespaceFingerprint(u128_at(r, 8)),
                key: BlockKey(u128_at(r, 24)),
                seq: u64_at(r, 40),
                payload_xxh3: u64_at(r, 48),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn geo() -> KvGeometry {
        KvGeometry::new(2, 4, 64, Dtype::Bf16, 16).unwrap()
    }

    #[test]
    fn region_header_round_trip_and_damage() {
        let h = RegionHeader {
            geometry: geo(),
            slots: 77,
            entry_stride: 4096 * 9,
            region_id: 12,
        };
        let mut buf = vec![0u8; HEADER_BYTES];
        assert_eq!(RegionHeader::decode(&buf), Err(FormatError::Empty));
        h.encode(&mut buf);
        assert_eq!(RegionHeader::decode(&buf), Ok(h));
        buf[50] ^= 1;
        assert_eq!(RegionHeader::decode(&buf), Err(FormatError::Checksum));
        buf[8] = 9;
        assert_eq!(RegionHeader::decode(&buf), Err(FormatError::Version(9)));
    }

    #[test]
    fn index_round_trip_and_damage() {
        let recs: Vec<IndexRecord> = (0..5)
            .map(|i| IndexRecord {
                slot: i,
                ns: NamespaceFingerprint(3),
                key: BlockKey(u128::from(i) << 70 | 5),
                seq: u64::from(i) * 10,
                payload_xxh3: 99,
            })
            .collect();
        let mut bytes = encode_index(4, &recs);
        assert_eq!(decode_index(&bytes, 4).unwrap(), recs);
        assert!(matches!(decode_index(&bytes, 5), Err(FormatError::Invalid(_))));
        bytes[40] ^= 0x10;
        assert_eq!(decode_index(&bytes, 4), Err(FormatError::Checksum));
        assert!(decode_index(&bytes[..10], 4).is_err());
    }

    proptest! {
        /// Any single flipped bit in an entry header is detected.
        #[test]
        fn entry_header_detects_every_bit_flip(bit in 0usize..640, seq in any::<u64>(), key in any::<u128>()) {
            let h = EntryHeader {
                ns: NamespaceFingerprint(7),
                key: BlockKey(key),
                payload_len: 131_072,
                seq,
                payload_xxh3: 0xabcd,
            };
            let mut buf = vec![0u8; HEADER_BYTES];
            h.encode(&mut buf);
            prop_assert_eq!(EntryHeader::decode(&buf), Ok(h));
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(EntryHeader::decode(&buf).is_err());
        }
    }
}
