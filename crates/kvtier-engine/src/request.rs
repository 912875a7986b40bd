//! What goes into the engine and what comes out: a [`GenRequest`], its [`SeqEvent`]s, and the
//! [`Usage`] (counts, timings, kvtier transfers) of a finished request.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::sampling::Sampling;
use crate::sidecar_link::Window;

/// Decides, from the tokens generated so far, whether a stop sequence has appeared (the HTTP
/// layer checks stop strings in the decoded text with it). Called after every token.
#[derive(Clone)]
pub struct StopCheck(pub std::sync::Arc<StopFn>);

/// The function behind a [`StopCheck`]: the generated tokens so far → stop now?
pub type StopFn = dyn Fn(&[u32]) -> bool + Send + Sync;

impl std::fmt::Debug for StopCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StopCheck")
    }
}

/// One generation request.
#[derive(Debug, Clone, Default)]
pub struct GenRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: Sampling,
    /// Keep generating past end-of-sequence tokens (benchmarks do).
    pub ignore_eos: bool,
    /// Tenant isolation: prefixes are shared only under the same salt.
    pub cache_salt: String,
    /// Tokens that end generation like end-of-sequence (`finish_reason` `stop`), even with
    /// `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// Tokens to generate before end-of-sequence and stop tokens may end it: until then they
    /// are masked out of sampling (as vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// Stop sequences checked on the output (`finish_reason` `stop`).
    pub stop: Option<StopCheck>,
    /// Send each token's log-probability and this many most likely alternatives
    /// ([`SeqEvent::Logprobs`] before its [`SeqEvent::Token`]); `None` sends none.
    pub logprobs: Option<usize>,
}

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model's distribution (the logits before
/// temperature, as vLLM reports by default) and the most likely tokens at that position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token drawn.
    pub token: u32,
    /// Its natural log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Log-softmax of `logits` at `token`, and the `top` most likely tokens.
    ///
    /// Cost: two passes over the vocabulary and a partial selection of `top`.
    pub fn of(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let norm = max + sum.ln() as f32;
        let at = |t: u32| logits.get(t as usize).map_or(f32::NEG_INFINITY, |l| l - norm);
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let top = top.min(ids.len());
        if top > 0 && top < ids.len() {
            ids.select_nth_unstable_by(top - 1, |a, b| {
                logits[*b as usize].total_cmp(&logits[*a as usize])
            });
        }
        ids.truncate(top);
        ids.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        Self {
            token,
            logprob: at(token),
            top: ids.into_iter().map(|t| (t, at(t))).collect(),
        }
    }
}

/// Prompt tokens served from each place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedTokens {
    /// From the engine's device pool (no copy).
    pub device: usize,
    /// Loaded from kvtier's host tier.
    pub host: usize,
    /// Loaded from kvtier's disk tier.
    pub disk: usize,
    /// Loaded from kvtier's remote tier (a cluster shared by the fleet).
    #[serde(default)]
    pub remote: usize,
}

impl CachedTokens {
    /// All cached prompt tokens.
    pub fn total(&self) -> usize {
        self.device + self.host + self.disk + self.remote
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` generated.
    Length,
    /// An end-of-sequence token.
    Stop,
}

/// When a request's kvtier copies ran, relative to its arrival.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferSpan {
    /// First copy started, ms after arrival.
    pub start_ms: f64,
    /// Last copy finished, ms after arrival.
    pub end_ms: f64,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of the copies' own durations, ms.
    pub active_ms: f64,
}

impl TransferSpan {
    pub(crate) fn of(arrived: Instant, windows: &[Window]) -> Option<Self> {
        let start = windows.iter().map(|w| w.start).min()?;
        let end = windows.iter().map(|w| w.end).max()?;
        let ms = |t: Instant| t.saturating_duration_since(arrived).as_secs_f64() * 1e3;
        Some(Self {
            start_ms: ms(start),
            end_ms: ms(end),
            bytes: windows.iter().map(|w| w.bytes).sum(),
            active_ms: windows.iter().map(|w| w.active.as_secs_f64() * 1e3).sum(),
        })
    }
}

/// A request's kvtier transfers: its prefix load (host/disk → device) and the stores of its
/// new blocks (device → host) whose replies came before it finished.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Transfers {
    /// The load, if the prefix came from kvtier.
    pub load: Option<TransferSpan>,
    /// The stores.
    pub store: Option<TransferSpan>,
}

/// What a finished request used and how long it took.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens not recomputed, by source.
    pub cached: CachedTokens,
    /// Arrival → first token, ms.
    pub ttft_ms: f64,
    /// Mean time per output token after the first, ms.
    pub tpot_ms: f64,
    /// Arrival → last token, ms.
    pub e2e_ms: f64,
    /// kvtier transfers.
    pub transfers: Transfers,
}

/// A request's output, in order: `Prefilled`, `Token`s, then one `Finished` (or one
/// `Failed` at any point).
#[derive(Debug, Clone)]
pub enum SeqEvent {
    /// The prompt is computed (or loaded): where its cached tokens came from. Sent once,
    /// right before the first token.
    Prefilled(CachedTokens),
    /// The log-probabilities of the token that follows, when the request asked for them.
    Logprobs(TokenLogprobs),
    /// The next token.
    Token(u32),
    /// Generation ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Counts and timings.
        usage: Usage,
    },
    /// The request could not be served (the message says why).
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_tokens_in_order() {
        // Probabilities 1/6, 2/6, 3/6.
        let logits = [0.0f32, 2f32.ln(), 3f32.ln()];
        let lp = TokenLogprobs::of(&logits, 1, 2);
        assert!((lp.logprob - (2.0f32 / 6.0).ln()).abs() < 1e-5, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!((lp.top[0].1 - 0.5f32.ln()).abs() < 1e-5);
        assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
        assert_eq!(TokenLogprobs::of(&logits, 0, 9).top.len(), 3);
    }
}
