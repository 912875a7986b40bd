//! `kvtier bench serve`: a load generator against the engine's HTTP API, modeled on SGLang's
//! `bench_serving`, comparing where a shared prompt prefix comes from: recomputed, loaded from
//! kvtier's host tier, from its disk tier, or already resident in the engine's device memory.
//!
//! Each run (scenario × batch size) warms the prefix as the scenario needs, then sends
//! `num_prompts` requests of `input_len` tokens — the prefix (`hit_rate` of the prompt, whole
//! blocks) plus a unique suffix — with at most `max_concurrency` in flight, streamed, and
//! measures TTFT, TPOT, ITL and throughput as `bench_serving` does.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::ByteSize;
use serde::Serialize;
use serde_json::{Value, json};

use crate::BenchError;
use crate::http_client::{call_json, post_events, split_base};
use crate::sidecar::{Running, SidecarTarget, base_overrides, start};
use crate::summary::Summary;
use crate::workload::SeedFigures;

/// Where the measured requests' prefix comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// No reuse: every prompt is computed.
    Recompute,
    /// The prefix is only in kvtier's host tier (device cache flushed, disk not used).
    Host,
    /// The prefix is only on kvtier's disk (device cache and host tier flushed).
    Disk,
    /// The prefix is resident in the engine's device memory.
    Hbm,
}

impl Scenario {
    /// The name used on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Host => "host",
            Self::Disk => "disk",
            Self::Hbm => "hbm",
        }
    }
}

impl std::str::FromStr for Scenario {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, BenchError> {
        match s {
            "recompute" => Ok(Self::Recompute),
            "host" => Ok(Self::Host),
            "disk" => Ok(Self::Disk),
            "hbm" => Ok(Self::Hbm),
            other => Err(BenchError::InvalidConfig(format!(
                "--scenarios: unknown scenario {other:?} (recompute, host, disk, hbm)"
            ))),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// A running engine (`http://host:port`); `None` starts one with an embedded sidecar.
    pub base_url: Option<String>,
    /// Model of the engine the benchmark starts (preset or directory).
    pub model: String,
    /// Its layer cut.
    pub layers: Option<usize>,
    /// Seed of its weights and of the dataset.
    pub seed: u64,
    /// Prompt tokens per request.
    pub input_len: usize,
    /// Tokens generated per request.
    pub output_len: usize,
    /// Fraction of the prompt that is the shared prefix.
    pub hit_rate: f64,
    /// Requests per run (default: the batch size).
    pub num_prompts: Option<usize>,
    /// Requests in flight at most (default: the batch size).
    pub max_concurrency: Option<usize>,
    /// Requests per second (Poisson arrivals); infinite sends them all at once.
    pub request_rate: f64,
    /// Batch sizes to sweep.
    pub batches: Vec<usize>,
    /// Scenarios, in order.
    pub scenarios: Vec<Scenario>,
    /// KV block size of the engine the benchmark starts.
    pub block_tokens: u32,
    /// Its chunked-prefill budget.
    pub max_batch_tokens: usize,
    /// Its sidecar's host tier.
    pub host_capacity: ByteSize,
    /// Its sidecar's disk tier.
    pub disk_capacity: ByteSize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            base_url: None,
            model: "qwen3-30b-a3b".into(),
            layers: Some(1),
            seed: 0,
            input_len: 4096,
            output_len: 16,
            hit_rate: 0.9,
            num_prompts: None,
            max_concurrency: None,
            request_rate: f64::INFINITY,
            batches: vec![4],
            scenarios: vec![Scenario::Recompute, Scenario::Host, Scenario::Disk, Scenario::Hbm],
            block_tokens: 64,
            max_batch_tokens: 512,
            host_capacity: ByteSize::gib(2),
            disk_capacity: ByteSize::gib(4),
        }
    }
}

/// One measured request.
#[derive(Debug, Clone, Default)]
struct RequestRecord {
    sent: Option<Instant>,
    ok: bool,
    error: String,
    tokens: Vec<Instant>,
    end: Option<Instant>,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    cached_by_tier: [usize; 3],
    /// (start, end, bytes, active) of the load and of the stores, ms after arrival.
    load: Option<(f64, f64, u64, f64)>,
    store: Option<(f64, f64, u64, f64)>,
}

