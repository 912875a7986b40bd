//! Chained 128-bit block keys.
//!
//! `key[i] = xxh3_128(fingerprint (16 B LE) || key[i-1] (16 B LE, zero for i = 0) ||
//! tokens[i*B..(i+1)*B] as u32 LE)`. A key therefore identifies a block *and its whole prefix*;
//! equal keys mean equal KV (within one namespace). Only full blocks are keyed.

use std::fmt;
use std::str::FromStr;

use crate::{CoreError, NamespaceFingerprint};

/// The 128-bit address of one block and its whole prefix.
///
/// Printed as 32 lowercase hex digits of the integer value; carried on the wire and in headers as
/// 16 little-endian bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockKey(pub u128);

impl BlockKey {
    /// The 16 little-endian bytes used in the hash chain, on the wire and in headers.
    pub const fn to_le_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }
    /// Inverse of [`BlockKey::to_le_bytes`].
    pub const fn from_le_bytes(b: [u8; 16]) -> Self {
        BlockKey(u128::from_le_bytes(b))
    }
    /// Builds a key from a wire field, which must be exactly 16 bytes.
    pub fn from_le_slice(b: &[u8]) -> Option<Self> {
        <[u8; 16]>::try_from(b).ok().map(Self::from_le_bytes)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for BlockKey {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CoreError::InvalidKey { input: s.to_owned() });
        }
        u128::from_str_radix(s, 16)
            .map(BlockKey)
            .map_err(|_| CoreError::InvalidKey { input: s.to_owned() })
    }
}

/// Computes chained block keys for one namespace.
///
/// Holds a scratch buffer of `32 + 4 * block_tokens` bytes so hashing allocates nothing per
/// block; each block costs one copy of its token bytes and one `xxh3_128` over them.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_tokens: usize,
    buf: Vec<u8>,
}

impl BlockHasher {
    /// A hasher for blocks of `block_tokens` tokens in the namespace with `fingerprint`.
    ///
    /// # Panics
    /// Never for a `block_tokens` taken from a validated [`crate::KvGeometry`]; a zero
    /// `block_tokens` is treated as 1 so that no call can loop forever.
    pub fn new(fingerprint: NamespaceFingerprint, block_tokens: u32) -> Self {
        let block_tokens = block_tokens.max(1) as usize;
        let mut buf = vec![0u8; 32 + 4 * block_tokens];
        buf[..16].copy_from_slice(&fingerprint.to_le_bytes());
        Self { block_tokens, buf }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The key of one block whose tokens are `block` (exactly `block_tokens` of them), following
    /// `parent` (`None` for the first block of a sequence).
    ///
    /// Returns `None` if `block` is not exactly one block long.
    pub fn key(&mut self, parent: Option<BlockKey>, block: &[u32]) -> Option<BlockKey> {
        if block.len() != self.block_tokens {
            return None;
        }
        Some(self.key_unchecked(parent, block))
    }

    fn key_unchecked(&mut self, parent: Option<BlockKey>, block: &[u32]) -> BlockKey {
        let parent = parent.unwrap_or_default();
        self.buf[16..32].copy_from_slice(&parent.to_le_bytes());
        for (dst, t) in self.buf[32..].chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        BlockKey(xxhash_rust::xxh3::xxh3_128(&self.buf))
    }

    /// Appends to `out` the keys of every full block of `tokens`, chained after `parent` (`None`
    /// when `tokens` starts the sequence). A partial tail block is ignored.
    pub fn extend_keys(&mut self, parent: Option<BlockKey>, tokens: &[u32], out: &mut Vec<BlockKey>) {
        let mut prev = parent;
        out.reserve(tokens.len() / self.block_tokens);
        for block in tokens.chunks_exact(self.block_tokens) {
            let key = self.key_unchecked(prev, block);
            out.push(key);
            prev = Some(key);
        }
    }

    /// The keys of every full block of a sequence starting at token 0.
    pub fn keys(&mut self, tokens: &[u32]) -> Vec<BlockKey> {
        let mut out = Vec::new();
        self.extend_keys(None, tokens, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hasher(b: u32) -> BlockHasher {
        BlockHasher::new(NamespaceFingerprint(0x1234_5678_9abc_def0_0fed_cba9_8765_4321), b)
    }

    #[test]
    fn first_key_matches_the_definition() {
        let fp = NamespaceFingerprint(7);
        let tokens = [1u32, 2, 3, 4];
        let mut manual = Vec::new();
        manual.extend_from_slice(&fp.to_le_bytes());
        manual.extend_from_slice(&[0u8; 16]);
        for t in tokens {
            manual.extend_from_slice(&t.to_le_bytes());
        }
        let k0 = BlockKey(xxhash_rust::xxh3::xxh3_128(&manual));
        let keys = BlockHasher::new(fp, 4).keys(&tokens);
        assert_eq!(keys, vec![k0]);
    }

    #[test]
    fn partial_blocks_are_not_keyed() {
        let mut h = hasher(4);
        assert_eq!(h.keys(&[1, 2, 3]).len(), 0);
        assert_eq!(h.keys(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(h.key(None, &[1, 2, 3]), None);
    }

    #[test]
    fn chaining_makes_position_matter() {
        let mut h = hasher(2);
        let a = h.keys(&[5, 6, 5, 6]);
        assert_ne!(a[0], a[1], "same tokens at another position must key differently");
    }

    #[test]
    fn hex_round_trip_and_errors() {
        let k = BlockKey(0x00ff_0000_0000_0000_0000_0000_0000_0001);
        let s = k.to_string();
        assert_eq!(s, "00ff0000000000000000000000000001");
        assert_eq!(s.parse::<BlockKey>().unwrap(), k);
        assert!(matches!(
            "abc".parse::<BlockKey>(),
            Err(CoreError::InvalidKey { .. })
        ));
        assert!("+0ff0000000000000000000000000001".parse::<BlockKey>().is_err());
        assert_eq!(BlockKey::from_le_slice(&k.to_le_bytes()), Some(k));
        assert_eq!(BlockKey::from_le_slice(&[0u8; 15]), None);
    }

    proptest! {
        /// Keys of a prefix are the leading keys of any extension, and extending from a parent
        /// key gives the same chain as hashing from the start.
        #[test]
        fn prefix_stability(
            tokens in proptest::collection::vec(any::<u32>(), 0..300),
            b in 1u32..20,
            split_blocks in 0usize..10,
        ) {
            let mut h = hasher(b);
            let full = h.keys(&tokens);
            prop_assert_eq!(full.len(), tokens.len() / b as usize);
            let cut = (split_blocks * b as usize).min(tokens.len() / b as usize * b as usize);
            let head = h.keys(&tokens[..cut]);
            prop_assert_eq!(&full[..head.len()], &head[..]);
            let mut resumed = head.clone();
            h.extend_keys(head.last().copied(), &tokens[cut..], &mut resumed);
            prop_assert_eq!(resumed, full);
        }

        /// One changed token changes its block's key and every later key, never an earlier one.
        #[test]
        fn a_change_propagates_forward_only(
            tokens in proptest::collection::vec(any::<u32>(), 32..200),
            pos in any::<proptest::sample::Index>(),
        ) {
            let mut h = hasher(8);
            let a = h.keys(&tokens);
            let mut changed = tokens.clone();
            let p = pos.index(tokens.len());
            changed[p] = changed[p].wrapping_add(1);
            let b = h.keys(&changed);
            let blk = p / 8;
            for i in 0..a.len() {
                if i < blk { prop_assert_eq!(a[i], b[i]); } else { prop_assert_ne!(a[i], b[i]); }
            }
        }
    }
}
