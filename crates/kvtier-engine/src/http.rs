//! The engine's HTTP API: OpenAI-compatible `/v1/completions` (streaming by SSE), an
//! SGLang-style `/generate` taking `input_ids`, `/v1/models`, `/health` and `/metrics`.
//!
//! Usage blocks carry `prompt_tokens_details.cached_tokens` (what OpenAI clients read) plus
//! kvtier's breakdown by tier and the request's timings.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::StreamExt;

use kvtier_core::Tier;

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::request::{
    CachedTokens, FinishReason, GenRequest, MAX_TOP_LOGPROBS, SeqEvent, TokenLogprobs, Usage,
};
use crate::sampling::Sampling;
use crate::stop_strings::StopStrings;
use crate::text_codec::TextCodec;
use crate::{Engine, EngineError};

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: Engine,
    /// Text ↔ tokens.
    pub codec: TextCodec,
    /// Conversations → prompt text, for `/v1/chat/completions`.
    pub chat: ChatTemplate,
    /// Renders `/metrics` (engine metrics); `None` serves an empty page.
    pub metrics: Option<PrometheusHandle>,
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/generate", post(generate))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/flush_cache", post(flush_cache))
        .route("/kvtier/clear", post(kvtier_clear))
        .route("/kvtier/stats", get(kvtier_stats))
        .route("/kvtier/reuse", post(kvtier_reuse))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError(StatusCode::NOT_FOUND, format!("no such endpoint: {}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// An error response: `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.0 {
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        };
        let body = Json(json!({"error": {"message": self.1, "type": kind, "code": self.0.as_u16()}}));
        if self.0 == StatusCode::SERVICE_UNAVAILABLE {
            // Overloaded or stopping: a client may try again in a second.
            return (self.0, [(axum::http::header::RETRY_AFTER, "1")], body).into_response();
        }
        (self.0, body).into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let code = match e {
            EngineError::BadRequest(_) | EngineError::PoolFull { .. } => StatusCode::BAD_REQUEST,
            EngineError::Stopped | EngineError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

/// A parameter this engine does not implement, and the test for the value that changes nothing.
type Noop = (&'static str, fn(&Value) -> bool);

/// Parses a JSON body (whatever the Content-Type says: many clients omit it) and checks its
/// field names with [`check_fields`]; returns the request and the parsed object.
fn body<T: serde::de::DeserializeOwned>(
    b: &[u8],
    read: &[&str],
    noop: &[Noop],
) -> Result<(T, Value), ApiError> {
    let v: Value = serde_json::from_slice(b).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    let Value::Object(m) = &v else {
        return Err(bad("the body must be a JSON object"));
    };
    check_fields(m, read, noop)?;
    let r = T::deserialize(&v).map_err(|e| bad(format!("bad request body: {e}")))?;
    Ok((r, v))
}

/// Checks an object's field names: every one is read by this engine (`read`), or is one it
/// does not implement, accepted only at the value that changes nothing (`noop`). Anything
/// else is a 400 naming the field: nothing is accepted and silently ignored.
fn check_fields(m: &serde_json::Map<String, Value>, read: &[&str], noop: &[Noop]) -> Result<(), ApiError> {
    for (k, v) in m {
        if read.contains(&k.as_str()) {
            continue;
        }
        match noop.iter().find(|(name, _)| name == k) {
            Some((_, is_noop)) if is_noop(v) => {}
            Some(_) => return Err(bad(format!("{k} is not supported by this engine (got {v})"))),
            None => return Err(bad(format!("unknown parameter {k:?}"))),
        }
    }
    Ok(())
}

fn is_null_or_false(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}

fn is_null_or_zero(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(0.0)
}

fn is_null_or_one(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(1)
}

fn is_null_or_empty(v: &Value) -> bool {
    v.is_null() || v.as_object().is_some_and(|m| m.is_empty()) || v.as_str() == Some("")
}

/// Parameters of OpenAI's completion API this engine does not implement, with the value at
/// which each changes nothing.
const COMPLETION_NOOPS: &[Noop] = &[
    ("best_of", is_null_or_one),
    ("suffix", is_null_or_empty),
    ("presence_penalty", is_null_or_zero),
    ("frequency_penalty", is_null_or_zero),
    ("logit_bias", is_null_or_empty),
];

/// `stop`: a string, a list of strings, or null.
fn stop_strings(v: &Option<Value>) -> Result<StopStrings, ApiError> {
    let list = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| bad("stop: give strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(bad(format!(
                "stop: give a string or a list of strings, not {other}"
            )));
        }
    };
    StopStrings::new(list).map_err(bad)
}

