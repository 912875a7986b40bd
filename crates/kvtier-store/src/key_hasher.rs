//! Hashing for maps keyed by [`BlockKey`]: keys are already uniform 128-bit hashes, so folding
//! them is enough (and a fraction of the cost of hashing them again).

use std::hash::{BuildHasherDefault, Hasher};

/// Folds a `u128` key into 64 bits; other inputs are mixed byte by byte.
#[derive(Debug, Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

/// Builder for maps keyed by block keys.
pub(crate) type KeyHasherBuilder = BuildHasherDefault<KeyHasher>;
