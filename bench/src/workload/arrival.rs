//! Arrival schedules: Poisson (exponential gaps) or fixed (evenly spaced) at a target rate.

use rand::Rng;
use std::time::Duration;

/// How request arrival offsets are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Poisson process at `qps` requests/s: gaps are exponential with mean `1/qps` s.
    Poisson {
        /// Mean rate, requests per second (> 0).
        qps: f64,
    },
    /// One request every `1/qps` s, the first at offset 0.
    Fixed {
        /// Rate, requests per second (> 0).
        qps: f64,
    },
}

impl Arrival {
    /// Parses `poisson` or `fixed` with a rate.
    pub fn parse(kind: &str, qps: f64) -> Result<Self, super::WorkloadError> {
        if !(qps.is_finite() && qps > 0.0) {
            return Err(super::WorkloadError::Param {
                field: "qps",
                msg: format!("{qps} is not > 0"),
            });
        }
        match kind {
            "poisson" => Ok(Arrival::Poisson { qps }),
            "fixed" => Ok(Arrival::Fixed { qps }),
            other => Err(super::WorkloadError::Param {
                field: "arrival",
                msg: format!("{other:?}: expected \"poisson\" or \"fixed\""),
            }),
        }
    }

    /// `n` non-decreasing offsets from the start of the run.
    pub fn offsets<R: Rng>(&self, n: usize, rng: &mut R) -> Vec<Duration> {
        let mut t = 0.0f64;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            match *self {
                Arrival::Poisson { qps } => {
                    if i > 0 {
                        let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
                        t += -u.ln() / qps;
                    }
                }
                Arrival::Fixed { qps } => t = i as f64 / qps,
            }
            out.push(Duration::from_secs_f64(t));
        }
        out
    }
}
