//! One run: warm the shared prefix as the scenario needs, then send the requests (prefix plus a
//! unique suffix each) with bounded concurrency, streamed, and record what each saw.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::BenchError;
use crate::http_client::post_events;

use super::report::{RequestRecord, ServeRun, summarize};
use super::target::Target;
use super::{Scenario, ServeConfig, err};

/// Distinct token streams (tag, position), below `vocab`.
pub(super) fn tokens(seed: u64, tag: u32, n: usize, vocab: u32) -> Vec<u32> {
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
pub(super) const DATASET_VOCAB: u32 = 500;

pub(super) async fn run_one(
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
    let warm = |i: u32| warm_request(target, prompt(900 + i), tick);
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
            poll_until(async || {
                let have = target.disk_entries().await?;
                Ok((have < want).then(|| format!(
                    "the sidecar's disk tier holds {have} blocks, {want} expected: the disk scenario needs a disk tier and a write policy that persists the prefix"
                )))
            })
            .await?;
            target
                .call("POST", "/kvtier/clear", Some(json!({"tier": "host"})))
                .await?;
        }
        Scenario::Remote => {
            let peer = target
                .peer
                .as_deref()
                .ok_or_else(|| err("the remote scenario needs a second node (--remote-nodes)"))?;
            // Node A computes the prefix; its sidecar writes it to the cluster behind the store.
            let (before, _) = peer.remote_writes().await?;
            peer.set_reuse("tiered").await?;
            warm_request(peer, prompt(900), tick).await?;
            let want = before + (prefix_tokens / bt) as u64;
            poll_until(async || {
                let (written, pending) = peer.remote_writes().await?;
                Ok((written < want || pending > 0).then(|| {
                    format!("node A's sidecar wrote {written} blocks to the remote tier, {want} expected ({pending} pending)")
                }))
            })
            .await?;
            // Node B has it in no tier of its own: only the remote tier can serve it.
            target.set_reuse("kvtier").await?;
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

/// Asks `check` every 20 ms until it answers `None` (done); `Some(why)` means not yet, and
/// after 120 s that is the error.
async fn poll_until(
    mut check: impl AsyncFnMut() -> Result<Option<String>, BenchError>,
) -> Result<(), BenchError> {
    let start = Instant::now();
    while let Some(why) = check().await? {
        if start.elapsed() > Duration::from_secs(120) {
            return Err(err(why));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// One unmeasured request of `prompt` (one token generated) that leaves its prefix cached.
async fn warm_request(
    node: &Target,
    prompt: Vec<u32>,
    tick: &(dyn Fn() + Sync),
) -> Result<Value, BenchError> {
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": true});
    let r = node.call("POST", "/v1/completions", Some(body)).await;
    tick();
    r
}

pub(super) async fn one_request(host: &str, path: &str, body: String) -> RequestRecord {
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
        rec.cached_by_tier = [n(&c["device"]), n(&c["host"]), n(&c["disk"]), n(&c["remote"])];
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
