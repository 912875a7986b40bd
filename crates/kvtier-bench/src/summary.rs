//! mean / p50 / p99 of a series, printed the way the seed experiment prints them.

use serde::Serialize;

/// Mean and nearest-rank percentiles of a series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Number of samples.
    pub n: usize,
}

impl Summary {
    /// Summarizes `values` (an empty series gives zeros).
    pub fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: rank(50.0),
            p99: rank(99.0),
            n: v.len(),
        }
    }

    /// `name mean=… p50=… p99=…` with `decimals` digits, as in the seed's output.
    pub fn line(&self, name: &str, decimals: usize) -> String {
        format!(
            "{name} mean={:.d$} p50={:.d$} p99={:.d$}",
            self.mean,
            self.p50,
            self.p99,
            d = decimals
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!((s.mean, s.p50, s.p99, s.n), (50.5, 50.0, 99.0, 100));
        let one = Summary::of(&[233.095]);
        assert_eq!(
            one.line("batch_makespan_ms", 3),
            "batch_makespan_ms mean=233.095 p50=233.095 p99=233.095"
        );
        assert_eq!(Summary::of(&[]).n, 0);
        assert_eq!(
            Summary::of(&[6.184, 6.0]).line("load_bw_gib_s", 2),
            "load_bw_gib_s mean=6.09 p50=6.00 p99=6.18"
        );
    }
}