/// The model a request names must be this engine's (OpenAI answers 404 otherwise).
fn check_model(s: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != s.engine.model().name => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!(
                "the model `{m}` does not exist; this engine serves `{}`",
                s.engine.model().name
            ),
        )),
        _ => Ok(()),
    }
}

/// Sampling ranges as OpenAI documents them.
fn check_sampling(temperature: f32, top_p: f32, max_tokens: usize, key: &str) -> Result<(), ApiError> {
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad(format!("temperature = {temperature}: give 0 to 2")));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(format!("top_p = {top_p}: give more than 0 and at most 1")));
    }
    if max_tokens == 0 {
        return Err(bad(format!("{key} = 0: give at least 1")));
    }
    Ok(())
}

/// The engine's check for `stops`, decoding with this engine's codec.
fn stop_check(s: &Arc<AppState>, stops: &StopStrings) -> Option<crate::request::StopCheck> {
    let st = Arc::clone(s);
    stops.check(Arc::new(move |ids: &[u32]| st.codec.decode(ids)))
}

/// The fields of an OpenAI completion request this engine reads ([`COMPLETION_NOOPS`] and
/// unknown fields are refused by [`check_fields`]).
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: Value,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "one")]
    top_p: f32,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    cache_salt: String,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stop_token_ids: Vec<u32>,
    #[serde(default)]
    min_tokens: usize,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// SGLang's: add `sglext.cached_tokens_details` to the reply.
    #[serde(default)]
    return_cached_tokens_details: bool,
    /// Each token's log-probability and this many alternatives.
    #[serde(default)]
    logprobs: Option<usize>,
    /// Return the prompt's text before the completion.
    #[serde(default)]
    echo: bool,
}

/// `logprobs` / `top_logprobs` within what the engine returns.
fn check_logprobs(n: Option<usize>, key: &str) -> Result<(), ApiError> {
    match n {
        Some(n) if n > MAX_TOP_LOGPROBS => Err(bad(format!("{key} = {n}: give 0 to {MAX_TOP_LOGPROBS}"))),
        _ => Ok(()),
    }
}

/// OpenAI's `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    /// Send a last chunk with no choices and the usage (it is also on the finishing chunk).
    #[serde(default)]
    include_usage: bool,
}

/// Fields of a completion request that are read.
const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "ignore_eos",
    "cache_salt",
    "n",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "stream_options",
    "logprobs",
    "echo",
    // An end-user id for the operator's logs; it changes nothing in the output.
    "user",
    "return_cached_tokens_details",
];

fn default_max_tokens() -> usize {
    16
}

fn one() -> f32 {
    1.0
}

/// A prompt as text, token ids, or a batch of one of those.
fn prompt_ids(codec: &TextCodec, v: &Value) -> Result<Vec<u32>, ApiError> {
    match v {
        Value::String(s) => Ok(codec.encode(s)?),
        Value::Array(a) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => prompt_ids(codec, &a[0]),
        Value::Array(a) if a.iter().all(Value::is_number) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| bad(format!("prompt token {x} is not a token id")))
            })
            .collect(),
        Value::Array(_) => Err(bad(
            "prompt: give one prompt (a string or a token id array); batches are not supported",
        )),
        _ => Err(bad("prompt must be a string or an array of token ids")),
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached.total()},
        "kvtier": {
            "cached_tokens": {"device": u.cached.device, "host": u.cached.host, "disk": u.cached.disk, "remote": u.cached.remote},
            "ttft_ms": u.ttft_ms,
            "tpot_ms": u.tpot_ms,
            "e2e_ms": u.e2e_ms,
            "transfers": u.transfers,
        },
    })
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!(
        "cmpl-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// Runs to the end: tokens, finish reason and usage.
/// A request run to its end.
struct Collected {
    tokens: Vec<u32>,
    /// Per token, when asked for.
    logprobs: Vec<TokenLogprobs>,
    reason: FinishReason,
    usage: Usage,
}

async fn collect(mut rx: UnboundedReceiver<SeqEvent>) -> Result<Collected, ApiError> {
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Prefilled(_) => {}
            SeqEvent::Logprobs(lp) => logprobs.push(lp),
            SeqEvent::Token(t) => tokens.push(t),
            SeqEvent::Finished { reason, usage } => {
                return Ok(Collected {
                    tokens,
                    logprobs,
                    reason,
                    usage,
                });
            }
            SeqEvent::Failed(e) => return Err(bad(e)),
        }
    }
    Err(EngineError::Stopped.into())
}

