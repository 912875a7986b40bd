//! The bytes of one block in the remote tier: a 64-byte header, then the block's host page.
//!
//! A remote store is shared by every node of a fleet and written by anyone who can reach it,
//! so nothing read back is trusted: the header names the format version, the namespace, the
//! key, the payload's length and its xxh3-64, and carries its own xxh3-64. A value that does
//! not verify in every field is a miss (counted as corrupt), never served.
//!
//! Layout (little-endian):
//!
//! | bytes  | field                                   |
//! |--------|-----------------------------------------|
//! | 0..4   | magic `KVRB`                            |
//! | 4..6   | format version (1)                      |
//! | 6..8   | header length (64)                      |
//! | 8..24  | namespace fingerprint                   |
//! | 24..40 | block key                               |
//! | 40..48 | payload length in bytes                 |
//! | 48..56 | xxh3-64 of the payload                  |
//! | 56..64 | xxh3-64 of bytes 0..56                  |

use kvtier_core::{BlockKey, NamespaceFingerprint, xxh3_64};

/// Bytes of the header that precedes every payload.
pub const REMOTE_HEADER_BYTES: usize = 64;
/// The format version this build writes and reads.
pub const REMOTE_FORMAT_VERSION: u16 = 1;
const MAGIC: &[u8; 4] = b"KVRB";

/// The Redis key of block `key` of `ns` under `prefix`: `{prefix}:v1:{ns:032x}:{key:032x}`.
/// No hash tag, so a sequence's blocks spread over every slot of the cluster.
pub fn remote_key(prefix: &str, ns: NamespaceFingerprint, key: BlockKey) -> String {
    format!("{prefix}:v{REMOTE_FORMAT_VERSION}:{:032x}:{:032x}", ns.0, key.0)
}

/// The pattern that matches every key of `ns` (or of every namespace) under `prefix`.
pub fn remote_key_pattern(prefix: &str, ns: Option<NamespaceFingerprint>) -> String {
    match ns {
        Some(ns) => format!("{prefix}:v{REMOTE_FORMAT_VERSION}:{:032x}:*", ns.0),
        None => format!("{prefix}:v{REMOTE_FORMAT_VERSION}:*"),
    }
}

/// Header + `payload` as one value (the tier writes the two straight from the host page into
/// its command instead; this is the reference the tests use).
///
/// Cost: allocates and copies `payload.len() + 64` bytes; one xxh3 pass over the payload.
#[cfg(test)]
pub fn encode_value(ns: NamespaceFingerprint, key: BlockKey, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REMOTE_HEADER_BYTES + payload.len());
    out.extend_from_slice(&encode_header(ns, key, payload.len() as u64, xxh3_64(payload)));
    out.extend_from_slice(payload);
    out
}

/// The header alone, for a payload of `len` bytes whose xxh3-64 is `digest`.
pub fn encode_header(
    ns: NamespaceFingerprint,
    key: BlockKey,
    len: u64,
    digest: u64,
) -> [u8; REMOTE_HEADER_BYTES] {
    let mut h = [0u8; REMOTE_HEADER_BYTES];
    h[0..4].copy_from_slice(MAGIC);
    h[4..6].copy_from_slice(&REMOTE_FORMAT_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&(REMOTE_HEADER_BYTES as u16).to_le_bytes());
    h[8..24].copy_from_slice(&ns.0.to_le_bytes());
    h[24..40].copy_from_slice(&key.0.to_le_bytes());
    h[40..48].copy_from_slice(&len.to_le_bytes());
    h[48..56].copy_from_slice(&digest.to_le_bytes());
    let own = xxh3_64(&h[..56]);
    h[56..64].copy_from_slice(&own.to_le_bytes());
    h
}

/// The payload of `value` if it is block `key` of `ns` with exactly `len` bytes and every
/// checksum holds; otherwise what did not match.
///
/// Cost: one xxh3 pass over the payload; no copy. (The tier checks the digest while it
/// copies instead: [`verify_header`]; this is the reference the tests use.)
#[cfg(test)]
pub fn verify_value(
    value: &[u8],
    ns: NamespaceFingerprint,
    key: BlockKey,
    len: usize,
) -> Result<&[u8], &'static str> {
    let (payload, digest) = verify_header(value, ns, key, len)?;
    if digest != xxh3_64(payload) {
        return Err("payload checksum");
    }
    Ok(payload)
}

