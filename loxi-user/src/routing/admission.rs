//! The per-endpoint admission gate (LoxiLB's `LLB_PD_MAX_INFLIGHT_PER_EP`,
//! `LLB_PD_QUEUE_DEPTH_PER_EP`, `LLB_PD_MAX_PARK_SEC`; `../shared/spec/
//! configuration-and-tuning.txt`, "C data plane — Tier-1.5 parity, admission, timeouts" and
//! "Admission (opt-in — protection, not throughput)").
//!
//! One [`Gate`] per endpoint of a pool (carried across rule updates like the endpoint's load).
//! The selection picks the endpoint first; the request then enters that endpoint's gate:
//! - fewer than `max_inflight` admitted and nobody parked: admitted at once ([`Slot`]);
//! - else, with fewer than `queue_depth` parked: parked at the back of the endpoint's FIFO
//!   ([`Parked`]) until a slot frees (slots are handed to parked requests in arrival order; a
//!   new request never overtakes a parked one), the gate closes, or the park deadline passes;
//! - else refused ([`Refusal::Full`]).
//!
//! A [`Slot`] releases its place when dropped (handing it straight to the oldest parked
//! request). A [`Parked`] request that is dropped (its client went away) leaves the queue; if a
//! slot had just been handed to it, the slot goes on to the next one. [`Gate::close`] (the
//! endpoint left its rule, the rule was deleted, the daemon is stopping) answers every parked
//! request with [`Refusal::Closed`] and refuses new ones; admitted requests finish normally.
//!
//! Layering: this module knows nothing of HTTP; the proxy maps a [`Refusal`] to its answer
//! (429 / 504 / 503) and its metrics.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// Largest accepted park-queue depth (`LLB_PD_QUEUE_DEPTH_PER_EP` is clamped to it).
pub const MAX_QUEUE_DEPTH: u32 = 64;

/// Which mode-4 rules the gate applies to (`LOXI_ADMISSION_SCOPE`, loxi's own variable: LoxiLB
/// describes `LLB_PD_MAX_INFLIGHT_PER_EP` as a prefill cap of P/D rules and has no per-rule
/// switch for single pools).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdmissionScope {
    /// P/D rules only (the default): the prefill leg of a two-leg request, and every request a
    /// P/D rule serves in one leg (role-0 fallback, non-generation requests).
    #[default]
    Pd,
    /// Every mode-4 rule: a single-pool request holds its endpoint's slot until its response
    /// body ends.
    All,
}

impl AdmissionScope {
    /// `pd` or `all`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pd => "pd",
            Self::All => "all",
        }
    }
}

/// The gate's knobs, read once at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdmissionSettings {
    /// Requests admitted at once per endpoint (`LLB_PD_MAX_INFLIGHT_PER_EP`); 0 = the gate is
    /// off (default).
    pub max_inflight: u32,
    /// Requests parked at once per endpoint (`LLB_PD_QUEUE_DEPTH_PER_EP`, clamped to
    /// [`MAX_QUEUE_DEPTH`]); 0 (default) = nothing parks: a request finding its endpoint full
    /// is refused at once.
    pub queue_depth: u32,
    /// Longest a request stays parked (`LLB_PD_MAX_PARK_SEC`; 0 there means the prefill
    /// timeout `LLB_PD_PREFILL_TIMEOUT_SEC`, resolved by the config).
    pub max_park: Duration,
    /// Which rules are gated (`LOXI_ADMISSION_SCOPE`).
    pub scope: AdmissionScope,
}

impl AdmissionSettings {
    /// Does the gate apply to a rule (`pd`: the rule has `pd_disagg_mode`)?
    pub fn applies(&self, pd: bool) -> bool {
        self.max_inflight > 0 && (pd || self.scope == AdmissionScope::All)
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The endpoint is at its cap and its park queue is full.
    Full,
    /// The request was parked for the whole park deadline.
    TimedOut,
    /// The gate was closed (with this reason) before the request got a slot.
    Closed(CloseReason),
}

/// Why a gate was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// The endpoint is no longer in its rule, or the rule was deleted.
    Removed,
    /// The daemon is shutting down.
    Shutdown,
}

impl CloseReason {
    /// `endpoint_removed` or `shutdown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Removed => "endpoint_removed",
            Self::Shutdown => "shutdown",
        }
    }
}

/// One parked request's wake-up.
#[derive(Debug)]
struct Waiter {
    id: u64,
    /// Sent (under the gate's lock) when a slot is handed over; dropped when the gate closes.
    tx: oneshot::Sender<()>,
}