/// A token as text (one token may be part of a character: then U+FFFD).
fn token_str(codec: &TextCodec, t: u32) -> String {
    codec.decode(&[t])
}

/// OpenAI's completions `logprobs` object for `lps`, whose text starts at `offset`.
fn completion_logprobs(codec: &TextCodec, lps: &[TokenLogprobs], mut offset: usize) -> Value {
    let (mut tokens, mut token_logprobs, mut top, mut offsets) = (vec![], vec![], vec![], vec![]);
    for lp in lps {
        let t = token_str(codec, lp.token);
        offsets.push(offset);
        // In characters, as OpenAI counts them.
        offset += t.chars().count();
        tokens.push(t);
        token_logprobs.push(lp.logprob);
        // Keyed by text: tokens that decode alike (bytes of one character, each U+FFFD) keep
        // the most likely one's logprob (`top` is most likely first).
        let mut alts = serde_json::Map::new();
        for (id, l) in &lp.top {
            alts.entry(token_str(codec, *id)).or_insert(json!(l));
        }
        top.push(Value::Object(alts));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// OpenAI's chat `logprobs.content` entries for `lps`.
fn chat_logprobs(codec: &TextCodec, lps: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, l: f32| {
        let t = token_str(codec, id);
        json!({"token": t, "logprob": l, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|(id, l)| entry(*id, *l)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// Streams a request as SSE: `to_sse` turns each engine event into the events to send (none
/// for some); a failure sends an error event. A task does the work; a client that goes away
/// (the response body dropped) ends it at once, even while the request still waits for a
/// slot and no engine event comes, dropping `rx`, which takes the request out of the waiting
/// queue or frees its sequence. `first` goes out before any engine event, `[DONE]` after the
/// last.
fn sse(
    mut rx: UnboundedReceiver<SeqEvent>,
    first: Vec<Event>,
    mut to_sse: impl FnMut(SeqEvent) -> Vec<Event> + Send + 'static,
) -> Response {
    let (tx, events) = tokio::sync::mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        for e in first {
            if tx.send(e).is_err() {
                return;
            }
        }
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                () = tx.closed() => return,
            };
            let Some(ev) = ev else { break };
            let end = matches!(ev, SeqEvent::Finished { .. } | SeqEvent::Failed(_));
            let out = match ev {
                SeqEvent::Failed(e) => {
                    vec![Event::default().data(json!({"error": {"message": e}}).to_string())]
                }
                ev => to_sse(ev),
            };
            for e in out {
                if tx.send(e).is_err() {
                    return;
                }
            }
            if end {
                break;
            }
        }
    });
    let events = tokio_stream::wrappers::UnboundedReceiverStream::new(events).map(Ok::<_, Infallible>);
    let done = tokio_stream::once(Ok(Event::default().data("[DONE]")));
    Sse::new(events.chain(done)).into_response()
}

/// A streamed chunk as events: the finishing one (with `usage`) carries the usage (cached
/// tokens by tier, and SGLang's `sglext` when asked); with `include_usage` a last chunk without
/// choices repeats it, as OpenAI's.
fn finishing(mut v: Value, usage: Option<&Usage>, include_usage: bool, sglext: bool) -> Vec<Event> {
    let Some(u) = usage else {
        return vec![Event::default().data(v.to_string())];
    };
    v["usage"] = usage_json(u);
    with_sglext(&mut v, u, sglext);
    let mut events = vec![Event::default().data(v.to_string())];
    if include_usage {
        v["choices"] = json!([]);
        events.push(Event::default().data(v.to_string()));
    }
    events
}

/// Text appended by the newest token (decoding the whole output keeps multi-token
/// characters whole), ending before any stop string and holding back what a stop string
/// could still begin with.
struct Detok {
    ids: Vec<u32>,
    text_len: usize,
    stops: StopStrings,
    /// A stop string was reached: nothing more is sent.
    stopped: bool,
}

impl Detok {
    fn new(stops: StopStrings) -> Self {
        Self {
            ids: Vec::new(),
            text_len: 0,
            stops,
            stopped: false,
        }
    }

    fn push(&mut self, codec: &TextCodec, id: u32) -> String {
        self.ids.push(id);
        self.take(codec, false)
    }

    /// The text not yet sent; at the end (`last`) also what was held back.
    fn take(&mut self, codec: &TextCodec, last: bool) -> String {
        if self.stopped {
            return String::new();
        }
        let text = codec.decode(&self.ids);
        // A partial UTF-8 sequence decodes as U+FFFD: wait for the rest.
        if text.ends_with('\u{FFFD}') && !last {
            return String::new();
        }
        let (text, hit) = self.stops.truncate(&text);
        let upto = if hit || last {
            text.len()
        } else {
            self.stops.sendable(text)
        };
        self.stopped = hit;
        let delta = text.get(self.text_len..upto).unwrap_or_default().to_owned();
        self.text_len = self.text_len.max(upto);
        delta
    }
}

async fn completions(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let (r, _): (CompletionRequest, _) = body(&b, COMPLETION_FIELDS, COMPLETION_NOOPS)?;
    check_model(&s, &r.model)?;
    if r.n.is_some_and(|n| n != 1) {
        return Err(bad("n: only 1 completion per request is supported"));
    }
    check_sampling(r.temperature, r.top_p, r.max_tokens, "max_tokens")?;
    check_logprobs(r.logprobs, "logprobs")?;
    if r.echo && r.logprobs.is_some() {
        return Err(bad(
            "echo with logprobs is not supported: the prompt's log-probabilities are not computed",
        ));
    }
    let stops = stop_strings(&r.stop)?;
    let prompt = prompt_ids(&s.codec, &r.prompt)?;
    let echo = if r.echo {
        s.codec.decode(&prompt)
    } else {
        String::new()
    };
    let rx = s.engine.submit(GenRequest {
        prompt,
        max_tokens: r.max_tokens,
        sampling: Sampling {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: r.seed.unwrap_or(0),
        },
        ignore_eos: r.ignore_eos,
        cache_salt: r.cache_salt,
        stop_token_ids: r.stop_token_ids,
        min_tokens: r.min_tokens,
        stop: stop_check(&s, &stops),
        logprobs: r.logprobs,
    })?;
    let id = request_id();
    let model = s.engine.model().name.clone();
    let created = now_s();
    let want_logprobs = r.logprobs.is_some();
    if !r.stream {
        let c = collect(rx).await?;
        let text = s.codec.decode(&c.tokens);
        let (text, _) = stops.truncate(&text);
        let logprobs = if want_logprobs {
            completion_logprobs(&s.codec, &c.logprobs, 0)
        } else {
            Value::Null
        };
        let mut v = json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": format!("{echo}{text}"), "logprobs": logprobs, "finish_reason": finish_str(c.reason)}],
            "usage": usage_json(&c.usage),
        });
        with_sglext(&mut v, &c.usage, r.return_cached_tokens_details);
        return Ok(Json(v).into_response());
    }
    let state = Arc::clone(&s);
    let mut detok = Detok::new(stops);
    let include_usage = r.stream_options.is_some_and(|o| o.include_usage);
    let sglext = r.return_cached_tokens_details;
    let chunk = move |text: String, logprobs: Value, finish: Option<&str>, usage: Option<&Usage>| {
        let v = json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        finishing(v, usage, include_usage, sglext)
    };
    let mut offset = echo.len();
    let first = if echo.is_empty() {
        Vec::new()
    } else {
        chunk(echo, Value::Null, None, None)
    };
    let mut pending: Option<TokenLogprobs> = None;
    Ok(sse(rx, first, move |ev| match ev {
        SeqEvent::Logprobs(lp) => {
            pending = Some(lp);
            Vec::new()
        }
        // One chunk per token (its text may be empty: a partial character, or text a stop
        // string could still begin with, held back).
        SeqEvent::Token(t) => {
            let lp = match pending.take() {
                Some(lp) => {
                    let v = completion_logprobs(&state.codec, std::slice::from_ref(&lp), offset);
                    offset += token_str(&state.codec, lp.token).chars().count();
                    v
                }
                None => Value::Null,
            };
            chunk(detok.push(&state.codec, t), lp, None, None)
        }
        SeqEvent::Finished { reason, usage } => chunk(
            detok.take(&state.codec, true),
            Value::Null,
            Some(finish_str(reason)),
            Some(&usage),
        ),
        SeqEvent::Prefilled(_) | SeqEvent::Failed(_) => Vec::new(),
    }))
}

