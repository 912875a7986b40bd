//! `kvtier engine` as a real process behind its HTTP API: OpenAI completions (plain and
//! streamed), SGLang `/generate`, health, metrics, and clear errors for bad requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

#[path = "common/exposition.rs"]
mod exposition;

struct Engine(Child);

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (status, body) of one HTTP/1.0 request.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[test]
fn the_http_api_serves_completions_generate_health_and_metrics() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "engine",
            "--model",
            "tiny-moe",
            "--block-tokens",
            "16",
            "--device-slots",
            "64",
        ])
        .args([
            "--sidecar",
            &format!("unix://{}", dir.path().join("absent.sock").display()),
        ])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut said_recompute = false;
    loop {
        let line = lines.next().expect("the engine exited before serving").unwrap();
        said_recompute |= line.contains("serving by recompute");
        if line.contains("kvtier engine: serving") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let _engine = Engine(child);
    assert!(
        said_recompute,
        "the engine says the sidecar is not there and it serves anyway"
    );

    // Before any request: every family, with help text, in a valid exposition; and every
    // engine metric the Grafana dashboard queries.
    let (status, text) = http(port, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let families = exposition::check(&text).unwrap_or_else(|e| panic!("{e:#?}\n{text}"));
    for name in kvtier_engine::metrics::ALL {
        assert!(
            families.contains_key(*name),
            "{name} missing at start-up:\n{text}"
        );
    }
    let (engine_names, _) = exposition::dashboard_names();
    assert!(engine_names.len() >= 5, "{engine_names:?}");
    for name in &engine_names {
        assert!(
            exposition::exposes(&families, name),
            "the dashboard's {name} is not on the engine's /metrics"
        );
    }

    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 500).collect();
    let req = serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true})
        .to_string();
    let (status, first) = http(port, "POST", "/v1/completions", &req);
    assert_eq!(status, 200, "{first}");
    let first = json(&first);
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["usage"]["prompt_tokens"], 70);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The same prompt again: 4 full blocks of the first 69 tokens hit the device cache.
    let (_, second) = http(port, "POST", "/v1/completions", &req);
    let second = json(&second);
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    assert_eq!(second["usage"]["kvtier"]["cached_tokens"]["device"], 64);
    assert_eq!(
        second["choices"][0]["text"], first["choices"][0]["text"],
        "a hit gives the same text"
    );

    // Streamed: one event per token, the last with finish_reason and usage, then [DONE].
    let stream_req = serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true, "stream": true});
    let (status, sse) = http(port, "POST", "/v1/completions", &stream_req.to_string());
    assert_eq!(status, 200);
    let events: Vec<&str> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.len(), 6, "{sse}");
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let last = json(events[4]);
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 4);

    // SGLang /generate with input_ids.
    let (status, g) = http(
        port,
        "POST",
        "/generate",
        &serde_json::json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": true}}).to_string(),
    );
    assert_eq!(status, 200, "{g}");
    let g = json(&g);
    assert_eq!(g["output_ids"].as_array().unwrap().len(), 4);
    assert_eq!(g["text"], first["choices"][0]["text"]);
    assert_eq!(g["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(g["meta_info"]["cached_tokens"], 64);

    // Bad requests: 400 with a message naming the problem; the server keeps serving.
    for (path, body, needle) in [
        ("/v1/completions", "not json", "not JSON"),
        ("/v1/completions", "[1]", "JSON object"),
        ("/v1/completions", r#"{"max_tokens": 3}"#, "prompt"),
        ("/v1/completions", r#"{"prompt": [99999]}"#, "token id 99999"),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 0}"#,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "temperature": -2}"#,
            "temperature",
        ),
        ("/v1/completions", r#"{"prompt": "hi", "n": 2}"#, "n:"),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#, "batches"),
        ("/v1/completions", r#"{"prompt": [-1]}"#, "not a token id"),
        ("/generate", r#"{"sampling_params": {}}"#, "input_ids or text"),
    ] {
        let (status, b) = http(port, "POST", path, body);
        assert_eq!(status, 400, "{body}: {b}");
        let msg = json(&b)["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(needle), "{body}: {msg}");
    }

    let (status, h) = http(port, "GET", "/health", "");
    assert_eq!(status, 200);
    let h = json(&h);
    assert_eq!(
        (h["status"].as_str(), h["sidecar_connected"].as_bool()),
        (Some("ok"), Some(false))
    );
    let (_, models) = http(port, "GET", "/v1/models", "");
    assert_eq!(json(&models)["data"][0]["id"], "tiny-moe");
    let (_, text) = http(port, "GET", "/metrics", "");
    let families = exposition::check(&text).unwrap_or_else(|e| panic!("{e:#?}\n{text}"));
    let ttft = &families[kvtier_engine::metrics::TTFT_SECONDS];
    assert_eq!(ttft.kind, "histogram");
    assert!(
        ttft.samples
            .iter()
            .any(|(n, _, v)| n.ends_with("_count") && *v > 0.0),
        "TTFT observed: {ttft:?}"
    );
}

#[test]
fn the_exposition_checker_finds_what_promtool_finds() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 3\n\
                # HELP h_seconds H.\n# TYPE h_seconds histogram\n\
                h_seconds_bucket{le=\"0.1\"} 1\nh_seconds_bucket{le=\"+Inf\"} 2\n\
                h_seconds_sum 0.3\nh_seconds_count 2\n";
    assert!(exposition::check(good).is_ok(), "{:?}", exposition::check(good));
    for (bad, why) in [
        (
            "# HELP g_total G.\n# TYPE g_total gauge\ng_total 1\n",
            "should not end in _total",
        ),
        ("# TYPE c_total counter\nc_total 1\n", "no help text"),
        ("# HELP c C.\n# TYPE c counter\nc 1\n", "should end in _total"),
        (
            "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n# HELP b B.\n# TYPE b gauge\nb 1\na_total{x=\"2\"} 1\n",
            "split by another family",
        ),
        ("# HELP g G.\n# TYPE g gauge\ng 1\ng 2\n", "appears twice"),
        ("# HELP g G.\n# TYPE g gauge\ng{x=1} 1\n", "not quoted"),
        ("# HELP g G.\n# TYPE g gauge\ng one\n", "not a number"),
        (
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
            "no +Inf bucket",
        ),
        (
            "# HELP t_milliseconds T.\n# TYPE t_milliseconds gauge\nt_milliseconds 1\n",
            "base units",
        ),
        (
            "# HELP g G.\ng 1\n# TYPE g gauge\n",
            "TYPE for g after its samples",
        ),
    ] {
        let errors = exposition::check(bad).expect_err(bad);
        assert!(errors.iter().any(|e| e.contains(why)), "{why}: {errors:?}");
    }
}
