//! No request is lost between the HTTP layer, the waiting queue and the scheduler: with the
//! device prefix cache filled by earlier requests and a sidecar behind it, a burst of streaming requests larger than
//! the slot pool, the running set and the waiting queue together all end: every stream
//! reaches `[DONE]`, or is refused at once with 503 and `Retry-After`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Engine(Child);

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (status, body); a read that stalls for two minutes is a hang and fails the test.
fn post(port: u16, path: &str, body: &str) -> (u16, String) {
    let (status, head, body) = post_with_head(port, path, body);
    if status == 503 {
        assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    }
    (status, body)
}

/// (status, head, body).
fn post_with_head(port: u16, path: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.0\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out)
        .unwrap_or_else(|e| panic!("a request hung: {e}; got {out:?}"));
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (
        head.split(' ').nth(1).unwrap().parse().unwrap(),
        head.to_owned(),
        body.to_owned(),
    )
}

#[test]
fn a_burst_after_the_cache_is_full_leaves_no_request_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock");
    let mut sidecar = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--metrics",
            "off",
            "--host-capacity",
            "64MiB",
            "--socket",
        ])
        .arg(&socket)
        .args([
            "--set",
            "model.layers=2",
            "--set",
            "model.kv_heads=2",
            "--set",
            "model.head_dim=16",
        ])
        .args(["--set", "model.block_tokens=16"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sidecar.stderr.take().unwrap()).lines();
    while !lines
        .next()
        .expect("the sidecar exited")
        .unwrap()
        .contains("kvtier: serving")
    {}
    std::thread::spawn(move || for _ in lines {});
    let _sidecar = Engine(sidecar);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "engine",
            "--model",
            "tiny",
            "--kv-reuse",
            "tiered",
            "--block-tokens",
            "16",
        ])
        .arg("--sidecar")
        .arg(format!("unix://{}", socket.display()))
        .args([
            "--device-slots",
            "64",
            "--max-running",
            "4",
            "--max-batch-tokens",
            "256",
        ])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    while !lines
        .next()
        .expect("the engine exited")
        .unwrap()
        .contains("serving http://")
    {}
    std::thread::spawn(move || for _ in lines {});
    let _engine = Engine(child);

    let prompt = |i: u32| -> Vec<u32> { (0..56).map(|t| (t * 7 + i * 31) % 250).collect() };
    let req = |i: u32, stream: bool| {
        serde_json::json!({"prompt": prompt(i), "max_tokens": 8, "temperature": 0, "ignore_eos": true, "stream": stream})
            .to_string()
    };
    // Fill the device prefix cache: 20 prompts of 3 full blocks, 60 of 64 slots.
    for i in 0..20 {
        let (status, b) = post(port, "/v1/completions", &req(i, false));
        assert_eq!(status, 200, "{b}");
    }
    // The burst: 128 streams at once, half repeating cached prompts, half new.
    let threads: Vec<_> = (0..128)
        .map(|i| {
            let body = req(if i % 2 == 0 { i / 2 } else { 100 + i }, true);
            std::thread::spawn(move || post(port, "/v1/completions", &body))
        })
        .collect();
    let (mut done, mut refused) = (0, 0);
    for t in threads {
        let (status, body) = t.join().unwrap();
        match status {
            200 => {
                assert!(body.contains("data: [DONE]"), "a stream ended early: {body}");
                assert!(body.contains("\"finish_reason\":\"length\""), "{body}");
                done += 1;
            }
            503 => {
                assert!(
                    body.contains("\"error\"") && body.contains("max_waiting"),
                    "{body}"
                );
                refused += 1;
            }
            other => panic!("status {other}: {body}"),
        }
    }
    assert!(done > 0);
    eprintln!("burst: {done} streams served, {refused} refused with 503 (max_waiting 16)");
}