/// The fields of an OpenAI chat completion request this engine reads.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "one")]
    top_p: f32,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// SGLang's: add `sglext.cached_tokens_details` to the reply.
    #[serde(default)]
    return_cached_tokens_details: bool,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stop_token_ids: Vec<u32>,
    #[serde(default)]
    min_tokens: usize,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    cache_salt: String,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<usize>,
}

/// Fields of a chat completion request that are read.
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "cache_salt",
    "n",
    "user",
    "logprobs",
    "top_logprobs",
    "return_cached_tokens_details",
];

fn is_null_or_empty_list(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty)
}

fn is_null_or_none(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}

fn is_null_or_text_format(v: &Value) -> bool {
    v.is_null() || v.get("type").and_then(Value::as_str) == Some("text")
}

/// Chat parameters this engine does not implement, at their off values.
const CHAT_NOOPS: &[Noop] = &[
    ("presence_penalty", is_null_or_zero),
    ("frequency_penalty", is_null_or_zero),
    ("logit_bias", is_null_or_empty),
    ("tools", is_null_or_empty_list),
    ("tool_choice", is_null_or_none),
    ("parallel_tool_calls", Value::is_boolean),
    ("response_format", is_null_or_text_format),
];

/// The conversation as text messages: `content` a string, or text parts.
fn chat_messages(messages: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(bad("messages: give at least one message"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("messages[{i}].role: give a string")))?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => Ok(t),
                            (kind, _) => Err(bad(format!(
                                "messages[{i}].content: only text parts are supported (got {})",
                                kind.unwrap_or("a part without a type")
                            ))),
                        }
                    })
                    .collect::<Result<String, _>>()?,
                None | Some(Value::Null) => String::new(),
                Some(other) => return Err(bad(format!("messages[{i}].content: give text, not {other}"))),
            };
            Ok(ChatMessage {
                role: role.to_owned(),
                content,
            })
        })
        .collect()
}

