//! `kvtier serve` as a real process: a client process stores, matches and loads through it and
//! is then killed mid-load; the server releases everything that client held; the metrics
//! endpoint carries every name the Grafana dashboard uses; SIGTERM stops it cleanly.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_client::Client;
use kvtier_core::{Dtype, KvGeometry};
use kvtier_transfer::CpuDevicePool;
use kvtier_transfer::test_util::{kv, write_kv_slots};

#[path = "common/exposition.rs"]
mod exposition;
#[path = "common/process.rs"]
mod process;

use process::free_port;

const ROLE: &str = "KVTIER_TEST_SIDECAR_CLIENT";
const BLOCKS: u32 = 2048;

/// 16 layers of 8 KiB block-layers: 128 KiB per block, 256 MiB for the big load.
fn geometry() -> KvGeometry {
    KvGeometry::new(16, 2, 64, Dtype::Bf16, 16).unwrap()
}

/// The client process: registers a pool, stores, matches, loads and checks a few blocks, then
/// starts a big load and waits to be killed in the middle of it.
async fn client(target: &str, dir: &Path) {
    let mut c = Client::connect(target, "doomed-engine").await.unwrap();
    let g = geometry();
    let pool = CpuDevicePool::create(Some(&dir.join("engine-pool")), g, 2 * BLOCKS).unwrap();
    let h = c.register_cpu_pool(&pool, "process-test", 0, 1).await.unwrap();
    let tokens: Vec<u32> = (0..BLOCKS * 16).collect();
    let keys = h.keys("", &tokens).unwrap();
    write_kv_slots(&pool, &keys, 0);
    let run: Vec<_> = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
    let stored = c.store(&h, "", None, &run).await.unwrap();
    assert_eq!(stored.stored_blocks, BLOCKS);
    assert_eq!(
        c.match_tokens(&h, "", &tokens).await.unwrap().matched_tokens,
        u64::from(BLOCKS) * 16
    );
    let few: Vec<_> = keys[..8]
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, BLOCKS + i as u32))
        .collect();
    c.load_all(&h, "", &few, None).await.unwrap();
    let mut buf = vec![0u8; g.bytes_per_block_layer()];
    for (i, &k) in keys[..8].iter().enumerate() {
        for layer in 0..g.layers() {
            pool.read_slot_layer(BLOCKS + i as u32, layer, &mut buf).unwrap();
            assert!(buf == kv(k, layer, buf.len()), "block {i} layer {layer} differs");
        }
    }
    println!("\nKVTIER-VERIFIED");
    let all: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, BLOCKS + i as u32))
        .collect();
    let _stream = c.load(&h, "", &all, None).await.unwrap();
    println!("\nKVTIER-LOADING");
    std::io::stdout().flush().unwrap();
    std::future::pending::<()>().await;
}

#[test]
#[ignore = "entry point of the client child process, started by the test below"]
fn client_child() {
    let Ok(target) = std::env::var(ROLE) else { return };
    let dir = PathBuf::from(std::env::var("KVTIER_TEST_DIR").unwrap());
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(client(&target, &dir));
}

/// The body of one scrape.
fn scrape_body(port: u16) -> String {
    let text = scrape(port);
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.contains(" 200 "), "{head}");
    body.to_owned()
}

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_client_killed_mid_load_leaks_nothing_and_metrics_match_the_dashboard() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock");
    let metrics_port = free_port();
    let g = geometry();
    let server = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--socket"])
        .arg(&socket)
        .args([
            "--metrics",
            &format!("127.0.0.1:{metrics_port}"),
            "--host-capacity",
            "300MiB",
        ])
        .args(["--set", &format!("model.layers={}", g.layers())])
        .args(["--set", &format!("model.kv_heads={}", g.kv_heads())])
        .args(["--set", &format!("model.head_dim={}", g.head_dim())])
        .args(["--set", &format!("model.block_tokens={}", g.block_tokens())])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(server);
    // The server says where it serves once the arena is populated and the socket is bound.
    let stderr = BufReader::new(server.0.stderr.take().unwrap());
    let mut lines = stderr.lines();
    loop {
        let line = lines.next().expect("the server exited before serving").unwrap();
        if line.contains("kvtier: serving") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let target = format!("unix://{}", socket.display());
    // From start-up: every family, with help text, in a valid exposition (promtool's checks).
    let text = scrape_body(metrics_port);
    let families = exposition::check(&text).unwrap_or_else(|e| panic!("{e:#?}\n{text}"));
    for name in kvtier_server::metric_names::ALL {
        assert!(
            families.contains_key(*name),
            "{name} missing at start-up:\n{text}"
        );
    }
    // Every gRPC method's error series exists before its first error.
    assert!(
        families[kvtier_server::metric_names::GRPC_REQUESTS]
            .samples
            .iter()
            .any(
                |(_, labels, _)| labels.contains(&("method".into(), "Load".into()))
                    && labels.contains(&("code".into(), "NOT_FOUND".into()))
            ),
        "kvtier_grpc_requests_total{{method=\"Load\",code=\"NOT_FOUND\"}} at start-up"
    );

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "client_child",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, &target)
        .env("KVTIER_TEST_DIR", dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut verified = false;
    for line in out.lines() {
        let line = line.unwrap();
        verified |= line.trim() == "KVTIER-VERIFIED";
        if line.trim() == "KVTIER-LOADING" {
            child.kill().unwrap(); // SIGKILL, mid-load
            break;
        }
    }
    child.wait().unwrap();
    assert!(
        verified,
        "the client process stored, matched and loaded bit-exact first"
    );

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut observer = Client::connect(&target, "observer").await.unwrap();
        let start = Instant::now();
        loop {
            let s = observer.stats().await.unwrap();
            if (s.sessions, s.pools, s.pinned_blocks) == (1, 0, 0) {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the dead client's state was not released: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });

    // Every sidecar metric the dashboard uses is exported (histograms as _bucket series), in
    // a valid exposition after traffic too.
    let (_, names) = exposition::dashboard_names();
    assert!(names.len() >= 15, "{names:?}");
    let text = scrape_body(metrics_port);
    let families = exposition::check(&text).unwrap_or_else(|e| panic!("{e:#?}\n{text}"));
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !exposition::exposes(&families, n))
        .collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");
    for name in kvtier_server::metric_names::ALL {
        assert!(name.starts_with("kvtier_"), "{name}");
    }

    // SIGTERM: a clean stop that removes the socket.
    // SAFETY: sending a signal to our own child.
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    let status = server.0.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "the socket was removed");
}
