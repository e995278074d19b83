//! The seam between the proxy and the KV-cache-aware tier 1.5.
//!
//! The proxy owns an `Option<Arc<dyn AffinityTier>>`; for a rule with `kvExactMode: 3` it asks
//! the tier first and falls back to the rule's `sel` on a miss. The KV engineer implements the
//! trait in `kv/`; the proxy only calls it, carrying one [`TierMemo`] per request between the
//! calls so that per-request work (tokenizing, block hashing) is done once.

use std::any::Any;

use super::{Candidates, Decision, EpIdx};
use crate::proxy::meta::RequestMeta;
use crate::rules::StoredRule;

/// Tier 1.5 (KV overlap) as the proxy sees it.
pub trait AffinityTier: Send + Sync + 'static {
    /// Tier 1.5 for one request of `rule` (kvExactMode 3). `Some(decision)` on a hit;
    /// `None` on a miss (the tier counts its own miss reason); the proxy then uses the rule's
    /// `sel`. Called again with the failed endpoint in `cands.excluded` on a connect failure,
    /// with the same `memo`.
    fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        memo: &mut TierMemo,
    ) -> Option<Decision>;
    /// The proxy is sending the request to `ep` (for predicted-block insertion): called at
    /// dispatch, before the upstream answers, and again for the next endpoint after a connect
    /// failure (the failed endpoint's predictions then expire with their TTL). `memo` is the
    /// one the request's `select` calls filled.
    fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, memo: &TierMemo);
}

/// What the tier remembers about one request between its calls. The proxy creates an empty
/// one per request and hands it back on every call; only the tier knows what is inside.
#[derive(Default)]
pub struct TierMemo(Option<Box<dyn Any + Send + Sync>>);

impl TierMemo {
    /// The remembered `T`, if the tier stored one.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.as_deref().and_then(|v| v.downcast_ref())
    }

    /// Remembers `value` (replacing whatever was remembered).
    pub fn set<T: Any + Send + Sync>(&mut self, value: T) {
        self.0 = Some(Box::new(value));
    }
}

#[cfg(test)]
mod tests {
    use super::TierMemo;

    #[test]
    fn memo_returns_what_was_set_and_only_as_its_type() {
        let mut memo = TierMemo::default();
        assert_eq!(memo.get::<u32>(), None);
        memo.set(7u32);
        assert_eq!(memo.get::<u32>(), Some(&7));
        assert_eq!(memo.get::<String>(), None);
        memo.set(String::from("keys"));
        assert_eq!(
            (memo.get::<u32>(), memo.get::<String>().map(String::as_str)),
            (None, Some("keys"))
        );
    }
}