async fn chat_completions(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let (r, _): (ChatRequest, _) = body(&b, CHAT_FIELDS, CHAT_NOOPS)?;
    check_model(&s, &r.model)?;
    if r.n.is_some_and(|n| n != 1) {
        return Err(bad("n: only 1 completion per request is supported"));
    }
    let max_tokens = r
        .max_completion_tokens
        .or(r.max_tokens)
        .unwrap_or(default_max_tokens());
    check_sampling(r.temperature, r.top_p, max_tokens, "max_tokens")?;
    check_logprobs(r.top_logprobs, "top_logprobs")?;
    let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, None | Some(0)) => None,
        (false, Some(_)) => return Err(bad("top_logprobs needs logprobs: true")),
    };
    let stops = stop_strings(&r.stop)?;
    let text = s.chat.render(&chat_messages(&r.messages)?)?;
    let prompt = s.codec.encode(&text)?;
    let rx = s.engine.submit(GenRequest {
        prompt,
        max_tokens,
        sampling: Sampling {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: r.seed.unwrap_or(0),
        },
        ignore_eos: r.ignore_eos,
        cache_salt: r.cache_salt,
        stop_token_ids: r.stop_token_ids,
        min_tokens: r.min_tokens,
        stop: stop_check(&s, &stops),
        logprobs,
    })?;
    let id = format!("chat{}", request_id());
    let model = s.engine.model().name.clone();
    let created = now_s();
    if !r.stream {
        let c = collect(rx).await?;
        let text = s.codec.decode(&c.tokens);
        let (text, _) = stops.truncate(&text);
        let lp = if logprobs.is_some() {
            chat_logprobs(&s.codec, &c.logprobs)
        } else {
            Value::Null
        };
        let mut v = json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                         "finish_reason": finish_str(c.reason)}],
            "usage": usage_json(&c.usage),
        });
        with_sglext(&mut v, &c.usage, r.return_cached_tokens_details);
        return Ok(Json(v).into_response());
    }
    let include_usage = r.stream_options.is_some_and(|o| o.include_usage);
    let sglext = r.return_cached_tokens_details;
    let chunk = move |delta: Value, logprobs: Value, finish: Option<&str>, usage: Option<&Usage>| {
        let v = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        finishing(v, usage, include_usage, sglext)
    };
    let state = Arc::clone(&s);
    let mut detok = Detok::new(stops);
    // The first chunk names the role, as OpenAI's do.
    let first = chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        None,
        None,
    );
    let mut pending: Option<TokenLogprobs> = None;
    Ok(sse(rx, first, move |ev| match ev {
        SeqEvent::Logprobs(lp) => {
            pending = Some(lp);
            Vec::new()
        }
        SeqEvent::Token(t) => {
            let lp = pending.take().map_or(Value::Null, |lp| {
                chat_logprobs(&state.codec, std::slice::from_ref(&lp))
            });
            chunk(json!({"content": detok.push(&state.codec, t)}), lp, None, None)
        }
        SeqEvent::Finished { reason, usage } => {
            let rest = detok.take(&state.codec, true);
            let delta = if rest.is_empty() {
                json!({})
            } else {
                json!({"content": rest})
            };
            chunk(delta, Value::Null, Some(finish_str(reason)), Some(&usage))
        }
        SeqEvent::Prefilled(_) | SeqEvent::Failed(_) => Vec::new(),
    }))
}