#[derive(Debug, Default)]
struct State {
    admitted: u32,
    queue: VecDeque<Waiter>,
    next_id: u64,
    closed: Option<CloseReason>,
}

impl State {
    /// One slot is free: to the oldest parked request, else back to the gate.
    fn release(&mut self) {
        while let Some(w) = self.queue.pop_front() {
            if w.tx.send(()).is_ok() {
                return;
            }
        }
        self.admitted = self.admitted.saturating_sub(1);
    }
}

/// One endpoint's gate (see the module doc).
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<State>,
}

/// What entering a gate gave.
#[derive(Debug)]
pub enum Entry {
    /// Admitted at once.
    Admitted(Slot),
    /// Parked: [`Parked::wait`] for the slot.
    Parked(Parked),
}

impl Gate {
    /// Enters the gate with the cap `max_inflight` (≥ 1) and park-queue depth `queue_depth`.
    pub fn enter(self: &Arc<Self>, max_inflight: u32, queue_depth: u32) -> Result<Entry, Refusal> {
        let mut s = self.state.lock();
        if let Some(why) = s.closed {
            return Err(Refusal::Closed(why));
        }
        if s.queue.is_empty() && s.admitted < max_inflight.max(1) {
            s.admitted += 1;
            return Ok(Entry::Admitted(Slot { gate: self.clone() }));
        }
        if s.queue.len() >= queue_depth.min(MAX_QUEUE_DEPTH) as usize {
            return Err(Refusal::Full);
        }
        let id = s.next_id;
        s.next_id += 1;
        let (tx, rx) = oneshot::channel();
        s.queue.push_back(Waiter { id, tx });
        Ok(Entry::Parked(Parked {
            gate: self.clone(),
            id,
            rx: Some(rx),
        }))
    }

    /// Closes the gate: every parked request gets [`Refusal::Closed`], later ones too.
    /// Admitted requests keep their slots. Closing twice keeps the first reason.
    pub fn close(&self, why: CloseReason) {
        let mut s = self.state.lock();
        s.closed.get_or_insert(why);
        // Dropping the senders wakes the parked requests with the close.
        s.queue.clear();
    }

    /// Requests holding a slot.
    pub fn admitted(&self) -> u32 {
        self.state.lock().admitted
    }

    /// Requests parked.
    pub fn parked(&self) -> usize {
        self.state.lock().queue.len()
    }

    fn closed(&self) -> Option<CloseReason> {
        self.state.lock().closed
    }
}

/// An admitted request's place in its endpoint's gate; released on drop.
#[derive(Debug)]
pub struct Slot {
    gate: Arc<Gate>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.state.lock().release();
    }
}

/// A parked request. Dropping it (the client went away) removes it from the queue.
#[derive(Debug)]
pub struct Parked {
    gate: Arc<Gate>,
    id: u64,
    /// `None` once settled (a slot was taken or the gate closed).
    rx: Option<oneshot::Receiver<()>>,
}

