//! Replays a workload against one target with real concurrency.
//!
//! Every request gets its own task that sleeps until its arrival offset, waits for the request
//! named in `after` (the previous round of a conversation) and then sends. The whole run is
//! bounded by a deadline; requests not finished by then are reported as timed out. With
//! [`RunLimits::concurrency`] the replay is closed-loop: at most that many requests in flight.

use super::client::{HttpClient, Outcome, send};
use crate::workload::Workload;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

/// Where requests go.
#[derive(Debug, Clone)]
pub enum Target {
    /// One base URL (a gateway or a peer router): `http://host:port`.
    Gateway(String),
    /// Client-side round-robin over worker base URLs (the `direct` baseline).
    Direct(Vec<String>),
    /// Client-side round-robin over gateway replicas' base URLs (`--replicas N`): request `id`
    /// goes to replica `id mod N`.
    Replicas(Vec<String>),
}

/// Where one request goes: the base URL, and the worker (`direct`) or replica index chosen.
struct Pick {
    base: String,
    direct: Option<usize>,
    replica: Option<usize>,
}

impl Target {
    fn pick(&self, id: usize) -> Pick {
        match self {
            Target::Gateway(u) => Pick {
                base: u.clone(),
                direct: None,
                replica: None,
            },
            Target::Direct(us) => Pick {
                base: us[id % us.len()].clone(),
                direct: Some(id % us.len()),
                replica: None,
            },
            Target::Replicas(us) => Pick {
                base: us[id % us.len()].clone(),
                direct: None,
                replica: Some(id % us.len()),
            },
        }
    }

    /// A base URL to send a probe to (the first worker or replica).
    pub fn first(&self) -> &str {
        match self {
            Target::Gateway(u) => u,
            Target::Direct(us) | Target::Replicas(us) => &us[0],
        }
    }
}

/// Run limits.
#[derive(Debug, Clone, Copy)]
pub struct RunLimits {
    /// Per-request timeout (real time).
    pub request_timeout: Duration,
    /// Real-time multiplier applied to the workload's offsets (the sims' `--time-scale`).
    pub time_scale: f64,
    /// Closed loop: at most this many requests in flight (0 = open loop, arrivals only). A
    /// request takes its slot after its arrival time and after the request it follows
    /// (`after`), in arrival order (the semaphore is FIFO).
    pub concurrency: usize,
}

/// Sends every request of `workload` to `target` for `model`; returns outcomes by request id
/// and the real wall time of the run.
pub async fn run(
    client: &HttpClient,
    target: &Target,
    workload: &Workload,
    model: &str,
    limits: RunLimits,
) -> (Vec<Outcome>, Duration) {
    let start = Instant::now() + Duration::from_millis(20);
    let done: Vec<(watch::Sender<bool>, watch::Receiver<bool>)> = workload
        .requests
        .iter()
        .map(|_| watch::channel(false))
        .collect();
    let done = Arc::new(done);
    let slots = (limits.concurrency > 0).then(|| Arc::new(Semaphore::new(limits.concurrency)));
    let mut tasks = Vec::with_capacity(workload.requests.len());
    for r in &workload.requests {
        let Pick {
            base,
            direct,
            replica,
        } = target.pick(r.id);
        let url = format!("{base}{}", r.payload.path());
        let body = Bytes::from(r.payload.body(model, r.max_tokens).to_string());
        let at = start + r.at.mul_f64(limits.time_scale);
        let (client, done, id, after) = (client.clone(), done.clone(), r.id, r.after);
        let slots = slots.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            if let Some(prev) = after {
                let mut rx = done[prev].1.clone();
                let _ = rx.wait_for(|d| *d).await;
            }
            let _slot = match &slots {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            let mut out = send(&client, id, &url, body, limits.request_timeout).await;
            out.direct_worker = direct;
            out.replica = replica;
            let _ = done[id].0.send(true);
            out
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for (id, t) in tasks.into_iter().enumerate() {
        outcomes.push(t.await.unwrap_or_else(|e| Outcome {
            id,
            error: Some(format!("task failed: {e}")),
            ..Outcome::default()
        }));
    }
    (outcomes, start.elapsed())
}
