//! `kvtier serve` under a service manager: systemd's readiness protocol (`Type=notify`) on a
//! real datagram socket, and the socket mode a shared group needs.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn recv(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).expect("a notification before the timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Starts `kvtier serve` on `socket` with `NOTIFY_SOCKET=notify` and `extra` flags.
fn serve(socket: &Path, notify: &OsStr, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--metrics",
            "off",
            "--host-capacity",
            "64MiB",
            "--socket",
        ])
        .arg(socket)
        .args(extra)
        .env("NOTIFY_SOCKET", notify)
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn ready_is_sent_once_serving_and_stopping_when_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let socket = dir.path().join("kvtier.sock");
    let mut child = serve(
        &socket,
        notify_path.as_os_str(),
        &["--set", "server.socket_mode=\"0660\""],
    );
    assert_eq!(recv(&notify), "READY=1");
    // Ready means serving: the probe passes at once, and the socket has the configured mode.
    let health = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["health", "--sidecar"])
        .arg(format!("unix://{}", socket.display()))
        .output()
        .unwrap();
    assert!(
        health.status.success(),
        "{}",
        String::from_utf8_lossy(&health.stderr)
    );
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(recv(&notify), "STOPPING=1");
    assert!(child.wait().unwrap().success());
    assert!(!socket.exists(), "the socket is removed at stop");
}

#[test]
fn an_abstract_notify_socket_is_reached_too() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("kvtier-test-notify-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let notify = UnixDatagram::bind_addr(&addr).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut child = serve(
        &dir.path().join("kvtier.sock"),
        OsStr::new(&format!("@{name}")),
        &[],
    );
    assert_eq!(recv(&notify), "READY=1");
    // The default mode is the owner's only.
    let mode = std::fs::metadata(dir.path().join("kvtier.sock"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    let _ = child.kill();
    let _ = child.wait();
}
