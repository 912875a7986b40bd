//! `kvtier bench serve`: a load generator against the engine's HTTP API, modeled on SGLang's
//! `bench_serving`, comparing where a shared prompt prefix comes from: recomputed, loaded from
//! kvtier's host tier, from its disk tier, already resident in the engine's device memory, or
//! (with a Redis Cluster, `remote_nodes`) computed by another node and fetched from the remote
//! tier they share.
//!
//! Each run (scenario × batch size) warms the prefix as the scenario needs, then sends
//! `num_prompts` requests of `input_len` tokens — the prefix (`hit_rate` of the prompt, whole
//! blocks) plus a unique suffix — with at most `max_concurrency` in flight, streamed, and
//! measures TTFT, TPOT, ITL and throughput as `bench_serving` does.

use std::sync::{Arc, Mutex};

use kvtier_core::{ByteSize, KvGeometry};
use serde::Serialize;

use crate::BenchError;
use crate::http_client::split_base;

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
    /// Another node (engine + sidecar) computed the prefix; this node finds it only in the
    /// remote tier both share.
    Remote,
}

impl Scenario {
    /// The name used on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Host => "host",
            Self::Disk => "disk",
            Self::Hbm => "hbm",
            Self::Remote => "remote",
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
            "remote" => Ok(Self::Remote),
            other => Err(BenchError::InvalidConfig(format!(
                "--scenarios: unknown scenario {other:?} (recompute, host, disk, hbm, remote)"
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
    /// A Redis Cluster's nodes: the benchmark then starts two nodes (engine + sidecar each)
    /// sharing it as their remote tier, and the `remote` scenario measures node B serving a
    /// prefix node A computed. Empty: one node, no remote tier.
    pub remote_nodes: Vec<String>,
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
            block_tokens: KvGeometry::DEFAULT_BLOCK_TOKENS,
            max_batch_tokens: 512,
            host_capacity: ByteSize::gib(2),
            disk_capacity: ByteSize::gib(4),
            remote_nodes: Vec::new(),
        }
    }
}

mod plot;
mod report;
mod scenario_run;
mod target;

pub use report::{ServeReport, ServeRun};
use scenario_run::run_one;
use target::{Target, start_embedded};

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 && b.is_finite() { a / b } else { 0.0 }
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::InvalidConfig(e.to_string())
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
    if config.scenarios.contains(&Scenario::Remote)
        && (config.remote_nodes.is_empty() || config.base_url.is_some())
    {
        return Err(err(
            "the remote scenario needs --remote-nodes (a Redis Cluster; scripts/redis_cluster.sh starts one) and the embedded engines (no --base-url)",
        ));
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
                block_tokens: KvGeometry::DEFAULT_BLOCK_TOKENS as usize,
                _embedded: None,
                peer: None,
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
        Scenario::Hbm | Scenario::Host | Scenario::Remote => 1,
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

#[cfg(test)]
mod tests {
    use super::report::percentile;
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
                Scenario::Remote => unreachable!("not run without a cluster"),
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
        let svg = r.svg();
        assert!(svg.starts_with("<svg"), "{svg}");
        // A legend names every scenario, and both axes say what they measure and in what unit.
        for needle in [
            "recompute",
            "host",
            "disk",
            "hbm",
            "mean TTFT (ms)",
            "total throughput (tok/s)",
            "batch size (concurrent requests)",
        ] {
            assert!(svg.contains(needle), "{needle} missing from the figure");
        }
        if let Some(path) = std::env::var_os("KVTIER_PLOT_EXAMPLE") {
            std::fs::write(path, &svg).unwrap();
        }
    }

    #[test]
    fn a_prefix_computed_on_one_node_is_served_from_the_remote_tier_on_the_other() {
        let cluster = kvtier_store::test_cluster::TestCluster::start(&[]);
        let config = ServeConfig {
            model: "tiny-moe".into(),
            layers: None,
            input_len: 100,
            output_len: 4,
            batches: vec![2],
            scenarios: vec![Scenario::Recompute, Scenario::Remote],
            block_tokens: 16,
            host_capacity: ByteSize::mib(16),
            disk_capacity: ByteSize::mib(64),
            remote_nodes: cluster.nodes().to_vec(),
            ..ServeConfig::default()
        };
        let r = run_serve(&config, &mut |_, _| {}).unwrap();
        let remote = r.runs.iter().find(|r| r.scenario == Scenario::Remote).unwrap();
        assert_eq!((remote.successful, remote.failed), (2, 0));
        // The first request fetches the prefix from the remote tier; the second may find it
        // already promoted into node B's host memory.
        assert!(remote.cached_remote >= 80, "{remote:?}");
        assert_eq!(remote.cached_tokens, 2 * 80);
        assert!(r.table().iter().any(|l| l.starts_with("remote ")));
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
            (
                ServeConfig {
                    scenarios: vec![Scenario::Remote],
                    ..ServeConfig::default()
                },
                "--remote-nodes",
            ),
        ] {
            let e = run_serve(&c, &mut |_, _| {}).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert!("gpu".parse::<Scenario>().unwrap_err().to_string().contains("hbm"));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 95.0), 4.0);
    }
}
