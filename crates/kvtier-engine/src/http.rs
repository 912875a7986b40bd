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

use crate::request::{FinishReason, GenRequest, SeqEvent, Usage};
use crate::sampling::Sampling;
use crate::text_codec::TextCodec;
use crate::{Engine, EngineError};

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: Engine,
    /// Text ↔ tokens.
    pub codec: TextCodec,
    /// Renders `/metrics` (engine metrics); `None` serves an empty page.
    pub metrics: Option<PrometheusHandle>,
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/generate", post(generate))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/flush_cache", post(flush_cache))
        .route("/kvtier/clear", post(kvtier_clear))
        .route("/kvtier/stats", get(kvtier_stats))
        .route("/kvtier/reuse", post(kvtier_reuse))
        .with_state(state)
}

/// An error response: `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.0.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        (
            self.0,
            Json(json!({"error": {"message": self.1, "type": kind, "code": self.0.as_u16()}})),
        )
            .into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let code = match e {
            EngineError::BadRequest(_) | EngineError::PoolFull { .. } => StatusCode::BAD_REQUEST,
            EngineError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

/// Parses a JSON body (whatever the Content-Type says: many clients omit it).
fn body<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, ApiError> {
    let v: Value = serde_json::from_slice(b).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    if !v.is_object() {
        return Err(bad("the body must be a JSON object"));
    }
    serde_json::from_value(v).map_err(|e| bad(format!("bad request body: {e}")))
}

/// The fields of an OpenAI completion request this engine reads (others are ignored).
#[derive(Debug, Deserialize)]
struct CompletionRequest {
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
}

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
            "cached_tokens": {"device": u.cached.device, "host": u.cached.host, "disk": u.cached.disk},
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
async fn collect(mut rx: UnboundedReceiver<SeqEvent>) -> Result<(Vec<u32>, FinishReason, Usage), ApiError> {
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token(t) => tokens.push(t),
            SeqEvent::Finished { reason, usage } => return Ok((tokens, reason, usage)),
            SeqEvent::Failed(e) => return Err(bad(e)),
        }
    }
    Err(EngineError::Stopped.into())
}

/// Text appended by the newest token (decoding the whole output keeps multi-token
/// characters whole).
struct Detok {
    ids: Vec<u32>,
    text_len: usize,
}

impl Detok {
    fn push(&mut self, codec: &TextCodec, id: u32) -> String {
        self.ids.push(id);
        let text = codec.decode(&self.ids);
        // A partial UTF-8 sequence decodes as U+FFFD: wait for the rest.
        if text.ends_with('\u{FFFD}') {
            return String::new();
        }
        let delta = text.get(self.text_len..).unwrap_or_default().to_owned();
        self.text_len = text.len();
        delta
    }
}

async fn completions(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let r: CompletionRequest = body(&b)?;
    if r.n.is_some_and(|n| n != 1) {
        return Err(bad("n: only 1 completion per request is supported"));
    }
    let prompt = prompt_ids(&s.codec, &r.prompt)?;
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
    })?;
    let id = request_id();
    let model = s.engine.model().name.clone();
    let created = now_s();
    if !r.stream {
        let (tokens, reason, usage) = collect(rx).await?;
        return Ok(Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": s.codec.decode(&tokens), "logprobs": null, "finish_reason": finish_str(reason)}],
            "usage": usage_json(&usage),
        }))
        .into_response());
    }
    let state = Arc::clone(&s);
    let mut detok = Detok {
        ids: Vec::new(),
        text_len: 0,
    };
    let chunk = move |text: String, finish: Option<&str>, usage: Option<&Usage>| {
        let mut v = json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        });
        if let Some(u) = usage {
            v["usage"] = usage_json(u);
        }
        Event::default().data(v.to_string())
    };
    let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| {
        Ok::<_, Infallible>(match ev {
            SeqEvent::Token(t) => chunk(detok.push(&state.codec, t), None, None),
            SeqEvent::Finished { reason, usage } => {
                chunk(String::new(), Some(finish_str(reason)), Some(&usage))
            }
            SeqEvent::Failed(e) => Event::default().data(json!({"error": {"message": e}}).to_string()),
        })
    });
    let done = tokio_stream::once(Ok(Event::default().data("[DONE]")));
    Ok(Sse::new(events.chain(done)).into_response())
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
}

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: default_max_tokens(),
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            ignore_eos: false,
        }
    }
}

fn meta_info(id: &str, reason: FinishReason, u: &Usage) -> Value {
    json!({
        "id": id,
        "finish_reason": {"type": finish_str(reason)},
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_tokens": u.cached.total(),
        "cached_tokens_details": {"device": u.cached.device, "host": u.cached.host, "disk": u.cached.disk},
        "ttft_ms": u.ttft_ms,
        "e2e_latency": u.e2e_ms / 1e3,
    })
}

async fn generate(State(s): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let r: GenerateRequest = body(&b)?;
    let prompt = match (r.input_ids, r.text) {
        (Some(ids), None) => ids,
        (None, Some(text)) => s.codec.encode(&text)?,
        (Some(_), Some(_)) => return Err(bad("give input_ids or text, not both")),
        (None, None) => return Err(bad("give input_ids or text")),
    };
    let p = r.sampling_params;
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
    })?;
    let id = request_id();
    if !r.stream {
        let (tokens, reason, usage) = collect(rx).await?;
        return Ok(Json(json!({
            "text": s.codec.decode(&tokens),
            "output_ids": tokens,
            "meta_info": meta_info(&id, reason, &usage),
        }))
        .into_response());
    }
    // SGLang streams the cumulative output in each event.
    let state = Arc::clone(&s);
    let mut ids: Vec<u32> = Vec::new();
    let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| {
        Ok::<_, Infallible>(match ev {
            SeqEvent::Token(t) => {
                ids.push(t);
                Event::default().data(json!({"text": state.codec.decode(&ids), "output_ids": ids}).to_string())
            }
            SeqEvent::Finished { reason, usage } => Event::default().data(
                json!({"text": state.codec.decode(&ids), "output_ids": ids, "meta_info": meta_info(&id, reason, &usage)})
                    .to_string(),
            ),
            SeqEvent::Failed(e) => Event::default().data(json!({"error": {"message": e}}).to_string()),
        })
    });
    let done = tokio_stream::once(Ok(Event::default().data("[DONE]")));
    Ok(Sse::new(events.chain(done)).into_response())
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
    let r: ClearRequest = body(&b)?;
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
    let r: ReuseRequest = body(&b)?;
    let policy: crate::KvReuse = r.kv_reuse.parse().map_err(|e: EngineError| bad(e.to_string()))?;
    engine_call(&s, move |e| e.set_kv_reuse(policy)).await?;
    Ok(Json(json!({"kv_reuse": policy})))
}
