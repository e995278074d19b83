//! Reconciles subscriber tasks against rule snapshots: kvExactMode 3 subscribes every
//! endpoint, kvExactMode 1 the prefill endpoints (`ep_role: 1`), each on `kvDpRankCount`
//! ranks (`kvZmqPort + rank`, the endpoint's own `kvZmqPort` when it has one). A rule deletion (or kvExactMode 0) stops its tasks and drops its
//! index; a change of the rule's KV contract rebuilds the service state and restarts them. A
//! change of endpoints alone ([`KvState::sync`]) keeps the state: streams are keyed by the
//! endpoint's member id, so only the streams of added or removed endpoints start or stop.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::subscriber::{Stream, StreamAddr, StreamTiming};
use crate::kv::state::{KvState, ServiceKv};
use crate::rules::model::authority;
use crate::rules::store::{Applied, RuleSnapshot};

/// Identity of a running stream: rule id, the service-state instance it feeds, and its address.
type StreamKey = (u32, usize, StreamAddr);

/// Owns the subscriber tasks.
pub struct KvManager {
    state: Arc<KvState>,
    timing: StreamTiming,
    running: HashMap<StreamKey, (CancellationToken, JoinHandle<()>)>,
}

/// The streams a service wants: one per (subscribed endpoint, rank), keyed by the endpoint's
/// member id, so a stream survives its endpoint moving in the rule.
pub fn streams_of(svc: &ServiceKv) -> Vec<StreamAddr> {
    let c = &svc.config;
    let mut out = Vec::new();
    for (_, ep, member) in svc.members.read().iter() {
        if !ep.subscribed {
            continue;
        }
        for rank in 0..c.dp_ranks {
            let replay =
                (ep.replay_port != 0).then(|| authority(&ep.ip, u32::from(ep.replay_port) + rank));
            out.push(StreamAddr {
                member,
                rank,
                publisher: authority(&ep.ip, u32::from(ep.zmq_port) + rank),
                replay,
            });
        }
    }
    out
}

impl KvManager {
    /// A manager with no tasks yet.
    pub fn new(state: Arc<KvState>, timing: StreamTiming) -> Self {
        Self {
            state,
            timing,
            running: HashMap::new(),
        }
    }

    /// Follows `rules` until `cancel` fires, reconciling on every snapshot; stops every task at
    /// the end.
    pub async fn run(
        mut self,
        mut rules: watch::Receiver<Arc<RuleSnapshot>>,
        applied: Applied,
        cancel: CancellationToken,
    ) {
        loop {
            let snap = rules.borrow_and_update().clone();
            self.reconcile(&snap);
            applied.mark(snap.version);
            tokio::select! {
                _ = cancel.cancelled() => break,
                r = rules.changed() => if r.is_err() { break },
            }
        }
        self.stop_all().await;
    }

    /// Starts missing streams and stops unwanted ones for `snap`.
    #[allow(
        clippy::disallowed_methods,
        reason = "the manager supervises its streams: it keeps every JoinHandle and awaits them in stop_all"
    )]
    pub fn reconcile(&mut self, snap: &RuleSnapshot) {
        let mut want: HashMap<StreamKey, Arc<ServiceKv>> = HashMap::new();
        let mut live_ids = Vec::new();
        for rule in snap.rules.values() {
            let Some(svc) = self.state.sync(rule) else {
                continue;
            };
            live_ids.push(rule.id);
            for addr in streams_of(&svc) {
                want.insert((rule.id, Arc::as_ptr(&svc) as usize, addr), svc.clone());
            }
        }
        self.running.retain(|k, (tok, _)| {
            let keep = want.contains_key(k);
            if !keep {
                tok.cancel();
            }
            keep
        });
        for (key, svc) in want {
            if self.running.contains_key(&key) {
                continue;
            }
            let tok = CancellationToken::new();
            let stream = Stream::new(self.state.clone(), svc, key.2.clone(), self.timing);
            let h = tokio::spawn(stream.run(tok.clone()));
            self.running.insert(key, (tok, h));
        }
        for id in self.state.ids() {
            if !live_ids.contains(&id) {
                self.state.drop_service(id);
            }
        }
    }

    /// `member@publisher/rank` of every running stream (the identity a stream keeps across
    /// rule updates; for tests and logs).
    pub fn publishers(&self) -> Vec<String> {
        self.running
            .keys()
            .map(|(_, _, a)| format!("{}@{}/{}", a.member, a.publisher, a.rank))
            .collect()
    }

    /// Number of running streams.
    pub fn len(&self) -> usize {
        self.running.len()
    }

    /// True when no stream runs.
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    async fn stop_all(&mut self) {
        for (_, (tok, h)) in self.running.drain() {
            tok.cancel();
            let _ = h.await;
        }
    }
}