/// Figures of one run (scenario × batch).
#[derive(Debug, Clone, Serialize)]
pub struct ServeRun {
    /// The scenario.
    pub scenario: Scenario,
    /// The batch size.
    pub batch: usize,
    /// Requests sent.
    pub num_prompts: usize,
    /// Concurrency bound (`None`: not set).
    pub max_concurrency: Option<usize>,
    /// Requests per second (infinite: all at once).
    pub request_rate: f64,
    /// Requests that completed.
    pub successful: usize,
    /// Requests that failed.
    pub failed: usize,
    /// First request sent → last finished, s.
    pub duration_s: f64,
    /// Prompt tokens of the successful requests.
    pub total_input_tokens: usize,
    /// Generated tokens.
    pub total_output_tokens: usize,
    /// Prompt tokens served from a cache (all requests).
    pub cached_tokens: usize,
    /// Of those, by tier (device, host, disk).
    pub cached_device: usize,
    /// From kvtier's host tier.
    pub cached_host: usize,
    /// From kvtier's disk tier.
    pub cached_disk: usize,
    /// Shared prefix length, tokens.
    pub prefix_tokens: usize,
    /// End-to-end latency, ms.
    pub e2e_ms: Summary,
    /// Time to first token, ms.
    pub ttft_ms: Summary,
    /// Time per output token after the first, ms.
    pub tpot_ms: Summary,
    /// Inter-token latency, ms.
    pub itl_ms: Summary,
    /// ITL p95 and max, ms.
    pub itl_p95_ms: f64,
    /// Largest ITL.
    pub itl_max_ms: f64,
    /// The kvtier offload figures of this run's loads and stores (the seed's ten lines).
    pub offload: SeedFigures,
}

impl ServeRun {
    fn req_s(&self) -> f64 {
        ratio(self.successful as f64, self.duration_s)
    }
    /// Prompt tokens per second of benchmark time.
    pub fn input_tok_s(&self) -> f64 {
        ratio(self.total_input_tokens as f64, self.duration_s)
    }
    /// Generated tokens per second of benchmark time.
    pub fn output_tok_s(&self) -> f64 {
        ratio(self.total_output_tokens as f64, self.duration_s)
    }

    /// The "Serving Benchmark Result" block, in the seed's field order, then the offload lines.
    pub fn block(&self) -> Vec<String> {
        let mut o = vec!["============ Serving Benchmark Result ============".to_owned()];
        let rate = if self.request_rate.is_infinite() {
            "inf".to_owned()
        } else {
            format!("{:.2}", self.request_rate)
        };
        let conc = self
            .max_concurrency
            .map_or("not set".to_owned(), |c| c.to_string());
        let concurrency = ratio(self.e2e_ms.mean * self.successful as f64 / 1e3, self.duration_s);
        for (k, v) in [
            ("Backend", "kvtier-engine".to_owned()),
            ("Traffic request rate", rate),
            ("Max request concurrency", conc),
            ("Successful requests", self.successful.to_string()),
            ("Benchmark duration (s)", format!("{:.2}", self.duration_s)),
            ("Total input tokens", self.total_input_tokens.to_string()),
            ("Total input text tokens", self.total_input_tokens.to_string()),
            ("Total input vision tokens", "0".into()),
            ("Total generated tokens", self.total_output_tokens.to_string()),
            (
                "Total generated tokens (retokenized)",
                self.total_output_tokens.to_string(),
            ),
            ("Request throughput (req/s)", format!("{:.2}", self.req_s())),
            (
                "Input token throughput (tok/s)",
                format!("{:.2}", self.input_tok_s()),
            ),
            (
                "Output token throughput (tok/s)",
                format!("{:.2}", self.output_tok_s()),
            ),
            (
                "Total token throughput (tok/s)",
                format!("{:.2}", self.input_tok_s() + self.output_tok_s()),
            ),
            ("Concurrency", format!("{concurrency:.2}")),
        ] {
            o.push(format!("{k}: {v}"));
        }
        o.push("----------------End-to-End Latency----------------".into());
        o.push(format!("Mean E2E Latency (ms): {:.2}", self.e2e_ms.mean));
        o.push(format!("Median E2E Latency (ms): {:.2}", self.e2e_ms.p50));
        o.push("---------------Time to First Token----------------".into());
        o.push(format!("Mean TTFT (ms): {:.2}", self.ttft_ms.mean));
        o.push(format!("Median TTFT (ms): {:.2}", self.ttft_ms.p50));
        o.push(format!("P99 TTFT (ms): {:.2}", self.ttft_ms.p99));
        o.push("-----Time per Output Token (excl. 1st token)------".into());
        o.push(format!("Mean TPOT (ms): {:.2}", self.tpot_ms.mean));
        o.push(format!("Median TPOT (ms): {:.2}", self.tpot_ms.p50));
        o.push(format!("P99 TPOT (ms): {:.2}", self.tpot_ms.p99));
        o.push("---------------Inter-Token Latency----------------".into());
        o.push(format!("Mean ITL (ms): {:.2}", self.itl_ms.mean));
        o.push(format!("Median ITL (ms): {:.2}", self.itl_ms.p50));
        o.push(format!("P95 ITL (ms): {:.2}", self.itl_p95_ms));
        o.push(format!("P99 ITL (ms): {:.2}", self.itl_ms.p99));
        o.push(format!("Max ITL (ms): {:.2}", self.itl_max_ms));
        o.push("==================================================".into());
        o.extend(self.offload.lines());
        o
    }
}

