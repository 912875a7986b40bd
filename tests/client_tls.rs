//! Every client command against a TCP listener with TLS and a bearer token, as a deployment
//! off loopback runs it: `kvtier health`, `kvtier engine`, `kvtier bench match`, `kvtier bench
//! offload` (twice against the same sidecar: runs repeat) and `kvtier bench engine`, each with
//! the one set of connection flags (--tls-ca, --tls-server-name, --auth-token-file or
//! KVTIER_AUTH_TOKEN). The certificates are the test-only ones in tests/data/tls.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_core::KvGeometry;
use kvtier_engine::{EngineConfig, ModelConfig};

const TOKEN: &str = "test-token-0123456789abcdef";

fn tls_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tls")
        .join(name)
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` and reads its stderr until a line containing `marker`; returns the process
/// and that line.
fn start_until(mut cmd: Command, marker: &str) -> (Proc, String) {
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let found = loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("exited before {marker:?}"))
            .unwrap();
        if line.contains(marker) {
            break line;
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (Proc(child), found)
}

/// The reference engine's `tiny` preset: the geometry the sidecar must serve for it.
fn tiny_geometry() -> KvGeometry {
    kvtier_engine::engine::kv_geometry(&ModelConfig::preset("tiny").unwrap(), &EngineConfig::default())
        .unwrap()
}

/// `kvtier serve` on a Unix socket and on TLS TCP with a token from a file. Returns the
/// process, the https URL and the token file.
fn tls_sidecar(dir: &Path, g: KvGeometry) -> (Proc, String, PathBuf) {
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    cmd.arg("serve")
        .arg("--socket")
        .arg(dir.join("kvtier.sock"))
        .args([
            "--tcp",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--host-capacity",
            "64MiB",
        ])
        .arg("--auth-token-file")
        .arg(&token_file)
        .arg("--set")
        .arg(format!(
            "server.tls_cert=\"{}\"",
            tls_file("server.pem").display()
        ))
        .arg("--set")
        .arg(format!("server.tls_key=\"{}\"", tls_file("server.key").display()))
        .args(["--set", &format!("model.layers={}", g.layers())])
        .args(["--set", &format!("model.kv_heads={}", g.kv_heads())])
        .args(["--set", &format!("model.head_dim={}", g.head_dim())])
        .args(["--set", &format!("model.block_tokens={}", g.block_tokens())]);
    let (proc, line) = start_until(cmd, "kvtier: serving");
    let tcp = line
        .split("tcp://")
        .nth(1)
        .and_then(|r| r.split(|c: char| c == ';' || c.is_whitespace()).next())
        .unwrap_or_else(|| panic!("no TCP address in {line:?}"))
        .to_owned();
    (proc, format!("https://{tcp}"), token_file)
}

/// Runs `kvtier args` with `env`; returns success, stdout and stderr.
fn kvtier(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .env_remove("KVTIER_AUTH_TOKEN")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A plain HTTP/1.1 GET; returns the body.
fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

#[test]
fn every_client_command_speaks_tls_with_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_geometry();
    let (_sidecar, url, token_file) = tls_sidecar(dir.path(), g);
    let ca = tls_file("ca.pem");
    let ca = ca.to_str().unwrap();
    let tok = token_file.to_str().unwrap();
    let tls = ["--tls-ca", ca, "--auth-token-file", tok];

    // health: the CA and the token from a file, or from KVTIER_AUTH_TOKEN with a server name.
    let (ok, out, err) = kvtier(&[&["health", "--sidecar", &url][..], &tls].concat(), &[]);
    assert!(ok && out.contains("SERVING"), "{out}{err}");
    let (ok, out, err) = kvtier(
        &[
            "health",
            "--sidecar",
            &url,
            "--tls-ca",
            ca,
            "--tls-server-name",
            "kvtier.test",
        ],
        &[("KVTIER_AUTH_TOKEN", TOKEN)],
    );
    assert!(ok && out.contains("SERVING"), "{out}{err}");
    // ... and each missing or wrong part is refused, saying why.
    let (ok, _, err) = kvtier(&["health", "--sidecar", &url, "--tls-ca", ca], &[]);
    assert!(!ok && err.contains("bearer token"), "{err}");
    let (ok, _, err) = kvtier(
        &["health", "--sidecar", &url, "--tls-ca", ca],
        &[("KVTIER_AUTH_TOKEN", "wrong-token-0123456789")],
    );
    assert!(!ok && err.contains("bearer token"), "{err}");
    let (ok, _, err) = kvtier(&["health", "--sidecar", &url, "--auth-token-file", tok], &[]);
    assert!(!ok && err.contains("UnknownIssuer"), "without the CA: {err}");
    let (ok, _, err) = kvtier(
        &[
            &["health", "--sidecar", &url, "--tls-server-name", "other.test"][..],
            &tls,
        ]
        .concat(),
        &[],
    );
    assert!(!ok && err.contains("other.test"), "{err}");
    let unix = format!("unix://{}", dir.path().join("kvtier.sock").display());
    let (ok, _, err) = kvtier(&["health", "--sidecar", &unix, "--tls-ca", ca], &[]);
    assert!(!ok && err.contains("https://"), "{err}");
    let (ok, _, err) = kvtier(
        &[
            "health",
            "--sidecar",
            &url,
            "--tls-ca",
            ca,
            "--auth-token-file",
            "/nonexistent",
        ],
        &[],
    );
    assert!(!ok && err.contains("--auth-token-file /nonexistent"), "{err}");

    // bench match and bench offload take the sidecar's geometry (no geometry flags) and run
    // twice against the same sidecar.
    let (ok, out, err) = kvtier(
        &[
            &[
                "bench",
                "match",
                "--sidecar",
                &url,
                "--blocks",
                "8",
                "--requests",
                "50",
                "--clients",
                "1",
            ][..],
            &tls,
        ]
        .concat(),
        &[],
    );
    assert!(ok && out.contains("match_rps clients=1"), "{out}{err}");
    for run in 0..2 {
        let (ok, out, err) = kvtier(
            &[
                &[
                    "bench",
                    "offload",
                    "--sidecar",
                    &url,
                    "--tokens",
                    "640",
                    "--batch",
                    "2",
                ][..],
                &["--rounds", "2", "--warmup-rounds", "1"],
                &tls,
            ]
            .concat(),
            &[],
        );
        assert!(ok, "run {run}: {out}{err}");
        assert!(err.contains(&g.to_string()), "the sidecar's geometry: {err}");
        assert!(out.contains("mismatched_blocks=0"), "run {run}: {out}");
    }

    // The engine connects over TLS with the token and says so on /health.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    cmd.args([
        "engine",
        "--model",
        "tiny",
        "--listen",
        "127.0.0.1:0",
        "--device-slots",
        "64",
    ])
    .args(["--sidecar", &url])
    .args(tls)
    .env_remove("KVTIER_AUTH_TOKEN");
    let (_engine, line) = start_until(cmd, "serving http://");
    let addr = line.rsplit("http://").next().unwrap().trim().to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let health = http_get(&addr, "/health");
        if health.contains("\"sidecar_connected\":true") {
            break;
        }
        assert!(Instant::now() < deadline, "the engine never connected: {health}");
        std::thread::sleep(Duration::from_millis(100));
    }

    // bench engine through the same listener.
    let (ok, out, err) = kvtier(
        &[
            &[
                "bench",
                "engine",
                "--model",
                "tiny",
                "--layers",
                "0",
                "--prompt-tokens",
                "256",
            ][..],
            &[
                "--rounds",
                "1",
                "--decode-tokens",
                "2",
                "--decode-batch",
                "1",
                "--sidecar",
                &url,
            ],
            &tls,
        ]
        .concat(),
        &[],
    );
    assert!(ok, "{out}{err}");
}
