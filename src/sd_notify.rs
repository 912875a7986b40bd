//! systemd's readiness protocol (`Type=notify`): one datagram to `$NOTIFY_SOCKET`.
//!
//! `READY=1` is sent once the host arena is populated and the listeners accept requests,
//! `STOPPING=1` when a stop begins. Without `NOTIFY_SOCKET` (not under systemd) nothing is
//! sent. The protocol is small enough that no crate is needed: a path, or `@name` for the
//! abstract namespace.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `READY=1`) to the service manager, if there is one. A failure is
/// logged, never fatal: the sidecar serves either way.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| {
        let bytes = target.as_encoded_bytes();
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None => SocketAddr::from_pathname(std::path::Path::new(&target))?,
        };
        UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &addr)
    })();
    if let Err(e) = sent {
        tracing::warn!(socket = ?target, state, error = %e, "cannot notify the service manager");
    }
}
