//! `kvtier bench engine`: the reference engine's prefill and decode throughput, and the
//! time to first token of a long prompt whose prefix is cached, by where the prefix comes from
//! (recomputed, loaded from kvtier's host tier, or still in the engine's device pool).

use std::time::{Duration, Instant};

use kvtier_core::{BlockHasher, ByteSize, KvGeometry, Namespace};
use kvtier_engine::{Engine, EngineConfig, EngineStats, GenRequest, KvReuse, Sampling, Usage, load_model};
use serde::Serialize;

use crate::BenchError;
use crate::sidecar::{SidecarTarget, base_overrides, start};
use crate::summary::Summary;

/// What to run.
#[derive(Debug, Clone)]
pub struct EngineBenchConfig {
    /// Preset or Hugging Face model directory.
    pub model: String,
    /// Keep only this many layers.
    pub layers: Option<usize>,
    /// Random weights seed.
    pub seed: u64,
    /// Prompt length of the TTFT scenarios (and of the prefill measurement).
    pub prompt_tokens: usize,
    /// Fraction of the prompt that is a cached prefix in the hit scenarios.
    pub hit_rate: f64,
    /// Measured requests per scenario.
    pub rounds: usize,
    /// Tokens each decode sequence generates.
    pub decode_tokens: usize,
    /// Concurrent sequences of the decode measurements.
    pub decode_batches: Vec<usize>,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Chunked-prefill budget.
    pub max_batch_tokens: usize,
    /// The sidecar.
    pub sidecar: SidecarTarget,
    /// Its host tier.
    pub host_capacity: ByteSize,
}

impl Default for EngineBenchConfig {
    fn default() -> Self {
        Self {
            model: "qwen3-30b-a3b".into(),
            layers: Some(1),
            seed: 0,
            prompt_tokens: 4096,
            hit_rate: 0.9,
            rounds: 3,
            decode_tokens: 32,
            decode_batches: vec![1, 8],
            block_tokens: KvGeometry::DEFAULT_BLOCK_TOKENS,
            max_batch_tokens: 512,
            sidecar: SidecarTarget::InProcess,
            host_capacity: ByteSize::gib(2),
        }
    }
}

/// TTFT of one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct TtftFigures {
    /// recompute, host or device.
    pub scenario: &'static str,
    /// Arrival → first token, ms.
    pub ttft_ms: Summary,
    /// Prompt tokens served from a cache (mean).
    pub cached_tokens: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    /// Model name (with the layer cut).
    pub model: String,
    /// Its parameters.
    pub parameters: u64,
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// Cached prefix of the hit scenarios, tokens.
    pub hit_tokens: usize,
    /// Prompt tokens computed / seconds of the forward passes that computed them.
    pub prefill_tok_s: f64,
    /// (concurrent sequences, tokens/s of decode-only forward passes).
    pub decode_tok_s: Vec<(usize, f64)>,
    /// Per scenario.
    pub ttft: Vec<TtftFigures>,
}

impl EngineBenchReport {
    /// The output lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!("prefill_tok_s={:.1}", self.prefill_tok_s)];
        for (b, t) in &self.decode_tok_s {
            out.push(format!("decode_tok_s batch={b} {t:.2}"));
        }
        for t in &self.ttft {
            out.push(format!(
                "{} cached_tokens={:.0}",
                t.ttft_ms.line(&format!("ttft_ms scenario={}", t.scenario), 1),
                t.cached_tokens
            ));
        }
        let mean = |s: &str| {
            self.ttft
                .iter()
                .find(|t| t.scenario == s)
                .map_or(0.0, |t| t.ttft_ms.mean)
        };
        let base = mean("recompute");
        let speedups: Vec<String> = ["host", "device"]
            .iter()
            .map(|s| format!("{s}={:.2}", if mean(s) > 0.0 { base / mean(s) } else { 0.0 }))
            .collect();
        out.push(format!("ttft_speedup_vs_recompute {}", speedups.join(" ")));
        out
    }
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::InvalidConfig(e.to_string())
}