/// Everything measured.
#[derive(Debug, Clone, Serialize)]
pub struct ServeReport {
    /// Model name.
    pub model: String,
    /// Its parameters (0 when unknown, with --base-url).
    pub parameters: u64,
    /// Device pool capacity, tokens (0 when unknown).
    pub device_tokens: usize,
    /// Prompt tokens per request.
    pub input_len: usize,
    /// Tokens generated per request.
    pub output_len: usize,
    /// The runs, in order.
    pub runs: Vec<ServeRun>,
}

impl ServeReport {
    /// Per run: a title line and its block; then the side-by-side table and the seed-000 rows.
    pub fn lines(&self) -> Vec<String> {
        let mut o = Vec::new();
        for r in &self.runs {
            o.push(format!(
                "# scenario={} batch={} input_len={} output_len={} prefix={} cached_tokens/request={:.0}",
                r.scenario.name(),
                r.batch,
                self.input_len,
                self.output_len,
                r.prefix_tokens,
                ratio(r.cached_tokens as f64, r.num_prompts as f64)
            ));
            o.extend(r.block());
            o.push(String::new());
        }
        o.extend(self.table());
        o.push(String::new());
        o.extend(self.seed_rows());
        o
    }

    /// The scenarios side by side.
    pub fn table(&self) -> Vec<String> {
        let mut o = vec![format!(
            "{:<10} {:>5} {:>14} {:>13} {:>13} {:>15} {:>14}",
            "scenario",
            "batch",
            "mean_ttft_ms",
            "input_tok_s",
            "output_tok_s",
            "cached/request",
            "ttft_speedup"
        )];
        for r in &self.runs {
            let base = self
                .runs
                .iter()
                .find(|b| b.batch == r.batch && b.scenario == Scenario::Recompute)
                .map(|b| b.ttft_ms.mean);
            let speedup = base.map_or("-".to_owned(), |b| format!("{:.2}x", ratio(b, r.ttft_ms.mean)));
            o.push(format!(
                "{:<10} {:>5} {:>14.1} {:>13.1} {:>13.2} {:>15.0} {:>14}",
                r.scenario.name(),
                r.batch,
                r.ttft_ms.mean,
                r.input_tok_s(),
                r.output_tok_s(),
                ratio(r.cached_tokens as f64, r.num_prompts as f64),
                speedup
            ));
        }
        o
    }

    /// A row per run in the seed-000 table form (tab-separated), plus the scenario.
    pub fn seed_rows(&self) -> Vec<String> {
        let mut o = vec![
            "Model\tSize\tPrefillLen(tokens)\tCtx(K)\tBatch\tNChip\tInput(tokens)\tOutput(tokens)\tPrefill(tps)\tTTFT(ms)\tDecode(tps)\tTPOT(ms)\tProfile\tPrefix(tokens)\tMeasuredOutput(tokens)\tScenario"
                .to_owned(),
        ];
        let size = if self.parameters > 0 {
            format!("{:.2}b", self.parameters as f64 / 1e9)
        } else {
            "-".into()
        };
        for r in &self.runs {
            let prefix = ratio(r.cached_tokens as f64, r.num_prompts as f64).round() as usize;
            let prefill_len = self.input_len.saturating_sub(prefix);
            o.push(format!(
                "{}\t{}\t{}\t{}\t{}\t1\t{}\t{}\t{:.3}\t{:.3}\t{:.3}\t{:.3}\t{}:{}\t{}\t{}\t{}",
                self.model,
                size,
                prefill_len,
                self.device_tokens / 1024,
                r.batch,
                self.input_len,
                self.output_len,
                ratio(prefill_len as f64 * 1e3, r.ttft_ms.mean),
                r.ttft_ms.mean,
                ratio(1e3, r.tpot_ms.mean),
                r.tpot_ms.mean,
                prefill_len,
                self.input_len,
                prefix,
                ratio(r.total_output_tokens as f64, r.successful as f64).round(),
                r.scenario.name()
            ));
        }
        o
    }