/// The payload of `value` and the xxh3-64 its header promises, if the header is block `key`
/// of `ns` with exactly `len` bytes and its own checksum holds; the caller checks the payload
/// against the digest (so it can hash while it copies).
///
/// Cost: one xxh3 pass over the 56 header bytes.
pub fn verify_header(
    value: &[u8],
    ns: NamespaceFingerprint,
    key: BlockKey,
    len: usize,
) -> Result<(&[u8], u64), &'static str> {
    let Some((h, payload)) = value.split_first_chunk::<REMOTE_HEADER_BYTES>() else {
        return Err("shorter than a header");
    };
    Ok((payload, verify_header_bytes(h, payload.len(), ns, key, len)?))
}

/// [`verify_header`] for a header read apart from its payload (the tier's direct reads take
/// the header off the socket first): `payload_len` is what follows it in the value. The
/// xxh3-64 the header promises for the payload, if every field holds.
///
/// Cost: one xxh3 pass over the 56 header bytes.
pub fn verify_header_bytes(
    h: &[u8; REMOTE_HEADER_BYTES],
    payload_len: usize,
    ns: NamespaceFingerprint,
    key: BlockKey,
    len: usize,
) -> Result<u64, &'static str> {
    let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    let u128_at = |at: usize| u128::from_le_bytes(h[at..at + 16].try_into().expect("16 bytes"));
    if &h[0..4] != MAGIC {
        return Err("magic");
    }
    if u64_at(56) != xxh3_64(&h[..56]) {
        return Err("header checksum");
    }
    if u16::from_le_bytes([h[4], h[5]]) != REMOTE_FORMAT_VERSION {
        return Err("format version");
    }
    if u16::from_le_bytes([h[6], h[7]]) as usize != REMOTE_HEADER_BYTES {
        return Err("header length");
    }
    if u128_at(8) != ns.0 {
        return Err("namespace");
    }
    if u128_at(24) != key.0 {
        return Err("key");
    }
    if u64_at(40) != len as u64 || payload_len != len {
        return Err("length");
    }
    Ok(u64_at(48))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: NamespaceFingerprint = NamespaceFingerprint(7);
    const K: BlockKey = BlockKey(0x1234_5678_9abc_def0_1111_2222_3333_4444);

    #[test]
    fn a_value_round_trips_and_every_byte_flip_is_caught() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        let v = encode_value(NS, K, &payload);
        assert_eq!(v.len(), REMOTE_HEADER_BYTES + payload.len());
        assert_eq!(verify_value(&v, NS, K, payload.len()), Ok(&payload[..]));
        for i in 0..v.len() {
            let mut bad = v.clone();
            bad[i] ^= 0x10;
            assert!(
                verify_value(&bad, NS, K, payload.len()).is_err(),
                "flip at byte {i} passed"
            );
        }
    }

    #[test]
    fn another_namespace_key_length_or_truncation_is_refused_by_name() {
        let v = encode_value(NS, K, &[1, 2, 3, 4]);
        assert_eq!(verify_value(&v, NamespaceFingerprint(8), K, 4), Err("namespace"));
        assert_eq!(verify_value(&v, NS, BlockKey(1), 4), Err("key"));
        assert_eq!(verify_value(&v, NS, K, 5), Err("length"));
        assert_eq!(verify_value(&v[..v.len() - 1], NS, K, 4), Err("length"));
        assert_eq!(verify_value(&v[..10], NS, K, 4), Err("shorter than a header"));
        assert_eq!(
            verify_value(
                b"garbage that is long enough to hold a header and some more bytes..",
                NS,
                K,
                4
            ),
            Err("magic")
        );
    }

    #[test]
    fn keys_name_the_namespace_and_patterns_match_them() {
        let k = remote_key("kvtier", NS, K);
        assert_eq!(
            k,
            "kvtier:v1:00000000000000000000000000000007:123456789abcdef01111222233334444"
        );
        assert!(k.starts_with(remote_key_pattern("kvtier", Some(NS)).trim_end_matches('*')));
        assert!(k.starts_with(remote_key_pattern("kvtier", None).trim_end_matches('*')));
    }
}