/// Runs the benchmark; `progress(done, total)` after each request.
///
/// # Errors
/// Bad parameters; model, sidecar or engine failures.
pub fn run_engine_bench(
    config: &EngineBenchConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EngineBenchReport, BenchError> {
    if !(0.0..1.0).contains(&config.hit_rate) || config.rounds == 0 || config.prompt_tokens < 2 {
        return Err(err(format!(
            "--hit-rate {} must be in [0, 1), --rounds {} and --prompt-tokens {} at least 1 and 2",
            config.hit_rate, config.rounds, config.prompt_tokens
        )));
    }
    if config.decode_tokens == 0 || config.decode_batches.contains(&0) {
        return Err(err("--decode-tokens and every --decode-batch must be at least 1"));
    }
    let (model, weights, _) = load_model(&config.model, config.layers, config.seed).map_err(err)?;
    let bt = config.block_tokens as usize;
    let max_decode = config.decode_batches.iter().copied().max().unwrap_or(1);
    // Room for the long prompts of a scenario and every decode sequence, with slack.
    let slots = (4 * config.prompt_tokens.div_ceil(bt)
        + max_decode * (64 + config.decode_tokens).div_ceil(bt)
        + 16) as u32;
    let engine_config = EngineConfig {
        seed: config.seed,
        block_tokens: config.block_tokens,
        device_slots: slots,
        kv_reuse: KvReuse::Tiered,
        max_batch_tokens: config.max_batch_tokens,
        max_running: max_decode.max(4),
        ..EngineConfig::default()
    };
    let geometry = kvtier_engine::engine::kv_geometry(&model, &engine_config).map_err(err)?;
    let overrides = base_overrides(&geometry, config.host_capacity);
    let (url, _sidecar) = start(&config.sidecar, &overrides)?;
    let engine = Engine::start(
        model.clone(),
        weights,
        EngineConfig {
            sidecar: Some(url.clone()),
            ..engine_config
        },
    )
    .map_err(err)?;
    let vocab = model.vocab as u32;
    let hit_tokens = ((config.prompt_tokens as f64 * config.hit_rate) as usize / bt * bt)
        .min((config.prompt_tokens - 1) / bt * bt);
    let total = config.rounds * 3 + 1 + config.decode_batches.iter().sum::<usize>();
    let mut done = 0;
    let mut step = |progress: &mut dyn FnMut(usize, usize)| {
        done += 1;
        progress(done, total);
    };
    // Distinct token streams: tag t, position i.
    let tokens = |tag: u32, n: usize| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ tag.wrapping_mul(40_503)).wrapping_add(tag) % vocab)
            .collect()
    };
    let run = |prompt: Vec<u32>, max_tokens: usize| -> Result<Usage, BenchError> {
        engine
            .generate(GenRequest {
                prompt,
                max_tokens,
                sampling: Sampling::default(),
                ignore_eos: true,
                cache_salt: String::new(),
                ..GenRequest::default()
            })
            .map(|(_, u)| u)
            .map_err(err)
    };
    let stats = || engine.stats().map_err(err);

    // Recompute: cold prompts (nothing cached anywhere); also the prefill throughput.
    let before = stats()?;
    let mut recompute = Vec::new();
    for r in 0..config.rounds {
        recompute.push(run(tokens(1000 + r as u32, config.prompt_tokens), 1)?);
        step(progress);
    }
    let after = stats()?;
    let prefill_tok_s = rate(
        after.prefill_tokens - before.prefill_tokens,
        after.prefill_seconds - before.prefill_seconds,
    );

    // The shared prefix, computed once; wait until kvtier holds all of it.
    let prefix = tokens(7, hit_tokens);
    let with_suffix = |r: u32| {
        let mut p = prefix.clone();
        p.extend(tokens(2000 + r, config.prompt_tokens - hit_tokens));
        p
    };
    run(with_suffix(0), 1)?;
    step(progress);
    let ns = Namespace::new(model.name.clone(), geometry, 0, 1, "")
        .map_err(err)?
        .fingerprint();
    let keys = BlockHasher::new(ns, config.block_tokens).keys(&prefix);
    wait_until_stored(&url, &model.name, &keys)?;

    let mut device = Vec::new();
    let mut host = Vec::new();
    for r in 0..config.rounds as u32 {
        device.push(run(with_suffix(1 + r), 1)?);
        step(progress);
        engine.clear_device_cache().map_err(err)?;
        host.push(run(with_suffix(100 + r), 1)?);
        step(progress);
    }

    let mut decode_tok_s = Vec::new();
    for (k, &b) in config.decode_batches.iter().enumerate() {
        engine.clear_device_cache().map_err(err)?;
        let before: EngineStats = stats()?;
        let rxs = (0..b)
            .map(|i| {
                engine
                    .submit(GenRequest {
                        prompt: tokens(5000 + (k * 1000 + i) as u32, 64),
                        max_tokens: config.decode_tokens,
                        sampling: Sampling::default(),
                        ignore_eos: true,
                        cache_salt: String::new(),
                        ..GenRequest::default()
                    })
                    .map_err(err)
            })
            .collect::<Result<Vec<_>, _>>()?;
        for mut rx in rxs {
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    kvtier_engine::SeqEvent::Finished { .. } => break,
                    kvtier_engine::SeqEvent::Failed(e) => return Err(err(e)),
                    kvtier_engine::SeqEvent::Token(_)
                    | kvtier_engine::SeqEvent::Prefilled(_)
                    | kvtier_engine::SeqEvent::Logprobs(_) => {}
                }
            }
            step(progress);
        }
        let after = stats()?;
        decode_tok_s.push((
            b,
            rate(
                after.decode_tokens - before.decode_tokens,
                after.decode_seconds - before.decode_seconds,
            ),
        ));
    }

    let figures = |scenario, us: &[Usage]| TtftFigures {
        scenario,
        ttft_ms: Summary::of(&us.iter().map(|u| u.ttft_ms).collect::<Vec<_>>()),
        cached_tokens: us.iter().map(|u| u.cached.total() as f64).sum::<f64>() / us.len() as f64,
    };
    Ok(EngineBenchReport {
        model: model.name.clone(),
        parameters: model.parameters(),
        prompt_tokens: config.prompt_tokens,
        hit_tokens,
        prefill_tok_s,
        decode_tok_s,
        ttft: vec![
            figures("recompute", &recompute),
            figures("host", &host),
            figures("device", &device),
        ],
    })
}