    /// TTFT and throughput per scenario and batch size, as an SVG document.
    pub fn svg(&self) -> String {
        type Figure = fn(&ServeRun) -> f64;
        let panels: [(&str, Figure); 2] = [
            ("mean TTFT (ms)", |r| r.ttft_ms.mean),
            ("total throughput (tok/s)", |r| r.input_tok_s() + r.output_tok_s()),
        ];
        let (w, h, pad) = (760.0, 300.0, 50.0);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n",
            2.0 * h
        );
        let colors = ["#d62728", "#1f77b4", "#ff7f0e", "#2ca02c"];
        let mut batches: Vec<usize> = self.runs.iter().map(|r| r.batch).collect();
        batches.dedup();
        let mut scenarios: Vec<Scenario> = Vec::new();
        for r in &self.runs {
            if !scenarios.contains(&r.scenario) {
                scenarios.push(r.scenario);
            }
        }
        for (p, (title, value)) in panels.iter().enumerate() {
            let y0 = p as f64 * h;
            let max = self.runs.iter().map(value).fold(0.0, f64::max).max(1e-9);
            let _ = writeln!(
                s,
                "<text x=\"{pad}\" y=\"{}\" font-size=\"13\">{title} — {} {}:{} tokens</text>",
                y0 + 20.0,
                self.model,
                self.input_len,
                self.output_len
            );
            let plot_w = w - 2.0 * pad;
            let plot_h = h - 90.0;
            let group_w = plot_w / batches.len().max(1) as f64;
            let bar_w = group_w / (scenarios.len() as f64 + 1.0);
            let base_y = y0 + 40.0 + plot_h;
            let _ = writeln!(
                s,
                "<line x1=\"{pad}\" y1=\"{base_y}\" x2=\"{}\" y2=\"{base_y}\" stroke=\"black\"/>",
                w - pad
            );
            for (bi, b) in batches.iter().enumerate() {
                let gx = pad + bi as f64 * group_w;
                let _ = writeln!(
                    s,
                    "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">batch {b}</text>",
                    gx + group_w / 2.0,
                    base_y + 15.0
                );
                for (si, sc) in scenarios.iter().enumerate() {
                    let Some(r) = self.runs.iter().find(|r| r.batch == *b && r.scenario == *sc) else {
                        continue;
                    };
                    let v = value(r);
                    let bh = v / max * plot_h;
                    let x = gx + bar_w * (si as f64 + 0.5);
                    let _ = writeln!(
                        s,
                        "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{v:.0}</text>",
                        base_y - bh,
                        bar_w * 0.9,
                        colors[si % colors.len()],
                        x + bar_w * 0.45,
                        base_y - bh - 3.0
                    );
                }
            }
            for (si, sc) in scenarios.iter().enumerate() {
                let x = pad + si as f64 * 110.0;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>",
                    base_y + 25.0,
                    colors[si % colors.len()],
                    x + 14.0,
                    base_y + 34.0,
                    sc.name()
                );
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 && b.is_finite() { a / b } else { 0.0 }
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::InvalidConfig(e.to_string())
}

/// Nearest-rank percentile (q in 0..=100) of `v`.
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// The engine the benchmark talks to: its address, and what it started (stopped on drop).
struct Target {
    host: String,
    prefix: String,
    model: String,
    parameters: u64,
    device_tokens: usize,
    block_tokens: usize,
    _embedded: Option<Embedded>,
}

/// An engine (and sidecar) this process started.
struct Embedded {
    _server: tokio::task::JoinHandle<()>,
    _sidecar: Running,
    _disk: tempfile::TempDir,
}

fn start_embedded(config: &ServeConfig, rt: &tokio::runtime::Runtime) -> Result<Target, BenchError> {
    let (model, weights, _) =
        kvtier_engine::load_model(&config.model, config.layers, config.seed).map_err(err)?;
    let bt = config.block_tokens as usize;
    let max_batch = config.batches.iter().copied().max().unwrap_or(1);
    let per_request = (config.input_len + config.output_len).div_ceil(bt);
    // Every request of the largest batch, its own copy of the prefix (kvtier-only loads),
    // the warm-ups, and the cached prefixes of earlier runs.
    let slots = (per_request * (2 * max_batch + 2 + 2 * config.scenarios.len())) as u32;
    let engine_config = kvtier_engine::EngineConfig {
        seed: config.seed,
        block_tokens: config.block_tokens,
        device_slots: slots,
        kv_reuse: kvtier_engine::KvReuse::Tiered,
        max_batch_tokens: config.max_batch_tokens,
        max_running: max_batch.max(1),
        reconnect_ms: 100,
        ..kvtier_engine::EngineConfig::default()
    };
    let geometry = kvtier_engine::engine::kv_geometry(&model, &engine_config).map_err(err)?;
    let disk = tempfile::Builder::new()
        .prefix("kvtier-bench-disk")
        .tempdir()
        .map_err(err)?;
    let mut overrides = base_overrides(&geometry, config.host_capacity);
    overrides.extend([
        format!("disk.dir=\"{}\"", disk.path().display()),
        format!("disk.capacity=\"{}\"", config.disk_capacity),
        "disk.region_size=\"64MiB\"".into(),
        // Every stored block goes to disk too, so the disk scenario has its prefix there.
        "write_policy=\"all\"".into(),
    ]);
    let (url, sidecar) = start(&SidecarTarget::InProcess, &overrides)?;
    let name = model.name.clone();
    let parameters = model.parameters();
    let engine = kvtier_engine::Engine::start(
        model,
        weights,
        kvtier_engine::EngineConfig {
            sidecar: Some(url),
            ..engine_config
        },
    )
    .map_err(err)?;
    let state = Arc::new(kvtier_engine::http::AppState {
        engine,
        codec: kvtier_engine::TextCodec::Bytes,
        metrics: None,
    });
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(err)?;
    let addr = listener.local_addr().map_err(err)?;
    let server = rt.spawn(async move {
        let _ = axum::serve(listener, kvtier_engine::http::router(state)).await;
    });
    Ok(Target {
        host: addr.to_string(),
        prefix: String::new(),
        model: name,
        parameters,
        device_tokens: slots as usize * bt,
        block_tokens: bt,
        _embedded: Some(Embedded {
            _server: server,
            _sidecar: sidecar,
            _disk: disk,
        }),
    })
}

impl Target {
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, BenchError> {
        call_json(
            &self.host,
            method,
            &format!("{}{path}", self.prefix),
            body.map(|b| b.to_string()),
        )
        .await
    }