/// SGLang's `/generate` body: `input_ids` or `text`, and `sampling_params`.
#[derive(Debug, Deserialize)]
struct GenerateRequest {
    #[serde(default)]
    input_ids: Option<Vec<u32>>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    sampling_params: SamplingParams,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    cache_salt: String,
    #[serde(default)]
    rid: Option<String>,
}

/// Top-level fields of `/generate` that are read.
const GENERATE_FIELDS: &[&str] = &[
    "input_ids",
    "text",
    "sampling_params",
    "stream",
    "cache_salt",
    "rid",
];

/// Fields SGLang's clients send (its `bench_serving.py` among them) for features this engine
/// does not have, accepted at the value that leaves them off.
const GENERATE_NOOPS: &[Noop] = &[
    ("lora_path", Value::is_null),
    ("return_logprob", is_null_or_false),
    // Where logprobs would start: meaningless with return_logprob off.
    ("logprob_start_len", Value::is_number),
    ("top_logprobs_num", is_null_or_zero),
    ("return_text_in_logprobs", Value::is_boolean),
    ("image_data", Value::is_null),
    ("return_routed_experts", is_null_or_false),
];

/// `sampling_params` fields that are read.
const SAMPLING_FIELDS: &[&str] = &[
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "min_new_tokens",
];

fn is_null_or_minus_one(v: &Value) -> bool {
    v.is_null() || v.as_i64() == Some(-1)
}

fn is_null_or_true(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(true)
}

/// SGLang sampling parameters this engine does not implement, at their off values.
const SAMPLING_NOOPS: &[Noop] = &[
    ("top_k", is_null_or_minus_one),
    ("min_p", is_null_or_zero),
    ("frequency_penalty", is_null_or_zero),
    ("presence_penalty", is_null_or_zero),
    ("repetition_penalty", is_null_or_one),
    ("n", is_null_or_one),
    ("skip_special_tokens", is_null_or_true),
    ("spaces_between_special_tokens", is_null_or_true),
    ("no_stop_trim", is_null_or_false),
];

#[derive(Debug, Deserialize)]
struct SamplingParams {
    #[serde(default = "default_max_tokens")]
    max_new_tokens: usize,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "one")]
    top_p: f32,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stop_token_ids: Vec<u32>,
    #[serde(default)]
    min_new_tokens: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: default_max_tokens(),
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            ignore_eos: false,
            stop: None,
            stop_token_ids: Vec::new(),
            min_new_tokens: 0,
        }
    }
}

/// SGLang's OpenAI-route extension: with `return_cached_tokens_details`, a reply (or a stream's
/// finishing chunk) carries `sglext.cached_tokens_details`, which SGLang's
/// `bench_serving.py --cache-report` reads for its `sglang-oai` backends.
fn with_sglext(v: &mut Value, u: &Usage, on: bool) {
    if on {
        v["sglext"] = json!({"cached_tokens_details": cached_details(&u.cached)});
    }
}