fn rate(tokens: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

/// Waits until kvtier's Match finds every key of `model` (stores are asynchronous).
fn wait_until_stored(
    url: &kvtier_client::ConnectOptions,
    model: &str,
    keys: &[kvtier_core::BlockKey],
) -> Result<(), BenchError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(err)?;
    rt.block_on(async {
        let mut c = kvtier_client::Client::connect_with(url, "bench-observer")
            .await
            .map_err(err)?;
        // A one-slot pool under the engine's model id: Match then looks in its namespace.
        let path = crate::sidecar::pool_path("observer");
        let pool = kvtier_transfer::CpuDevicePool::create(Some(&path), c.geometry(), 1).map_err(err)?;
        let h = c.register_cpu_pool(&pool, model, 0, 1).await.map_err(err)?;
        let start = Instant::now();
        loop {
            let m = c.match_keys(&h, "", keys).await.map_err(err)?;
            if m.host_tokens + m.disk_tokens >= keys.len() as u64 * u64::from(c.geometry().block_tokens()) {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(err(format!(
                    "kvtier holds {} of {} prefix tokens a minute after they were stored",
                    m.host_tokens + m.disk_tokens,
                    keys.len() as u64 * u64::from(c.geometry().block_tokens())
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_engine_bench_reports_every_scenario_with_its_hits() {
        let config = EngineBenchConfig {
            model: "tiny-moe".into(),
            layers: None,
            prompt_tokens: 100,
            rounds: 2,
            decode_tokens: 4,
            decode_batches: vec![1, 3],
            block_tokens: 16,
            host_capacity: ByteSize::mib(16),
            ..EngineBenchConfig::default()
        };
        let r = run_engine_bench(&config, &mut |_, _| {}).unwrap();
        assert_eq!(r.hit_tokens, 80, "90% of 100 tokens, in whole 16-token blocks");
        let cached: Vec<(&str, f64)> = r.ttft.iter().map(|t| (t.scenario, t.cached_tokens)).collect();
        assert_eq!(cached, [("recompute", 0.0), ("host", 80.0), ("device", 80.0)]);
        assert!(
            r.prefill_tok_s > 0.0 && r.decode_tok_s.iter().all(|(_, t)| *t > 0.0),
            "{r:?}"
        );
        let lines = r.lines();
        assert_eq!(lines[0].split('=').next(), Some("prefill_tok_s"));
        assert!(
            lines
                .last()
                .unwrap()
                .starts_with("ttft_speedup_vs_recompute host=")
        );
        let bad = EngineBenchConfig {
            hit_rate: 1.0,
            ..config
        };
        assert!(
            run_engine_bench(&bad, &mut |_, _| {})
                .unwrap_err()
                .to_string()
                .contains("--hit-rate 1")
        );
    }
}
