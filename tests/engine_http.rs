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

/// Starts `kvtier engine` (tiny-moe, blocks of 16, no sidecar); returns it, its port and
/// whether it said it serves by recompute.
fn start_engine(dir: &std::path::Path) -> (Engine, u16, bool) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
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
            &format!("unix://{}", dir.join("absent.sock").display()),
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
    (Engine(child), port, said_recompute)
}

#[test]
fn the_http_api_serves_completions_generate_health_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, port, said_recompute) = start_engine(dir.path());
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

/// The text of one streamed completion: its chunks' texts joined, and the last finish reason.
fn streamed(port: u16, req: &Value) -> (String, String) {
    let mut req = req.clone();
    req["stream"] = Value::Bool(true);
    let (status, sse) = http(port, "POST", "/v1/completions", &req.to_string());
    assert_eq!(status, 200, "{sse}");
    let mut text = String::new();
    let mut finish = String::new();
    for e in sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
    {
        let v = json(e);
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    (text, finish)
}

#[test]
fn stop_sequences_parameters_and_error_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, port, _) = start_engine(dir.path());
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 200).collect();
    let base = serde_json::json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (status, full) = http(port, "POST", "/v1/completions", &base.to_string());
    assert_eq!(status, 200, "{full}");
    let full = json(&full)["choices"][0]["text"].as_str().unwrap().to_owned();

    // A stop string from the middle of the greedy output (two characters, so it spans
    // tokens): the text ends right before its first occurrence, finish_reason "stop", the
    // same streamed as whole.
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    let (at, stop) = (2..chars.len().saturating_sub(2))
        .map(|i| {
            let end = chars.get(i + 2).map_or(full.len(), |c| c.0);
            (chars[i].0, &full[chars[i].0..end])
        })
        .find(|(at, s)| !s.contains('\u{FFFD}') && full.find(s) == Some(*at))
        .unwrap_or_else(|| panic!("no usable stop string in {full:?}"));
    let mut req = base.clone();
    req["stop"] = serde_json::json!([stop, "never-appears"]);
    let (_, body) = http(port, "POST", "/v1/completions", &req.to_string());
    let r = json(&body);
    assert_eq!(
        r["choices"][0]["text"].as_str().unwrap(),
        &full[..at],
        "stop {stop:?} in {full:?}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() < 24);
    assert_eq!(streamed(port, &req), (full[..at].to_owned(), "stop".to_owned()));
    assert_eq!(streamed(port, &base), (full.clone(), "length".to_owned()));

    // SGLang's return_cached_tokens_details: sglext.cached_tokens_details on the reply and on
    // a stream's finishing chunk (what bench_serving's --cache-report reads on sglang-oai),
    // agreeing with usage; absent unless asked.
    let mut ask = base.clone();
    ask["return_cached_tokens_details"] = Value::Bool(true);
    let r = json(&http(port, "POST", "/v1/completions", &ask.to_string()).1);
    let d = &r["sglext"]["cached_tokens_details"];
    let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "the prompt was seen before: {r}");
    assert_eq!(
        d["device"].as_u64().unwrap() + d["host"].as_u64().unwrap() + d["storage"].as_u64().unwrap(),
        cached,
        "{r}"
    );
    assert!(json(&http(port, "POST", "/v1/completions", &base.to_string()).1)["sglext"].is_null());
    ask["stream"] = Value::Bool(true);
    let (_, sse) = http(port, "POST", "/v1/completions", &ask.to_string());
    let with: Vec<Value> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(json)
        .filter(|v| !v["sglext"].is_null())
        .collect();
    assert_eq!(with.len(), 1, "only the finishing chunk: {sse}");
    assert_eq!(with[0]["sglext"]["cached_tokens_details"], *d);
    let chat = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "return_cached_tokens_details": true});
    let (status, body) = http(port, "POST", "/v1/chat/completions", &chat.to_string());
    assert_eq!(status, 200, "{body}");
    assert!(
        json(&body)["sglext"]["cached_tokens_details"].is_object(),
        "{body}"
    );

    // stop_token_ids end at that token; min_tokens keeps them out of the first tokens.
    let generate = serde_json::json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": true}});
    let (_, g) = http(port, "POST", "/generate", &generate.to_string());
    let ids: Vec<u64> = json(&g)["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let stop_id = ids[3];
    let first = ids.iter().position(|&t| t == stop_id).unwrap();
    let mut req = base.clone();
    req["stop_token_ids"] = serde_json::json!([stop_id]);
    let (_, body) = http(port, "POST", "/v1/completions", &req.to_string());
    let r = json(&body);
    assert_eq!(r["usage"]["completion_tokens"], first + 1, "{body}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let mut gen_stop = generate.clone();
    gen_stop["sampling_params"]["stop_token_ids"] = serde_json::json!([ids[0]]);
    gen_stop["sampling_params"]["min_new_tokens"] = serde_json::json!(5);
    let (_, body) = http(port, "POST", "/generate", &gen_stop.to_string());
    let out: Vec<u64> = json(&body)["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(out.len() >= 5, "min_new_tokens: {out:?}");
    assert!(
        !out[..5].contains(&ids[0]),
        "the stop token was masked out: {out:?}"
    );

    // SGLang's streaming shape (bench_serving's payload): meta_info on every event.
    let sg = serde_json::json!({"input_ids": prompt, "stream": true, "lora_path": null, "return_logprob": false,
        "logprob_start_len": -1, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": true}});
    let (status, sse) = http(port, "POST", "/generate", &sg.to_string());
    assert_eq!(status, 200, "{sse}");
    let events: Vec<Value> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(json)
        .collect();
    // One event per token, then the finishing one (same text, no new tokens: SGLang's
    // clients skip it for inter-token latency).
    assert_eq!(events.len(), 5, "{sse}");
    for (i, e) in events.iter().enumerate() {
        let m = &e["meta_info"];
        assert_eq!(m["completion_tokens"], (i + 1).min(4), "{e}");
        assert_eq!(m["prompt_tokens"], 40, "{e}");
        assert_eq!(
            m["cached_tokens"], 32,
            "the same prompt again hits the device cache: {e}"
        );
        assert_eq!(m["finish_reason"].is_null(), i < 4, "{e}");
    }
    assert_eq!(events[4]["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(events[4]["text"], events[3]["text"]);

    // Models, and every error status in the {"error": {...}} shape.
    let (status, m) = http(port, "GET", "/v1/models/tiny-moe", "");
    assert_eq!((status, json(&m)["id"].as_str()), (200, Some("tiny-moe")));
    for (method, path, body, want, needle) in [
        ("GET", "/v1/models/gpt-4", "", 404, "gpt-4"),
        (
            "POST",
            "/v1/completions",
            r#"{"model": "gpt-4", "prompt": "hi"}"#,
            404,
            "gpt-4",
        ),
        ("GET", "/no/such/path", "", 404, "/no/such/path"),
        ("GET", "/v1/completions", "", 405, "GET"),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "echo": true, "logprobs": 1}"#,
            400,
            "echo",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "logprobs": 21}"#,
            400,
            "logprobs",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "best_of": 3}"#,
            400,
            "best_of",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "suffix": "x"}"#,
            400,
            "suffix",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "presence_penalty": 1.5}"#,
            400,
            "presence_penalty",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "temperature": 5}"#,
            400,
            "temperature",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "top_p": 0}"#,
            400,
            "top_p",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "stop": ["a","b","c","d","e"]}"#,
            400,
            "stop",
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "hi", "frobnicate": 1}"#,
            400,
            "frobnicate",
        ),
        (
            "POST",
            "/generate",
            r#"{"text": "hi", "sampling_params": {"top_k": 5}}"#,
            400,
            "top_k",
        ),
        (
            "POST",
            "/generate",
            r#"{"text": "hi", "return_logprob": true}"#,
            400,
            "return_logprob",
        ),
    ] {
        let (status, b) = http(port, method, path, body);
        assert_eq!(status, want, "{method} {path} {body}: {b}");
        let msg = json(&b)["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(msg.contains(needle), "{method} {path} {body}: {b}");
    }
    // Parameters at their no-op values are accepted.
    let ok = r#"{"prompt": "hi", "max_tokens": 2, "echo": false, "logprobs": null, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "user": "u1", "model": "tiny-moe"}"#;
    let (status, b) = http(port, "POST", "/v1/completions", ok);
    assert_eq!(status, 200, "{b}");
}

