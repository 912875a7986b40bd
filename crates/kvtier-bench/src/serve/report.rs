//! What a serving run measured: per request records, per run (scenario × batch) figures in
//! `bench_serving`'s form, and the report's lines, table and seed-000 rows.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::summary::Summary;
use crate::workload::SeedFigures;

use super::{Scenario, ServeConfig, ratio};

/// One measured request.
#[derive(Debug, Clone, Default)]
pub(super) struct RequestRecord {
    pub(super) sent: Option<Instant>,
    pub(super) ok: bool,
    pub(super) error: String,
    pub(super) tokens: Vec<Instant>,
    pub(super) end: Option<Instant>,
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) cached_tokens: usize,
    pub(super) cached_by_tier: [usize; 4],
    /// (start, end, bytes, active) of the load and of the stores, ms after arrival.
    pub(super) load: Option<(f64, f64, u64, f64)>,
    pub(super) store: Option<(f64, f64, u64, f64)>,
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
    /// Of those, by tier (device, host, disk, remote).
    pub cached_device: usize,
    /// From kvtier's host tier.
    pub cached_host: usize,
    /// From kvtier's disk tier.
    pub cached_disk: usize,
    /// From kvtier's remote tier.
    pub cached_remote: usize,
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
}

/// Nearest-rank percentile (q in 0..=100) of `v`.
pub(super) fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

pub(super) fn summarize(
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
        cached_remote: sum(&|r| r.cached_by_tier[3]),
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
