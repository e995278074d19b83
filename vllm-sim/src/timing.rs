//! The timing model and the simulated clock.
//!
//! Step durations (simulated seconds), fitted to `../shared/calibration/h200-llama8b-prefill.json`
//! (Llama-3-8B shape on one H200): a step that prefills `p` tokens takes
//! `max(prefill_floor, p / prefill_rate)` (256 tokens: 31 ms, 1024: 31.6 ms, 2048: 60.8 ms,
//! 4096: 122.7 ms measured; the fit gives 31, 31, 62, 124 ms); a decode-only step takes
//! `decode_step` (8 ms default: a serving engine with CUDA graphs, not the eager measurement).
//! A step carrying both prefill and decode tokens takes the longer of the two.
//!
//! The clock maps simulated seconds to real instants through `time_scale` (real s per
//! simulated s). The engine advances its own simulated time step by step and sleeps until the
//! matching real instant, so sub-millisecond steps at small scales keep their average rate even
//! though tokio timers have millisecond resolution.

use std::time::Duration;

use tokio::time::Instant;

/// Step-duration parameters, all in simulated units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Prefill throughput, tokens per simulated second.
    pub prefill_tokens_per_s: f64,
    /// Minimum duration of a step that prefills anything, simulated seconds.
    pub prefill_floor_s: f64,
    /// Duration of a decode-only step, simulated seconds.
    pub decode_step_s: f64,
}

impl Default for TimingModel {
    /// The "8B model on one H200" profile.
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 33_000.0,
            prefill_floor_s: 0.031,
            decode_step_s: 0.008,
        }
    }
}

impl TimingModel {
    /// Simulated seconds of one engine step that prefills `prefill_tokens` uncached tokens and
    /// decodes `decode_seqs` sequences by one token each. Zero when the step does nothing.
    pub fn step_seconds(&self, prefill_tokens: usize, decode_seqs: usize) -> f64 {
        let prefill = if prefill_tokens > 0 {
            (prefill_tokens as f64 / self.prefill_tokens_per_s).max(self.prefill_floor_s)
        } else {
            0.0
        };
        let decode = if decode_seqs > 0 {
            self.decode_step_s
        } else {
            0.0
        };
        prefill.max(decode)
    }
}

/// Maps simulated seconds since start to real instants: `real = start + sim × scale`.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    start: Instant,
    scale: f64,
}

impl SimClock {
    /// A clock starting now; `scale` is real seconds per simulated second (> 0).
    pub fn new(scale: f64) -> Self {
        Self {
            start: Instant::now(),
            scale,
        }
    }

    /// Simulated seconds elapsed since the clock started.
    pub fn now_sim(&self) -> f64 {
        self.start.elapsed().as_secs_f64() / self.scale
    }

    /// The real instant at which simulated time `sim` (seconds since start) is reached.
    pub fn real_at(&self, sim: f64) -> Instant {
        self.start + Duration::from_secs_f64((sim * self.scale).max(0.0))
    }

    /// Real seconds per simulated second.
    pub fn scale(&self) -> f64 {
        self.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_prefill_costs_the_floor_and_long_prefill_the_rate() {
        let m = TimingModel::default();
        assert!((m.step_seconds(256, 0) - 0.031).abs() < 1e-9);
        let t = m.step_seconds(4096, 0);
        assert!((t - 4096.0 / 33_000.0).abs() < 1e-9, "{t}");
        assert!((m.step_seconds(0, 5) - 0.008).abs() < 1e-9);
        assert_eq!(m.step_seconds(0, 0), 0.0);
    }

    #[test]
    fn cached_prefix_shortens_the_step_like_the_calibration() {
        // 16,384 tokens with 15,360 cached: measured 80 ms vs 603 ms (7.5x).
        let m = TimingModel::default();
        let cold = m.step_seconds(16_384, 0);
        let warm = m.step_seconds(16_384 - 15_360, 0);
        assert!(cold / warm > 7.0, "cold {cold} warm {warm}");
    }

    #[tokio::test(start_paused = true)]
    async fn clock_scales_simulated_time() {
        let c = SimClock::new(0.01);
        tokio::time::advance(Duration::from_millis(10)).await;
        assert!((c.now_sim() - 1.0).abs() < 1e-6, "{}", c.now_sim());
        assert_eq!(c.real_at(2.0) - c.real_at(0.0), Duration::from_millis(20));
    }
}
