//! Keys on the wire: N keys packed back to back in one `bytes` field (16 bytes each,
//! little-endian), so a request's cost does not grow by a message per block. Also a store's
//! `not_after_unix_ms`, both ways.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvtier_core::BlockKey;
use prost::bytes::{BufMut, Bytes, BytesMut};

use crate::ProtoError;

/// Packs keys into one field. Allocates `16 * keys.len()` bytes.
pub fn pack_keys(keys: &[BlockKey]) -> Bytes {
    let mut b = BytesMut::with_capacity(16 * keys.len());
    for k in keys {
        b.put_slice(&k.to_le_bytes());
    }
    b.freeze()
}

/// Packs an optional single key (empty for none), as `StoreRequest.parent` carries it.
pub fn pack_key(key: Option<BlockKey>) -> Bytes {
    key.map(|k| pack_keys(&[k])).unwrap_or_default()
}

/// Unpacks a field of packed keys. Allocates one `BlockKey` per 16 bytes.
///
/// # Errors
/// [`ProtoError::BadKeys`] naming `field` when its length is not a multiple of 16.
pub fn unpack_keys(field: &'static str, bytes: &[u8]) -> Result<Vec<BlockKey>, ProtoError> {
    if !bytes.len().is_multiple_of(16) {
        return Err(ProtoError::BadKeys {
            field,
            len: bytes.len(),
        });
    }
    Ok(bytes
        .chunks_exact(16)
        .map(|c| BlockKey::from_le_slice(c).expect("chunks_exact(16) yields 16-byte slices"))
        .collect())
}

/// Unpacks an optional single key (empty for none).
///
/// # Errors
/// [`ProtoError::BadKey`] unless the field is empty or 16 bytes.
pub fn unpack_key(field: &'static str, bytes: &[u8]) -> Result<Option<BlockKey>, ProtoError> {
    match bytes.len() {
        0 => Ok(None),
        _ => unpack_one_key(field, bytes).map(Some),
    }
}

/// Unpacks a field that must hold exactly one key.
///
/// # Errors
/// [`ProtoError::BadKey`] unless the field is 16 bytes.
pub fn unpack_one_key(field: &'static str, bytes: &[u8]) -> Result<BlockKey, ProtoError> {
    BlockKey::from_le_slice(bytes).ok_or(ProtoError::BadKey {
        field,
        len: bytes.len(),
    })
}

/// `StoreRequest.not_after_unix_ms` for a time: 0 for none, else whole milliseconds rounded
/// down (never later than the caller's time; a time before the epoch, long past, is 1).
pub fn pack_not_after(not_after: Option<SystemTime>) -> u64 {
    not_after.map_or(0, |t| {
        t.duration_since(UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1))
    })
}

/// The time `StoreRequest.not_after_unix_ms` names (0: none).
pub fn unpack_not_after(unix_ms: u64) -> Option<SystemTime> {
    (unix_ms > 0).then(|| UNIX_EPOCH + Duration::from_millis(unix_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_after_rounds_down_and_zero_is_none() {
        assert_eq!(pack_not_after(None), 0);
        assert_eq!(unpack_not_after(0), None);
        let t = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_999);
        assert_eq!(pack_not_after(Some(t)), 1_700_000_000_123);
        assert!(unpack_not_after(pack_not_after(Some(t))).unwrap() <= t);
        assert_eq!(pack_not_after(Some(UNIX_EPOCH - Duration::from_secs(1))), 1);
    }

    #[test]
    fn round_trip_and_bad_lengths() {
        let keys: Vec<BlockKey> = (0..5u128).map(|i| BlockKey(i << 100 | i)).collect();
        let packed = pack_keys(&keys);
        assert_eq!(packed.len(), 80);
        assert_eq!(unpack_keys("keys", &packed).unwrap(), keys);
        assert!(unpack_keys("keys", &[]).unwrap().is_empty());
        assert_eq!(unpack_key("parent", &[]).unwrap(), None);
        assert_eq!(unpack_key("parent", &packed[16..32]).unwrap(), Some(keys[1]));
        assert_eq!(
            unpack_key("parent", &pack_key(Some(keys[4]))).unwrap(),
            Some(keys[4])
        );
        assert!(pack_key(None).is_empty());
        assert_eq!(unpack_one_key("events[].key", &packed[64..]).unwrap(), keys[4]);
    }

    #[test]
    fn odd_lengths_name_the_field() {
        let packed = pack_keys(&[BlockKey(1), BlockKey(2), BlockKey(3)]);
        let e = unpack_keys("keys", &packed[..33]).unwrap_err();
        assert_eq!(
            e,
            ProtoError::BadKeys {
                field: "keys",
                len: 33
            }
        );
        assert_eq!(
            e.to_string(),
            "keys: 33 bytes is not a whole number of 16-byte block keys"
        );
        assert_eq!(
            unpack_key("parent", &[1, 2, 3]).unwrap_err().to_string(),
            "parent: 3 bytes is not one 16-byte block key"
        );
        // A whole number of keys is still not one key.
        assert_eq!(
            unpack_key("parent", &packed[..32]).unwrap_err(),
            ProtoError::BadKey {
                field: "parent",
                len: 32
            }
        );
        assert_eq!(
            unpack_one_key("events[].key", &[]).unwrap_err(),
            ProtoError::BadKey {
                field: "events[].key",
                len: 0
            }
        );
    }
}
