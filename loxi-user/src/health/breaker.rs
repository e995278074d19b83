//! Passive circuit breaker: `threshold` consecutive failures (an origin 5xx response, a
//! failed connect, or a response body the backend broke off mid-stream) open the endpoint's breaker, which takes it out of selection for
//! `cooldown`; then it is half-open: eligible again, one more failure re-opens it at once and a
//! success closes it. A 4xx neither advances nor resets the streak (LoxiLB's
//! `LLB_PD_ORIGIN_ERR_THRESHOLD` contract, default 3; 0 disables the breaker).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::HealthCell;
use crate::routing::EndpointLoad;

/// What one attempt told the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The backend answered with this status.
    Status(u16),
    /// The connection could not be made.
    ConnectFailed,
    /// The response began but the backend's body failed mid-stream (it died or reset).
    StreamFailed,
    /// The request was sent and no usable response head came: the connection failed first
    /// (the backend reset or closed it: a crashing server behind a listening socket), or the
    /// head was one no client may be given (an unsolicited `101 Switching Protocols`).
    NoResponse,
    /// No response head within the fullproxy's response timeout
    /// (`LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS`): a hung or black-holed backend.
    TimedOut,
}

/// Breaker settings, and where its half-open timers run.
#[derive(Debug, Clone)]
pub struct Breaker {
    /// Consecutive failures that open the breaker; 0 = disabled.
    pub threshold: u32,
    /// How long an open breaker holds the endpoint down before half-opening.
    pub cooldown: Duration,
    /// Tracks the half-open timers (the owner waits for them at shutdown).
    pub timers: TaskTracker,
    /// Ends pending timers at shutdown.
    pub stop: CancellationToken,
}

impl Breaker {
    /// Feeds one outcome; returns true when this call opened the breaker.
    pub fn observe(
        &self,
        cell: &Arc<HealthCell>,
        load: &Arc<EndpointLoad>,
        outcome: Outcome,
    ) -> bool {
        if self.threshold == 0 {
            return false;
        }
        match outcome {
            Outcome::Status(s) if (400..500).contains(&s) => false,
            Outcome::Status(s) if s < 500 => {
                cell.streak.store(0, Ordering::Relaxed);
                false
            }
            _ => self.fail(cell, load),
        }
    }

    fn fail(&self, cell: &Arc<HealthCell>, load: &Arc<EndpointLoad>) -> bool {
        let streak = cell.streak.fetch_add(1, Ordering::Relaxed) + 1;
        if streak < self.threshold || cell.breaker_open.swap(true, Ordering::Relaxed) {
            return false;
        }
        cell.publish(load);
        let (cell, load, cooldown, threshold) =
            (cell.clone(), load.clone(), self.cooldown, self.threshold);
        let stop = self.stop.clone();
        self.timers.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(cooldown) => {}
                _ = stop.cancelled() => return,
            }
            // Half-open: one more failure re-opens immediately.
            cell.streak.store(threshold - 1, Ordering::Relaxed);
            cell.breaker_open.store(false, Ordering::Relaxed);
            cell.publish(&load);
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Breaker, Arc<HealthCell>, Arc<EndpointLoad>) {
        (
            Breaker {
                threshold: 3,
                cooldown: Duration::from_secs(10),
                timers: TaskTracker::new(),
                stop: CancellationToken::new(),
            },
            HealthCell::new(),
            EndpointLoad::new(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn three_5xx_open_then_half_open_after_cooldown() {
        let (b, cell, load) = setup();
        assert!(!b.observe(&cell, &load, Outcome::Status(500)));
        assert!(!b.observe(&cell, &load, Outcome::Status(502)));
        assert!(load.is_healthy());
        assert!(b.observe(&cell, &load, Outcome::Status(503)));
        assert!(!load.is_healthy());
        tokio::time::sleep(Duration::from_millis(9_999)).await;
        assert!(!load.is_healthy(), "still open before the cool-down ends");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(load.is_healthy(), "half-open after the cool-down");
        assert!(
            b.observe(&cell, &load, Outcome::Status(500)),
            "one failure re-opens a half-open breaker"
        );
        assert!(!load.is_healthy());
    }

    #[tokio::test(start_paused = true)]
    async fn success_resets_and_4xx_is_neutral() {
        let (b, cell, load) = setup();
        b.observe(&cell, &load, Outcome::Status(500));
        b.observe(&cell, &load, Outcome::Status(500));
        b.observe(&cell, &load, Outcome::Status(404));
        assert_eq!(
            cell.streak.load(Ordering::Relaxed),
            2,
            "4xx neither advances nor resets"
        );
        b.observe(&cell, &load, Outcome::Status(200));
        assert_eq!(cell.streak.load(Ordering::Relaxed), 0);
        b.observe(&cell, &load, Outcome::ConnectFailed);
        b.observe(&cell, &load, Outcome::ConnectFailed);
        assert!(load.is_healthy());
        assert!(
            b.observe(&cell, &load, Outcome::ConnectFailed),
            "connect failures count too"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn mid_stream_failures_open_the_breaker() {
        let (b, cell, load) = setup();
        b.observe(&cell, &load, Outcome::StreamFailed);
        b.observe(&cell, &load, Outcome::StreamFailed);
        assert!(load.is_healthy());
        assert!(b.observe(&cell, &load, Outcome::StreamFailed));
        assert!(!load.is_healthy());
    }

    #[tokio::test(start_paused = true)]
    async fn threshold_zero_disables() {
        let (mut b, cell, load) = setup();
        b.threshold = 0;
        for _ in 0..10 {
            assert!(!b.observe(&cell, &load, Outcome::Status(500)));
        }
        assert!(load.is_healthy());
    }
}