    async fn set_reuse(&self, policy: &str) -> Result<(), BenchError> {
        self.call("POST", "/kvtier/reuse", Some(json!({"kv_reuse": policy})))
            .await
            .map(|_| ())
    }

    async fn disk_entries(&self) -> Result<u64, BenchError> {
        let v = self.call("GET", "/kvtier/stats", None).await?;
        Ok(v["tiers"]["disk"]["entries"].as_u64().unwrap_or(0))
    }
}

/// Runs the benchmark; `progress(done, total)` after each request.
///
/// # Errors
/// Bad parameters; engine, sidecar or HTTP failures; a scenario whose precondition cannot be
/// met (e.g. the sidecar never writes the prefix to disk).
pub fn run_serve(
    config: &ServeConfig,
    progress: &mut (dyn FnMut(usize, usize) + Send),
) -> Result<ServeReport, BenchError> {
    if !(0.0..1.0).contains(&config.hit_rate) {
        return Err(err(format!("--hit-rate {} must be in [0, 1)", config.hit_rate)));
    }
    if config.input_len < 2 || config.output_len == 0 {
        return Err(err(format!(
            "--input-len {} must be at least 2 and --output-len {} at least 1",
            config.input_len, config.output_len
        )));
    }
    if config.batches.is_empty() || config.batches.contains(&0) || config.scenarios.is_empty() {
        return Err(err("give at least one --batch (each ≥ 1) and one scenario"));
    }
    if config.num_prompts == Some(0) || config.max_concurrency == Some(0) {
        return Err(err("--num-prompts and --max-concurrency must be at least 1"));
    }
    if config.request_rate.is_nan() || config.request_rate <= 0.0 {
        return Err(err(format!(
            "--request-rate {} must be positive (inf: all at once)",
            config.request_rate
        )));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-bench-serve")
        .enable_all()
        .build()
        .map_err(err)?;
    let target = match &config.base_url {
        Some(url) => {
            let (host, prefix) = split_base(url)?;
            let mut t = Target {
                host,
                prefix,
                model: String::new(),
                parameters: 0,
                device_tokens: 0,
                block_tokens: 64,
                _embedded: None,
            };
            let health = rt.block_on(t.call("GET", "/health", None))?;
            let n = |k: &str| health[k].as_u64().unwrap_or(0) as usize;
            t.model = health["model"].as_str().unwrap_or("unknown").to_owned();
            t.parameters = n("parameters") as u64;
            t.block_tokens = n("block_tokens").max(1);
            t.device_tokens = n("device_slots") * t.block_tokens;
            t
        }
        None => start_embedded(config, &rt)?,
    };
    let per_run_warm = |s: Scenario| match s {
        Scenario::Recompute => 0,
        Scenario::Hbm | Scenario::Host => 1,
        Scenario::Disk => 3,
    };
    let total: usize = config
        .batches
        .iter()
        .map(|b| {
            config
                .scenarios
                .iter()
                .map(|s| config.num_prompts.unwrap_or(*b) + per_run_warm(*s))
                .sum::<usize>()
        })
        .sum();
    let done = Arc::new(Mutex::new(0usize));
    let progress = Mutex::new(progress);
    let tick = || {
        let mut d = done.lock().unwrap_or_else(|e| e.into_inner());
        *d += 1;
        (progress.lock().unwrap_or_else(|e| e.into_inner()))(*d, total);
    };
    let mut runs = Vec::new();
    for (bi, &batch) in config.batches.iter().enumerate() {
        for (si, &scenario) in config.scenarios.iter().enumerate() {
            let tag = (bi * 16 + si) as u32 + 1;
            runs.push(rt.block_on(run_one(config, &target, scenario, batch, tag, &tick))?);
        }
    }
    // Leave the engine as it was found (a shared engine keeps serving).
    let _ = rt.block_on(target.set_reuse("tiered"));
    Ok(ServeReport {
        model: target.model.clone(),
        parameters: target.parameters,
        device_tokens: target.device_tokens,
        input_len: config.input_len,
        output_len: config.output_len,
        runs,
    })
}

/// Distinct token streams (tag, position), below `vocab`.
fn tokens(seed: u64, tag: u32, n: usize, vocab: u32) -> Vec<u32> {
    let mut x = seed ^ (u64::from(tag) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(vocab)) as u32
        })
        .collect()
}