#[test]
fn chat_completions_render_the_template_and_stream_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, port, _) = start_engine(dir.path());
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
    ]);
    let chat = serde_json::json!({"model": "tiny-moe", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (status, body) = http(port, "POST", "/v1/chat/completions", &chat.to_string());
    assert_eq!(status, 200, "{body}");
    let r = json(&body);
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    // The presets' template is ChatML; the same prompt through /v1/completions gives the same
    // greedy text (the byte codec: one token per byte).
    let rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(r["usage"]["prompt_tokens"], rendered.len());
    let plain =
        serde_json::json!({"prompt": rendered, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (_, p) = http(port, "POST", "/v1/completions", &plain.to_string());
    assert_eq!(
        r["choices"][0]["message"]["content"],
        json(&p)["choices"][0]["text"]
    );
    assert_eq!(
        json(&p)["usage"]["prompt_tokens_details"]["cached_tokens"],
        96,
        "the chat's prefix is cached"
    );

    // Streamed: a role chunk, content deltas, a finishing chunk with usage; with
    // include_usage one more without choices.
    let mut stream = chat.clone();
    stream["stream"] = Value::Bool(true);
    stream["stream_options"] = serde_json::json!({"include_usage": true});
    let (status, sse) = http(port, "POST", "/v1/chat/completions", &stream.to_string());
    assert_eq!(status, 200, "{sse}");
    let events: Vec<&str> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| json(e)).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, r["choices"][0]["message"]["content"].as_str().unwrap());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0, "{last}");
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");

    for (body, needle) in [
        (serde_json::json!({"messages": []}), "at least one message"),
        (
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "only text parts",
        ),
        (serde_json::json!({"messages": [{"content": "x"}]}), "role"),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            "tools",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 25}),
            "top_logprobs",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "temperature": 3}),
            "temperature",
        ),
    ] {
        let (status, b) = http(port, "POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 400, "{body}: {b}");
        assert!(
            json(&b)["error"]["message"].as_str().unwrap().contains(needle),
            "{body}: {b}"
        );
    }
    let (status, b) = http(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}"#,
    );
    assert_eq!(status, 404, "{b}");
}

