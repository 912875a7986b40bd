//! The disk tier and its file system's free space: the check at start, and what a full file
//! system does to writes (pressure, not an outage).
//!
//! When the file system fills (ENOSPC, EDQUOT, EFBIG), the tier gives back its oldest region and
//! tries once more; if that is not enough (another process took the space) it refuses writes
//! quickly, counted as dropped for lack of space, for [`FULL_RETRY`], then tries again. So writes
//! resume by themselves once space is back, and a full disk never costs more than one failed
//! region allocation per [`FULL_RETRY`].

use std::path::Path;
use std::time::{Duration, Instant};

/// How long writes are refused after the file system was found full, before trying again.
pub(crate) const FULL_RETRY: Duration = Duration::from_secs(1);

/// Bytes an unprivileged process may still write in `dir`'s file system.
pub(crate) fn available_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is NUL-terminated and lives
    // through the call.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// Whether the file system is currently treated as full, and since when.
#[derive(Debug, Default)]
pub(crate) struct FullState {
    /// Writes are refused until then.
    retry_at: Option<Instant>,
    /// When the current full spell began (for the log line that ends it).
    since: Option<Instant>,
}

impl FullState {
    /// Whether a write may try to allocate now.
    pub(crate) fn may_try(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|t| now >= t)
    }

    /// The file system was found full: refuse writes for [`FULL_RETRY`]. Returns whether this
    /// starts a full spell (to log it once, not once per write).
    pub(crate) fn found_full(&mut self, now: Instant) -> bool {
        self.retry_at = Some(now + FULL_RETRY);
        let first = self.since.is_none();
        self.since.get_or_insert(now);
        first
    }

    /// A region was allocated: the spell is over. Returns how long it lasted, if there was one.
    pub(crate) fn found_room(&mut self, now: Instant) -> Option<Duration> {
        self.retry_at = None;
        self.since.take().map(|s| now - s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_spell_refuses_for_a_while_then_retries_and_ends_on_room() {
        let t0 = Instant::now();
        let mut s = FullState::default();
        assert!(s.may_try(t0));
        assert!(s.found_full(t0), "the first failure starts the spell");
        assert!(!s.may_try(t0 + FULL_RETRY / 2));
        assert!(s.may_try(t0 + FULL_RETRY));
        assert!(
            !s.found_full(t0 + FULL_RETRY),
            "a retry that fails again does not"
        );
        assert_eq!(s.found_room(t0 + 3 * FULL_RETRY), Some(3 * FULL_RETRY));
        assert!(s.may_try(t0 + 3 * FULL_RETRY));
        assert_eq!(s.found_room(t0 + 4 * FULL_RETRY), None);
    }

    #[test]
    fn available_bytes_of_a_real_directory() {
        let dir = tempfile::tempdir().unwrap();
        assert!(available_bytes(dir.path()).unwrap() > 0);
        assert!(available_bytes(&dir.path().join("missing")).is_err());
    }
}
