//! Endpoint identity inside one KV service.
//!
//! The index, the parity book, the stream table and the subscriber tasks key an endpoint by a
//! [`Member`] id that follows the endpoint's identity (its `endpointIP:targetPort` and KV-event
//! publisher port), not its
//! position in the rule. Re-POSTing a rule with an endpoint added, removed or moved therefore
//! keeps every other endpoint's inventory, stream and predictions: engines never re-announce
//! blocks they already hold, so a view dropped on a fleet change would stay blind until their
//! caches churn. Positions (`EpIdx`, the `ep_idx` label, the routing candidates) are translated
//! at the edges: [`Members::member_at`], [`Members::idx_of`], [`Members::resolve`].
//!
//! Member ids are never reused within a service (a removed endpoint's id is retired with its
//! blocks), so a late event of a stopped stream can never land on another endpoint. Ids are
//! packed into 28 bits by the index: a service would need 2^28 endpoint additions to run out.

use crate::routing::EpIdx;
use crate::rules::KvEndpoint;

/// An endpoint's id inside one service's KV state (stable across rule updates).
pub type Member = usize;

/// What [`Members::sync`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MemberChange {
    /// Members whose endpoint left the rule (their state must be dropped).
    pub removed: Vec<Member>,
    /// Positions whose endpoint identity changed (added, removed or another endpoint now sits
    /// there), over both the old and the new list: their per-position series are stale.
    pub moved: Vec<EpIdx>,
}

impl MemberChange {
    /// Did anything change?
    pub fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.moved.is_empty()
    }
}

/// The endpoints of one service in rule order, each with its member id.
#[derive(Debug, Default)]
pub struct Members {
    order: Vec<(KvEndpoint, Member)>,
    next: Member,
}

/// Identity: address, port and KV-event publisher port (another publisher is another source
/// of blocks, so its inventory starts afresh). The replay port is not identity: it only
/// changes how a restarted stream catches up.
fn same_endpoint(a: &KvEndpoint, b: &KvEndpoint) -> bool {
    a.port == b.port && a.ip == b.ip && a.zmq_port == b.zmq_port
}

impl Members {
    /// Members for `eps`, ids 0.. in order.
    pub fn new(eps: &[KvEndpoint]) -> Self {
        let mut m = Self::default();
        m.sync(eps);
        m
    }

    /// Follows the rule's new endpoint list: an endpoint already present (same IP and port)
    /// keeps its member id wherever it now sits, a new one gets a fresh id, a missing one is
    /// reported in [`MemberChange::removed`]. The `subscribed` flag is updated in place.
    pub fn sync(&mut self, eps: &[KvEndpoint]) -> MemberChange {
        let mut change = MemberChange::default();
        let mut order = Vec::with_capacity(eps.len());
        for ep in eps {
            let member = match self.order.iter().find(|(e, _)| same_endpoint(e, ep)) {
                Some((_, m)) => *m,
                None => {
                    let m = self.next;
                    self.next += 1;
                    m
                }
            };
            order.push((ep.clone(), member));
        }
        for (old, m) in &self.order {
            if !eps.iter().any(|e| same_endpoint(e, old)) {
                change.removed.push(*m);
            }
        }
        for i in 0..order.len().max(self.order.len()) {
            let before = self.order.get(i).map(|(_, m)| *m);
            let after = order.get(i).map(|(_, m)| *m);
            if before != after {
                change.moved.push(i);
            }
        }
        self.order = order;
        change
    }

    /// The member at position `idx` of the current list.
    pub fn member_at(&self, idx: EpIdx) -> Option<Member> {
        self.order.get(idx).map(|(_, m)| *m)
    }

