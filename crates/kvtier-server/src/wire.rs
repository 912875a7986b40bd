//! Keys on the wire: N keys packed back to back in one `bytes` field (16 bytes each,
//! little-endian), so a request's cost does not grow by a message per block.

use kvtier_core::BlockKey;
use prost::bytes::{BufMut, Bytes, BytesMut};

use crate::ServerError;

/// Packs keys into one field.
pub fn pack_keys(keys: &[BlockKey]) -> Bytes {
    let mut b = BytesMut::with_capacity(16 * keys.len());
    for k in keys {
        b.put_slice(&k.to_le_bytes());
    }
    b.freeze()
}

/// Unpacks a field of packed keys.
///
/// # Errors
/// [`ServerError::BadKeys`] naming `field` when its length is not a multiple of 16.
pub fn unpack_keys(field: &'static str, bytes: &[u8]) -> Result<Vec<BlockKey>, ServerError> {
    if bytes.len() % 16 != 0 {
        return Err(ServerError::BadKeys {
            field,
            len: bytes.len(),
        });
    }
    Ok(bytes
        .chunks_exact(16)
        .map(|c| BlockKey::from_le_slice(c).expect("chunks of 16 bytes"))
        .collect())
}

/// Unpacks an optional single key (empty for none).
///
/// # Errors
/// [`ServerError::BadKeys`] unless the field is empty or 16 bytes.
pub fn unpack_key(field: &'static str, bytes: &[u8]) -> Result<Option<BlockKey>, ServerError> {
    match bytes.len() {
        0 => Ok(None),
        16 => Ok(BlockKey::from_le_slice(bytes)),
        len => Err(ServerError::BadKeys { field, len }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bad_lengths() {
        let keys: Vec<BlockKey> = (0..5u128).map(|i| BlockKey(i << 100 | i)).collect();
        let packed = pack_keys(&keys);
        assert_eq!(packed.len(), 80);
        assert_eq!(unpack_keys("keys", &packed).unwrap(), keys);
        assert!(unpack_keys("keys", &[]).unwrap().is_empty());
        let e = unpack_keys("keys", &packed[..33]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "keys: 33 bytes is not a whole number of 16-byte block keys"
        );
        assert_eq!(unpack_key("parent", &[]).unwrap(), None);
        assert_eq!(unpack_key("parent", &packed[16..32]).unwrap(), Some(keys[1]));
        assert!(unpack_key("parent", &[1, 2, 3]).is_err());
    }
}
