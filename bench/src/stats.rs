//! Percentiles and per-policy aggregates.
//!
//! Percentiles use the nearest-rank method: the p-th percentile of `n` sorted values is the value
//! at 1-based rank `ceil(p/100 · n)` (rank 1 for p = 0). No interpolation, so every reported
//! percentile is a value that was actually measured.

/// The p-th percentile (0..=100) of `values` by nearest rank; `None` when empty or `p` is out of
/// range or NaN values are present.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() || !(0.0..=100.0).contains(&p) || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

/// Arithmetic mean; `None` when empty.
pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// p50/p90/p99 of one latency series, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Quantiles {
    /// Quantiles of `values`; all zero when empty.
    pub fn of(values: &[f64]) -> Self {
        let q = |p| percentile(values, p).unwrap_or(0.0);
        Self {
            p50: q(50.0),
            p90: q(90.0),
            p99: q(99.0),
        }
    }
}

/// Imbalance of a request distribution: `max / mean` of per-worker counts (1.0 = perfectly even;
/// `None` when there are no workers or no requests).
pub fn max_over_mean(counts: &[u64]) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if counts.is_empty() || total == 0 {
        return None;
    }
    let max = *counts.iter().max()? as f64;
    Some(max / (total as f64 / counts.len() as f64))
}

/// Engine-side prefix hit rate from summed counter deltas: `hits / queries` (tokens), 0 when no
/// query was made.
pub fn hit_rate(hits: f64, queries: f64) -> f64 {
    if queries > 0.0 { hits / queries } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles_pick_measured_values() {
        let v = [15.0, 20.0, 35.0, 40.0, 50.0];
        assert_eq!(percentile(&v, 30.0), Some(20.0));
        assert_eq!(percentile(&v, 40.0), Some(20.0));
        assert_eq!(percentile(&v, 50.0), Some(35.0));
        assert_eq!(percentile(&v, 100.0), Some(50.0));
        assert_eq!(percentile(&v, 0.0), Some(15.0));
    }

    #[test]
    fn percentile_ignores_input_order_and_rejects_bad_input() {
        let v = [9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0];
        assert_eq!(percentile(&v, 90.0), Some(9.0));
        assert_eq!(percentile(&v, 99.0), Some(10.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&v, 101.0), None);
        assert_eq!(percentile(&[1.0, f64::NAN], 50.0), None);
    }

    #[test]
    fn quantiles_of_hundred_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            Quantiles::of(&v),
            Quantiles {
                p50: 50.0,
                p90: 90.0,
                p99: 99.0
            }
        );
        assert_eq!(Quantiles::of(&[]), Quantiles::default());
    }

    #[test]
    fn max_over_mean_measures_imbalance() {
        assert_eq!(max_over_mean(&[10, 10, 10, 10]), Some(1.0));
        assert_eq!(max_over_mean(&[30, 10, 0, 0]), Some(3.0));
        assert_eq!(max_over_mean(&[0, 0]), None);
        assert_eq!(max_over_mean(&[]), None);
    }

    #[test]
    fn hit_rate_is_hits_over_queries() {
        assert_eq!(hit_rate(48.0, 64.0), 0.75);
        assert_eq!(hit_rate(0.0, 0.0), 0.0);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), Some(3.0));
    }
}
