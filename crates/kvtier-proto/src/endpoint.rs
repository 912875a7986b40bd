//! Where the sidecar is by default: shared by `kvtier serve` (which listens there) and its
//! clients (which dial there), so neither needs the other's configuration.

use std::path::{Path, PathBuf};

/// The default Unix socket of `kvtier serve`: `$XDG_RUNTIME_DIR/kvtier.sock`, or
/// `/tmp/kvtier-<uid>.sock` where that variable is unset or empty. Reads the environment; does
/// not touch the file system.
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => Path::new(&d).join("kvtier.sock"),
        // SAFETY: getuid has no preconditions and cannot fail.
        _ => PathBuf::from(format!("/tmp/kvtier-{}.sock", unsafe { libc::getuid() })),
    }
}