impl Parked {
    /// Waits at most `deadline` for a slot.
    pub async fn wait(mut self, deadline: Duration) -> Result<Slot, Refusal> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(Refusal::TimedOut);
        };
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(())) => {
                self.rx = None;
                Ok(Slot {
                    gate: self.gate.clone(),
                })
            }
            Ok(Err(_)) => {
                self.rx = None;
                Err(Refusal::Closed(
                    self.gate.closed().unwrap_or(CloseReason::Removed),
                ))
            }
            // Leaving the queue (or passing on a slot handed over at the deadline) is the
            // drop's work.
            Err(_) => Err(Refusal::TimedOut),
        }
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let mut s = self.gate.state.lock();
        if let Some(pos) = s.queue.iter().position(|w| w.id == self.id) {
            s.queue.remove(pos);
        } else if rx.try_recv().is_ok() {
            // A slot was handed over (under this lock, so the value is there) and nobody will
            // use it: pass it on.
            s.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(e: Result<Entry, Refusal>) -> Parked {
        match e {
            Ok(Entry::Parked(p)) => p,
            other => panic!("expected parked, got {other:?}"),
        }
    }

    fn admitted(e: Result<Entry, Refusal>) -> Slot {
        match e {
            Ok(Entry::Admitted(s)) => s,
            other => panic!("expected admitted, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn parked_requests_are_served_in_arrival_order() {
        let g = Arc::new(Gate::default());
        let first = admitted(g.enter(1, 3));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let p = parked(g.enter(1, 3));
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                let slot = p.wait(Duration::from_secs(5)).await.expect("slot");
                order.lock().push(i);
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(slot);
            }));
        }
        assert_eq!(g.enter(1, 3).err(), Some(Refusal::Full), "queue of 3 full");
        assert_eq!((g.admitted(), g.parked()), (1, 3));
        drop(first);
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(*order.lock(), [0, 1, 2]);
        assert_eq!((g.admitted(), g.parked()), (0, 0));
    }

    #[tokio::test]
    async fn a_new_request_does_not_overtake_a_parked_one() {
        let g = Arc::new(Gate::default());
        let a = admitted(g.enter(1, 2));
        let p = parked(g.enter(1, 2));
        drop(a);
        // The freed slot went to the parked request: a newcomer parks behind it.
        let newcomer = parked(g.enter(1, 2));
        let slot = p
            .wait(Duration::from_millis(100))
            .await
            .expect("handed over");
        assert_eq!(g.admitted(), 1);
        drop(slot);
        let _s = newcomer
            .wait(Duration::from_millis(100))
            .await
            .expect("next");
    }

    #[tokio::test]
    async fn a_dropped_parked_request_leaves_the_queue_and_passes_on_a_handed_slot() {
        let g = Arc::new(Gate::default());
        let a = admitted(g.enter(1, 2));
        let gone = parked(g.enter(1, 2));
        let next = parked(g.enter(1, 2));
        drop(gone);
        assert_eq!(g.parked(), 1, "the dropped one left the queue");
        // A slot handed to a request that is then dropped before taking it goes to the next.
        let third = parked(g.enter(1, 2));
        drop(a);
        drop(next);
        let _s = third
            .wait(Duration::from_millis(100))
            .await
            .expect("slot passed on");
        assert_eq!((g.admitted(), g.parked()), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_parked_past_the_deadline_times_out_and_leaves() {
        let g = Arc::new(Gate::default());
        let _a = admitted(g.enter(1, 1));
        let p = parked(g.enter(1, 1));
        let t = tokio::time::Instant::now();
        assert_eq!(
            p.wait(Duration::from_secs(2)).await.err(),
            Some(Refusal::TimedOut)
        );
        assert_eq!(t.elapsed(), Duration::from_secs(2));
        assert_eq!(g.parked(), 0);
    }

    #[tokio::test]
    async fn closing_answers_parked_requests_and_refuses_new_ones() {
        let g = Arc::new(Gate::default());
        let a = admitted(g.enter(1, 4));
        let p = parked(g.enter(1, 4));
        let waiting = tokio::spawn(p.wait(Duration::from_secs(30)));
        tokio::task::yield_now().await;
        g.close(CloseReason::Removed);
        g.close(CloseReason::Shutdown);
        assert_eq!(
            waiting.await.expect("task").err(),
            Some(Refusal::Closed(CloseReason::Removed))
        );
        assert_eq!(
            g.enter(1, 4).err(),
            Some(Refusal::Closed(CloseReason::Removed))
        );
        drop(a);
        assert_eq!(
            g.admitted(),
            0,
            "an admitted request still releases its slot"
        );
    }

    #[test]
    fn depth_zero_refuses_at_once_and_depth_is_clamped_to_64() {
        let g = Arc::new(Gate::default());
        let _a = admitted(g.enter(1, 0));
        assert_eq!(g.enter(1, 0).err(), Some(Refusal::Full));
        let held: Vec<Parked> = (0..64).map(|_| parked(g.enter(1, 1000))).collect();
        assert_eq!(g.enter(1, 1000).err(), Some(Refusal::Full), "clamped at 64");
        assert_eq!(held.len(), 64);
        drop(held);
        assert_eq!(g.parked(), 0);
    }

    #[test]
    fn the_cap_admits_that_many_at_once() {
        let g = Arc::new(Gate::default());
        let slots: Vec<Slot> = (0..3).map(|_| admitted(g.enter(3, 0))).collect();
        assert_eq!(g.enter(3, 0).err(), Some(Refusal::Full));
        drop(slots);
        assert_eq!(g.admitted(), 0);
    }

    #[test]
    fn settings_apply_to_p_d_rules_and_to_single_pools_only_when_scoped() {
        let mut s = AdmissionSettings {
            max_inflight: 2,
            ..Default::default()
        };
        assert!(s.applies(true) && !s.applies(false));
        s.scope = AdmissionScope::All;
        assert!(s.applies(true) && s.applies(false));
        s.max_inflight = 0;
        assert!(!s.applies(true) && !s.applies(false), "0 = off");
    }
}
