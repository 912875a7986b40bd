//! A pool registered with the sidecar, and the namespace and block keys it hashes under.

use kvtier_core::{BlockHasher, BlockKey, CoreError, KvGeometry, Namespace, NamespaceFingerprint};

/// A registered device pool: its id and the namespace keys are hashed in.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    /// The sidecar's id for it.
    pub id: u64,
    pub(crate) model_id: String,
    pub(crate) geometry: KvGeometry,
    pub(crate) tp_rank: u32,
    pub(crate) tp_size: u32,
}

impl PoolHandle {
    /// The namespace of this pool under `salt`.
    ///
    /// # Errors
    /// [`CoreError`] for a salt over 1 KiB.
    pub fn namespace(&self, salt: &str) -> Result<NamespaceFingerprint, CoreError> {
        Ok(Namespace::new(
            self.model_id.clone(),
            self.geometry,
            self.tp_rank,
            self.tp_size,
            salt,
        )?
        .fingerprint())
    }

    /// The block keys of a token sequence (from token 0), as the sidecar computes them.
    ///
    /// # Errors
    /// As [`PoolHandle::namespace`].
    pub fn keys(&self, salt: &str, tokens: &[u32]) -> Result<Vec<BlockKey>, CoreError> {
        Ok(BlockHasher::new(self.namespace(salt)?, self.geometry.block_tokens()).keys(tokens))
    }
}