    /// The current position of `member` (`None` once its endpoint left the rule).
    pub fn idx_of(&self, member: Member) -> Option<EpIdx> {
        self.order.iter().position(|(_, m)| *m == member)
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True when the service has no endpoint.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// `(position, endpoint, member)` in rule order.
    pub fn iter(&self) -> impl Iterator<Item = (EpIdx, &KvEndpoint, Member)> {
        self.order.iter().enumerate().map(|(i, (e, m))| (i, e, *m))
    }

    /// Fills `out[i]` with the member of `eps[i]` (a request's view of the rule, which may be a
    /// snapshot older or newer than this list while a rule update is applied), `None` for an
    /// endpoint this service does not know. Positional fast path; a linear search only for
    /// positions that differ.
    pub fn resolve(&self, eps: &[KvEndpoint], out: &mut Vec<Option<Member>>) {
        out.clear();
        out.extend(eps.iter().enumerate().map(|(i, ep)| self.member_of(ep, i)));
    }

    /// The member of endpoint `ep`, which sits at position `hint` in the caller's view of the
    /// rule (checked first); `None` for an endpoint this service does not know.
    pub fn member_of(&self, ep: &KvEndpoint, hint: EpIdx) -> Option<Member> {
        match self.order.get(hint) {
            Some((e, m)) if same_endpoint(e, ep) => Some(*m),
            _ => self
                .order
                .iter()
                .find(|(e, _)| same_endpoint(e, ep))
                .map(|(_, m)| *m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ip: &str, port: u16) -> KvEndpoint {
        KvEndpoint {
            ip: ip.into(),
            port,
            subscribed: true,
            zmq_port: 5557,
            replay_port: 0,
        }
    }

    #[test]
    fn another_event_port_is_another_member_and_a_replay_port_is_not() {
        let a = ep("127.0.0.1", 8001);
        let mut m = Members::new(std::slice::from_ref(&a));
        let replay = KvEndpoint {
            replay_port: 5700,
            ..a.clone()
        };
        assert!(
            m.sync(std::slice::from_ref(&replay)).is_empty(),
            "same publisher"
        );
        assert_eq!(m.member_at(0), Some(0));
        let moved = KvEndpoint {
            zmq_port: 5601,
            ..a.clone()
        };
        let ch = m.sync(&[moved]);
        assert_eq!((ch.removed, ch.moved), (vec![0], vec![0]));
        assert_eq!(
            m.member_at(0),
            Some(1),
            "a fresh member: its blocks start afresh"
        );
    }

    #[test]
    fn identity_keeps_its_member_through_add_remove_and_reorder() {
        let (a, b, c) = (ep("10.0.0.1", 80), ep("10.0.0.2", 80), ep("10.0.0.1", 81));
        let mut m = Members::new(&[a.clone(), b.clone()]);
        assert_eq!((m.member_at(0), m.member_at(1)), (Some(0), Some(1)));

        let ch = m.sync(&[a.clone(), b.clone(), c.clone()]);
        assert_eq!(
            ch,
            MemberChange {
                removed: vec![],
                moved: vec![2]
            }
        );
        assert_eq!(m.member_at(2), Some(2));

        let ch = m.sync(&[c.clone(), a.clone()]);
        assert_eq!(ch.removed, vec![1]);
        assert_eq!(ch.moved, vec![0, 1, 2]);
        assert_eq!((m.member_at(0), m.member_at(1)), (Some(2), Some(0)));
        assert_eq!(
            (m.idx_of(0), m.idx_of(1), m.idx_of(2)),
            (Some(1), None, Some(0))
        );

        // b comes back: a fresh id, never its old one.
        m.sync(&[c.clone(), a.clone(), b.clone()]);
        assert_eq!(m.member_at(2), Some(3));
        assert!(m.sync(&[c, a, b]).is_empty());
    }

    #[test]
    fn resolve_maps_an_older_snapshot_by_identity() {
        let (a, b, c) = (ep("10.0.0.1", 80), ep("10.0.0.2", 80), ep("10.0.0.3", 80));
        let mut m = Members::new(&[a.clone(), b.clone(), c.clone()]);
        m.sync(&[c.clone(), a.clone()]);
        let mut out = Vec::new();
        m.resolve(&[a, b, c], &mut out);
        assert_eq!(out, vec![Some(0), None, Some(2)]);
    }
}