/// Cached tokens by tier in SGLang's HiCache terms, as its `--cache-report` reads them:
/// `device` (the engine's own cache), `host` (kvtier's host tier, HiCache's L2) and `storage`
/// (kvtier's disk and remote tiers, HiCache's L3, with `storage_backend` naming them:
/// `kvtier-disk`, or `kvtier-disk+remote` once a block came from the remote tier); `disk`
/// and `remote` give `storage` under kvtier's own names.
fn cached_details(c: &CachedTokens) -> Value {
    let backend = if c.remote > 0 {
        "kvtier-disk+remote"
    } else {
        "kvtier-disk"
    };
    json!({"device": c.device, "host": c.host, "storage": c.disk + c.remote, "storage_backend": backend,
           "disk": c.disk, "remote": c.remote})
}

/// SGLang's `meta_info`, on every streamed event and in the full reply: `finish_reason` is
/// null until the last event; `cached_tokens` is known from the first token on.
fn meta_info(
    id: &str,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached: Option<CachedTokens>,
    end: Option<(FinishReason, &Usage)>,
) -> Value {
    let cached = end.map(|(_, u)| u.cached).or(cached).unwrap_or_default();
    let mut v = json!({
        "id": id,
        "finish_reason": end.map(|(r, _)| json!({"type": finish_str(r), "matched": null})),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached.total(),
        "cached_tokens_details": cached_details(&cached),
    });
    if let Some((_, u)) = end {
        v["ttft_ms"] = json!(u.ttft_ms);
        v["e2e_latency"] = json!(u.e2e_ms / 1e3);
    }
    v
}

async fn generate(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let (r, v): (GenerateRequest, _) = body(&b, GENERATE_FIELDS, GENERATE_NOOPS)?;
    if let Some(Value::Object(p)) = v.get("sampling_params") {
        check_fields(p, SAMPLING_FIELDS, SAMPLING_NOOPS)
            .map_err(|ApiError(c, m)| ApiError(c, format!("sampling_params: {m}")))?;
    }
    let prompt = match (r.input_ids, r.text) {
        (Some(ids), None) => ids,
        (None, Some(text)) => s.codec.encode(&text)?,
        (Some(_), Some(_)) => return Err(bad("give input_ids or text, not both")),
        (None, None) => return Err(bad("give input_ids or text")),
    };
    let p = r.sampling_params;
    check_sampling(
        p.temperature,
        p.top_p,
        p.max_new_tokens,
        "sampling_params.max_new_tokens",
    )?;
    let stops = stop_strings(&p.stop)?;
    let prompt_tokens = prompt.len();
    let rx = s.engine.submit(GenRequest {
        prompt,
        max_tokens: p.max_new_tokens,
        sampling: Sampling {
            temperature: p.temperature,
            top_p: p.top_p,
            seed: p.seed.unwrap_or(0),
        },
        ignore_eos: p.ignore_eos,
        cache_salt: r.cache_salt,
        stop_token_ids: p.stop_token_ids,
        min_tokens: p.min_new_tokens,
        stop: stop_check(&s, &stops),
        logprobs: None,
    })?;
    let id = r.rid.unwrap_or_else(request_id);
    if !r.stream {
        let c = collect(rx).await?;
        let text = s.codec.decode(&c.tokens);
        let (text, _) = stops.truncate(&text);
        return Ok(Json(json!({
            "text": text,
            "output_ids": c.tokens,
            "meta_info": meta_info(&id, prompt_tokens, c.tokens.len(), None, Some((c.reason, &c.usage))),
        }))
        .into_response());
    }
    // SGLang streams the cumulative output in each event, with meta_info.
    let state = Arc::clone(&s);
    let mut detok = Detok::new(stops);
    let mut text = String::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut cached = None;
    Ok(sse(rx, Vec::new(), move |ev| {
        let end = match ev {
            SeqEvent::Prefilled(c) => {
                cached = Some(c);
                return Vec::new();
            }
            SeqEvent::Token(t) => {
                ids.push(t);
                text.push_str(&detok.push(&state.codec, t));
                None
            }
            SeqEvent::Finished { reason, usage } => {
                text.push_str(&detok.take(&state.codec, true));
                Some((reason, usage))
            }
            SeqEvent::Logprobs(_) | SeqEvent::Failed(_) => return Vec::new(),
        };
        let meta = meta_info(
            &id,
            prompt_tokens,
            ids.len(),
            cached,
            end.as_ref().map(|(r, u)| (*r, u)),
        );
        vec![Event::default().data(json!({"text": text, "output_ids": ids, "meta_info": meta}).to_string())]
    }))
}