/// The vocabulary bound of the dataset: every preset's vocabulary is at least 512; token ids
/// stay below it (the engine rejects out-of-vocabulary ids).
const DATASET_VOCAB: u32 = 500;

async fn run_one(
    config: &ServeConfig,
    target: &Target,
    scenario: Scenario,
    batch: usize,
    tag: u32,
    tick: &(dyn Fn() + Sync),
) -> Result<ServeRun, BenchError> {
    let bt = target.block_tokens;
    let prefix_tokens = ((config.input_len as f64 * config.hit_rate) as usize / bt * bt)
        .min((config.input_len - 1) / bt * bt);
    let prefix = tokens(config.seed, tag * 1000, prefix_tokens, DATASET_VOCAB);
    let prompt = |i: u32| {
        let mut p = prefix.clone();
        p.extend(tokens(
            config.seed,
            tag * 1000 + 1 + i,
            config.input_len - prefix_tokens,
            DATASET_VOCAB,
        ));
        p
    };
    let warm = |i: u32| async move {
        let body = json!({"prompt": prompt(900 + i), "max_tokens": 1, "temperature": 0, "ignore_eos": true});
        let r = target.call("POST", "/v1/completions", Some(body)).await;
        tick();
        r
    };
    match scenario {
        Scenario::Recompute => target.set_reuse("none").await?,
        Scenario::Hbm => {
            target.set_reuse("tiered").await?;
            warm(0).await?;
        }
        Scenario::Host => {
            target.set_reuse("tiered").await?;
            warm(0).await?;
            target.call("POST", "/flush_cache", None).await?;
            target.set_reuse("kvtier").await?;
        }
        Scenario::Disk => {
            target.set_reuse("tiered").await?;
            let before = target.disk_entries().await?;
            warm(0).await?;
            target.call("POST", "/flush_cache", None).await?;
            // Two host hits pass a hit-count admission filter (write_through), so the prefix
            // reaches the disk whatever the sidecar's write policy.
            target.set_reuse("kvtier").await?;
            warm(1).await?;
            warm(2).await?;
            target.call("POST", "/flush_cache", None).await?;
            let want = before + (prefix_tokens / bt) as u64;
            let start = Instant::now();
            while target.disk_entries().await? < want {
                if start.elapsed() > Duration::from_secs(120) {
                    return Err(err(format!(
                        "the sidecar's disk tier holds {} blocks, {want} expected: the disk scenario needs a disk tier and a write policy that persists the prefix",
                        target.disk_entries().await?
                    )));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            target
                .call("POST", "/kvtier/clear", Some(json!({"tier": "host"})))
                .await?;
        }
    }
    let num = config.num_prompts.unwrap_or(batch);
    let concurrency = config.max_concurrency.unwrap_or(batch);
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut rng = config.seed ^ u64::from(tag);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(num);
    let mut next_at = Duration::ZERO;
    for i in 0..num {
        if config.request_rate.is_finite() {
            // Poisson arrivals.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let u = ((rng >> 11) as f64 / (1u64 << 53) as f64).max(1e-12);
            next_at += Duration::from_secs_f64(-u.ln() / config.request_rate);
            tokio::time::sleep_until((started + next_at).into()).await;
        }
        let permit = Arc::clone(&sem).acquire_owned().await.map_err(err)?;
        let body = json!({
            "prompt": prompt(i as u32),
            "max_tokens": config.output_len,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
        })
        .to_string();
        let host = target.host.clone();
        let path = format!("{}/v1/completions", target.prefix);
        tasks.push(tokio::spawn(async move {
            let rec = one_request(&host, &path, body).await;
            drop(permit);
            rec
        }));
    }
    let mut records = Vec::with_capacity(num);
    for t in tasks {
        let rec = t.await.map_err(err)?;
        tick();
        records.push(rec);
    }
    if let Some(bad) = records.iter().find(|r| !r.ok) {
        eprintln!(
            "kvtier bench serve: {} of {num} requests failed; first: {}",
            records.iter().filter(|r| !r.ok).count(),
            bad.error
        );
    }
    Ok(summarize(scenario, batch, num, config, prefix_tokens, &records))
}

async fn one_request(host: &str, path: &str, body: String) -> RequestRecord {
    let mut rec = RequestRecord {
        sent: Some(Instant::now()),
        ..RequestRecord::default()
    };
    let mut finished = false;
    let status = post_events(host, path, body, &mut |data, at| {
        if data == "[DONE]" {
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            rec.error = data.to_owned();
            return;
        };
        if let Some(e) = v.get("error") {
            rec.error = e.to_string();
            return;
        }
        let choice = &v["choices"][0];
        if choice["finish_reason"].is_null() {
            rec.tokens.push(at);
            return;
        }
        finished = true;
        rec.end = Some(at);
        let u = &v["usage"];
        let n = |x: &Value| x.as_u64().unwrap_or(0) as usize;
        rec.prompt_tokens = n(&u["prompt_tokens"]);
        rec.completion_tokens = n(&u["completion_tokens"]);
        rec.cached_tokens = n(&u["prompt_tokens_details"]["cached_tokens"]);
        let c = &u["kvtier"]["cached_tokens"];
        rec.cached_by_tier = [n(&c["device"]), n(&c["host"]), n(&c["disk"])];
        let span = |s: &Value| {
            (!s.is_null()).then(|| {
                let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
                (
                    f("start_ms"),
                    f("end_ms"),
                    s["bytes"].as_u64().unwrap_or(0),
                    f("active_ms"),
                )
            })
        };
        rec.load = span(&u["kvtier"]["transfers"]["load"]);
        rec.store = span(&u["kvtier"]["transfers"]["store"]);
    })
    .await;
    match status {
        Ok(200) if finished && rec.error.is_empty() => rec.ok = true,
        Ok(s) if rec.error.is_empty() => rec.error = format!("HTTP {s} without a final event"),
        Ok(_) => {}
        Err(e) => rec.error = e.to_string(),
    }
    rec
}

fn summarize(
    scenario: Scenario,
    batch: usize,
    num: usize,
    config: &ServeConfig,
    prefix_tokens: usize,
    records: &[RequestRecord],
) -> ServeRun {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let first_sent = records.iter().filter_map(|r| r.sent).min();
    let last_end = ok.iter().filter_map(|r| r.end).max();
    let duration_s = match (first_sent, last_end) {
        (Some(a), Some(b)) => (b - a).as_secs_f64(),
        _ => 0.0,
    };
    let (mut ttft, mut tpot, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in &ok {
        let (Some(sent), Some(end)) = (r.sent, r.end) else {
            continue;
        };
        e2e.push(ms(end - sent));
        if let Some(first) = r.tokens.first() {
            ttft.push(ms(*first - sent));
            if r.tokens.len() > 1 {
                let last = r.tokens[r.tokens.len() - 1];
                tpot.push(ms(last - *first) / (r.tokens.len() - 1) as f64);
            }
            itl.extend(r.tokens.windows(2).map(|w| ms(w[1] - w[0])));
        }
    }
    // The seed's offload lines from this run's transfers (ms after each request's arrival,
    // placed on the benchmark's clock by its send time).
    let (mut ls, mut ss, mut es, mut la, mut sa, mut lb, mut sb, mut db) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let (mut batch_start, mut batch_end, mut batch_bytes) = (f64::INFINITY, 0f64, 0u64);
    let t0 = first_sent.unwrap_or_else(Instant::now);
    for r in &ok {
        let base = r.sent.map_or(0.0, |s| ms(s - t0));
        let mut lo = f64::INFINITY;
        let mut hi = 0f64;
        let mut bytes = 0u64;
        for (kind, t) in [(0, r.load), (1, r.store)] {
            let Some((start, end, b, active)) = t else {
                continue;
            };
            let span = (end - start).max(1e-6);
            let gib_s = b as f64 / (1u64 << 30) as f64 / (span / 1e3);
            if kind == 0 {
                ls.push(span);
                la.push(active);
                lb.push(gib_s);
            } else {
                ss.push(span);
                sa.push(active);
                sb.push(gib_s);
            }
            lo = lo.min(start);
            hi = hi.max(end);
            bytes += b;
            batch_start = batch_start.min(base + start);
            batch_end = batch_end.max(base + end);
        }
        if bytes > 0 {
            let span = (hi - lo).max(1e-6);
            es.push(span);
            db.push(bytes as f64 / (1u64 << 30) as f64 / (span / 1e3));
            batch_bytes += bytes;
        }
    }
    let makespan = if batch_bytes > 0 {
        (batch_end - batch_start).max(1e-6)
    } else {
        0.0
    };
    let batch_bw = if makespan > 0.0 {
        vec![batch_bytes as f64 / (1u64 << 30) as f64 / (makespan / 1e3)]
    } else {
        Vec::new()
    };
    let offload = SeedFigures {
        load_span_ms: Summary::of(&ls),
        store_span_ms: Summary::of(&ss),
        e2e_ms: Summary::of(&es),
        load_active_sum_ms: Summary::of(&la),
        store_active_sum_ms: Summary::of(&sa),
        load_bw_gib_s: Summary::of(&lb),
        store_bw_gib_s: Summary::of(&sb),
        duplex_bw_gib_s: Summary::of(&db),
        batch_makespan_ms: Summary::of(&if makespan > 0.0 {
            vec![makespan]
        } else {
            Vec::new()
        }),
        batch_duplex_bw_gib_s: Summary::of(&batch_bw),
    };
    let sum = |f: &dyn Fn(&RequestRecord) -> usize| ok.iter().map(|r| f(r)).sum::<usize>();
    ServeRun {
        scenario,
        batch,
        num_prompts: num,
        max_concurrency: Some(config.max_concurrency.unwrap_or(batch)),
        request_rate: config.request_rate,
        successful: ok.len(),
        failed: records.len() - ok.len(),
        duration_s,
        total_input_tokens: sum(&|r| r.prompt_tokens),
        total_output_tokens: sum(&|r| r.completion_tokens),
        cached_tokens: sum(&|r| r.cached_tokens),
        cached_device: sum(&|r| r.cached_by_tier[0]),
        cached_host: sum(&|r| r.cached_by_tier[1]),
        cached_disk: sum(&|r| r.cached_by_tier[2]),
        prefix_tokens,
        e2e_ms: Summary::of(&e2e),
        ttft_ms: Summary::of(&ttft),
        tpot_ms: Summary::of(&tpot),
        itl_p95_ms: percentile(&itl, 95.0),
        itl_max_ms: itl.iter().copied().fold(0.0, f64::max),
        itl_ms: Summary::of(&itl),
        offload,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_serve_run_measures_every_scenario_from_its_tier() {
        let config = ServeConfig {
            model: "tiny-moe".into(),
            layers: None,
            input_len: 100,
            output_len: 4,
            batches: vec![1, 2],
            block_tokens: 16,
            host_capacity: ByteSize::mib(16),
            disk_capacity: ByteSize::mib(64),
            ..ServeConfig::default()
        };
        let mut calls = 0;
        let r = run_serve(&config, &mut |done, total| {
            calls += 1;
            assert!(done <= total);
        })
        .unwrap();
        assert_eq!(r.runs.len(), 8);
        assert!(calls > 0);
        for run in &r.runs {
            assert_eq!((run.successful, run.failed), (run.batch, 0), "{:?}", run.scenario);
            assert_eq!(run.total_output_tokens, 4 * run.batch);
            assert_eq!(run.prefix_tokens, 80);
            let per = run.cached_tokens / run.batch;
            let by_tier = [run.cached_device, run.cached_host, run.cached_disk];
            match run.scenario {
                Scenario::Recompute => assert_eq!(per, 0),
                Scenario::Hbm => assert_eq!((per, by_tier[0]), (80, run.cached_tokens)),
                Scenario::Host => assert_eq!((per, by_tier[1]), (80, run.cached_tokens)),
                // The first reader of a block reads it from disk; a concurrent one may find it
                // already promoted to host memory.
                Scenario::Disk => assert!(per == 80 && by_tier[2] >= 80, "{by_tier:?}"),
            }
            if matches!(run.scenario, Scenario::Host | Scenario::Disk) {
                assert!(
                    run.offload.load_span_ms.n > 0,
                    "{:?} loaded through kvtier",
                    run.scenario
                );
            }
        }
        let lines = r.lines();
        assert!(
            lines
                .iter()
                .any(|l| l == "============ Serving Benchmark Result ============")
        );
        assert!(lines.iter().any(|l| l.starts_with("Mean TTFT (ms): ")));
        assert!(lines.iter().any(|l| l.starts_with("load_span_ms mean=")));
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("Model\tSize\tPrefillLen(tokens)"))
        );
        assert!(r.svg().starts_with("<svg") && r.svg().contains("recompute"));
    }

    #[test]
    fn bad_parameters_are_named() {
        for (c, needle) in [
            (
                ServeConfig {
                    hit_rate: 1.0,
                    ..ServeConfig::default()
                },
                "--hit-rate",
            ),
            (
                ServeConfig {
                    output_len: 0,
                    ..ServeConfig::default()
                },
                "--output-len",
            ),
            (
                ServeConfig {
                    batches: vec![0],
                    ..ServeConfig::default()
                },
                "--batch",
            ),
            (
                ServeConfig {
                    request_rate: 0.0,
                    ..ServeConfig::default()
                },
                "--request-rate",
            ),
            (
                ServeConfig {
                    base_url: Some("ftp://x".into()),
                    ..ServeConfig::default()
                },
                "http://",
            ),
        ] {
            let e = run_serve(&c, &mut |_, _| {}).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert!("gpu".parse::<Scenario>().unwrap_err().to_string().contains("hbm"));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 95.0), 4.0);
    }
}
