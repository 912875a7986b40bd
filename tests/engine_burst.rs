//! No request is lost between the HTTP layer, the waiting queue and the scheduler: with the
//! device prefix cache filled by earlier requests and a sidecar behind it, a burst of streaming requests larger than
//! the slot pool, the running set and the waiting queue together all end: every stream
//! reaches `[DONE]`, or is refused at once with 503 and `Retry-After`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[path = "common/process.rs"]
mod process;

use process::{Kvtier, free_port};

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

/// A sidecar with the tiny model's KV shape and an engine in front of it, sized by
/// `engine_flags`; returns both and the engine's port.
fn engine_with_sidecar(dir: &std::path::Path, engine_flags: &[&str]) -> (Kvtier, Kvtier, u16) {
    let socket = dir.join("kvtier.sock").display().to_string();
    let sidecar = Kvtier::spawn_until(
        &[
            "serve",
            "--metrics",
            "off",
            "--host-capacity",
            "64MiB",
            "--socket",
            &socket,
            "--set",
            "model.layers=2",
            "--set",
            "model.kv_heads=2",
            "--set",
            "model.head_dim=16",
            "--set",
            "model.block_tokens=16",
        ],
        "kvtier: serving",
    );
    let port = free_port();
    let (sidecar_url, listen) = (format!("unix://{socket}"), format!("127.0.0.1:{port}"));
    let mut args = vec![
        "engine",
        "--model",
        "tiny",
        "--kv-reuse",
        "tiered",
        "--block-tokens",
        "16",
        "--sidecar",
        &sidecar_url,
        "--listen",
        &listen,
    ];
    args.extend_from_slice(engine_flags);
    let engine = Kvtier::spawn_until(&args, "serving http://");
    (sidecar, engine, port)
}

/// `/health` as JSON.
fn health(port: u16) -> serde_json::Value {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    serde_json::from_str(out.split_once("\r\n\r\n").unwrap().1).unwrap()
}

/// Polls `/health` until `done` holds for it (every 10 ms, at most 60 s: past that the engine
/// is taken to hang) and returns it.
fn health_until(port: u16, what: &str, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    for _ in 0..6000 {
        let h = health(port);
        if done(&h) {
            return h;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("/health never showed {what}: {}", health(port));
}

#[test]
fn a_burst_after_the_cache_is_full_leaves_no_request_hanging() {
    let dir = tempfile::tempdir().unwrap();
    // 4 running and 16 waiting at most: a burst of 128 is more than the slots, the running
    // set and the waiting queue together.
    let (_sidecar, _engine, port) = engine_with_sidecar(
        dir.path(),
        &[
            "--device-slots",
            "64",
            "--max-running",
            "4",
            "--max-waiting",
            "16",
            "--max-batch-tokens",
            "256",
        ],
    );

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
    assert!(done >= 4 && refused > 0, "{done} served, {refused} refused");
    eprintln!("burst: {done} streams served, {refused} refused with 503 (max_waiting 16)");
    let h = health(port);
    assert_eq!(
        (h["running"].as_u64(), h["waiting"].as_u64()),
        (Some(0), Some(0)),
        "{h}"
    );
}

/// A streaming client that goes away while its request still waits for a slot takes it out
/// of the waiting queue at once (before, the stream's task only noticed at its first event,
/// so a queue of abandoned streams held their places until each was admitted).
#[test]
fn a_stream_that_disconnects_while_waiting_leaves_the_queue_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, _engine, port) = engine_with_sidecar(dir.path(), &["--max-running", "1"]);
    let stream = |max_tokens: u32| {
        let body = serde_json::json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": max_tokens,
                                      "ignore_eos": true, "stream": true})
        .to_string();
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 200", "the stream's response starts at once");
        s
    };
    // The one running slot: a stream of 4000 tokens, left unread (the engine does not wait for
    // its reader).
    let blocker = stream(4000);
    health_until(port, "the blocker running", |h| h["running"] == 1);
    let waiter = stream(8);
    health_until(port, "one waiting", |h| h["waiting"] == 1);
    drop(waiter);
    let h = health_until(port, "the waiting queue empty", |h| h["waiting"] == 0);
    assert_eq!(
        h["running"], 1,
        "the queue emptied because the client left, not because the blocker ended: {h}"
    );
    drop(blocker);
    health_until(port, "the engine idle", |h| {
        h["running"] == 0 && h["waiting"] == 0
    });
}