async fn model_by_id(
    State(s): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    check_model(&s, &Some(id))?;
    Ok(Json(
        json!({"id": s.engine.model().name, "object": "model", "owned_by": "kvtier",
                   "max_model_len": s.engine.model().max_positions}),
    ))
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": s.engine.model().name, "object": "model", "owned_by": "kvtier",
                  "max_model_len": s.engine.model().max_positions}],
    }))
}

async fn health(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let engine = s.engine.clone();
    let stats = tokio::task::spawn_blocking(move || engine.stats())
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    Ok(Json(json!({
        "status": "ok",
        "model": s.engine.model().name,
        "kv_reuse": stats.kv_reuse,
        "sidecar_connected": stats.sidecar_connected,
        "running": stats.running,
        "waiting": stats.waiting,
        "device_cached_blocks": stats.device_cached_blocks,
        "device_slots": stats.device_slots,
        "block_tokens": s.engine.geometry().block_tokens(),
        "parameters": s.engine.model().parameters(),
    })))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let text = s
        .metrics
        .as_ref()
        .map(PrometheusHandle::render)
        .unwrap_or_default();
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// Runs a blocking engine call off the async workers.
async fn engine_call<T: Send + 'static>(
    s: &Arc<AppState>,
    f: impl FnOnce(&crate::Engine) -> Result<T, EngineError> + Send + 'static,
) -> Result<T, ApiError> {
    let engine = s.engine.clone();
    tokio::task::spawn_blocking(move || f(&engine))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(ApiError::from)
}

/// SGLang's `/flush_cache`: forget the device prefix cache (after in-flight stores finish).
async fn flush_cache(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    engine_call(&s, |e| e.clear_device_cache()).await?;
    Ok(Json(json!({"flushed": "device"})))
}

#[derive(Debug, Deserialize)]
struct ClearRequest {
    tier: String,
}

/// Forget kvtier's blocks in one tier (`host`, `disk`) or `all` (benchmarks between scenarios).
async fn kvtier_clear(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Json<Value>, ApiError> {
    let (r, _): (ClearRequest, _) = body(&b, &["tier"], &[])?;
    let tier = match r.tier.as_str() {
        "host" => Some(Tier::Host),
        "disk" => Some(Tier::Disk),
        "all" => None,
        other => return Err(bad(format!("tier {other:?}: choose host, disk or all"))),
    };
    let (host, disk) = engine_call(&s, move |e| e.clear_tier(tier))
        .await
        .map_err(unavailable)?;
    Ok(Json(json!({"host_blocks": host, "disk_blocks": disk})))
}

/// The sidecar's statistics snapshot.
async fn kvtier_stats(State(s): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let json = engine_call(&s, |e| e.sidecar_stats())
        .await
        .map_err(unavailable)?;
    Ok(([("content-type", "application/json")], json).into_response())
}

/// Sidecar trouble is the service's, not the request's.
fn unavailable(e: ApiError) -> ApiError {
    if e.0 == StatusCode::INTERNAL_SERVER_ERROR {
        ApiError(StatusCode::SERVICE_UNAVAILABLE, e.1)
    } else {
        e
    }
}

#[derive(Debug, Deserialize)]
struct ReuseRequest {
    kv_reuse: String,
}

/// Switch the prefix reuse policy (`none`, `device`, `tiered`, `kvtier`) for the next requests.
async fn kvtier_reuse(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Json<Value>, ApiError> {
    let (r, _): (ReuseRequest, _) = body(&b, &["kv_reuse"], &[])?;
    let policy: crate::KvReuse = r.kv_reuse.parse().map_err(|e: EngineError| bad(e.to_string()))?;
    engine_call(&s, move |e| e.set_kv_reuse(policy)).await?;
    Ok(Json(json!({"kv_reuse": policy})))
}