#[test]
fn logprobs_come_from_the_model_and_echo_returns_the_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let (_engine, port, _) = start_engine(dir.path());
    let prompt = "The quick brown fox";
    let req = serde_json::json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "logprobs": 3});
    let (status, body) = http(port, "POST", "/v1/completions", &req.to_string());
    assert_eq!(status, 200, "{body}");
    let r = json(&body);
    let lp = &r["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 5, "{lp}");
    let text: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(
        text,
        r["choices"][0]["text"].as_str().unwrap(),
        "tokens spell the text (byte codec)"
    );
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert!(chosen <= 0.0);
        // Greedy draws the most likely token (alternatives that decode to the same text share
        // one key, which keeps the most likely one's logprob).
        assert!(
            (chosen - best).abs() < 1e-4,
            "greedy draws the most likely token: {chosen} vs {best}"
        );
        assert!(top.values().map(|v| v.as_f64().unwrap().exp()).sum::<f64>() <= 1.0 + 1e-4);
        let offset = |i: usize| lp["text_offset"][i].as_u64().unwrap();
        assert!(
            i == 0 && offset(0) == 0 || i > 0 && offset(i) >= offset(i - 1),
            "{lp}"
        );
    }
    // Streamed: each token's chunk carries its logprobs.
    let mut stream = req.clone();
    stream["stream"] = Value::Bool(true);
    let (_, sse) = http(port, "POST", "/v1/completions", &stream.to_string());
    let streamed: Vec<f64> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| json(e)["choices"][0]["logprobs"]["token_logprobs"][0].as_f64())
        .collect();
    let whole: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(streamed.len(), 5);
    for (a, b) in streamed.iter().zip(&whole) {
        assert!((a - b).abs() < 1e-5, "{streamed:?} vs {whole:?}");
    }

    // Chat: logprobs.content per token with top_logprobs.
    let chat = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let (status, body) = http(port, "POST", "/v1/chat/completions", &chat.to_string());
    assert_eq!(status, 200, "{body}");
    let content = json(&body)["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 4);
    for c in &content {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert!(c["logprob"].as_f64().unwrap() >= top[0]["logprob"].as_f64().unwrap() - 1e-4);
        assert!(c["bytes"].is_array());
    }
    let (status, b) = http(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#,
    );
    assert_eq!(status, 400, "{b}");

    // echo: the prompt's text, then the completion.
    let echo = serde_json::json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true, "echo": true});
    let (_, body) = http(port, "POST", "/v1/completions", &echo.to_string());
    assert!(
        json(&body)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(prompt),
        "{body}"
    );
    let (status, _) = http(
        port,
        "POST",
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "echo": true, "logprobs": 1}).to_string(),
    );
    assert_eq!(status, 400);
    let (status, _) = http(
        port,
        "POST",
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "logprobs": 21}).to_string(),
    );
    assert_eq!(status, 400);
}
