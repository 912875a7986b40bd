//! Choosing the next token from logits: greedy, or temperature (+ top-p) with a seeded RNG.

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// How a request samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0 = greedy (argmax); otherwise logits are divided by it before the softmax.
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to `top_p` (1 = all).
    pub top_p: f32,
    /// RNG seed (the same seed and prompt give the same tokens).
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Checks the values.
    ///
    /// # Errors
    /// [`EngineError::BadRequest`] naming the bad value.
    pub fn validate(&self) -> Result<(), EngineError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(EngineError::BadRequest(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::BadRequest(format!(
                "top_p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A sequence's sampler state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: Sampling) -> Self {
        Self {
            state: params.seed ^ 0x5DEE_CE66_D1CE_4E5B,
            params,
        }
    }

    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token. Cost: O(vocab) (plus a sort of the candidates with top-p < 1).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return crate::model::argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| (i as u32, f64::from((l - max) / t).exp()))
            .collect();
        if self.params.top_p < 1.0 {
            p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let z: f64 = p.iter().map(|x| x.1).sum();
            let mut acc = 0.0;
            let keep = p
                .iter()
                .position(|x| {
                    acc += x.1 / z;
                    acc >= f64::from(self.params.top_p)
                })
                .map_or(p.len(), |i| i + 1);
            p.truncate(keep);
        }
        let z: f64 = p.iter().map(|x| x.1).sum();
        let mut r = self.next_f64() * z;
        for (id, w) in &p {
            r -= w;
            if r <= 0.0 {
                return *id;
            }
        }
        p.last().map_or(0, |x| x.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_seeded_and_nucleus() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(Sampling::default()).sample(&logits), 1);
        let hot = Sampling {
            temperature: 1.0,
            top_p: 1.0,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(hot);
            (0..64).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(hot);
            (0..64).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b, "same seed, same tokens");
        assert!(a.contains(&1) && a.contains(&2), "{a:?}");
        let mut nucleus = Sampler::new(Sampling { top_p: 0.4, ..hot });
        assert!(
            (0..64).all(|_| nucleus.sample(&logits) == 1),
            "top-p 0.4 keeps only the best"
        );
        for bad in [
            Sampling {
                temperature: -1.0,
                ..hot
            },
            Sampling {
                temperature: f32::NAN,
                ..hot
            },
            Sampling { top_p: 0.0, ..hot },
            Sampling { top_p: 1.5, ..hot },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
