//! The seam between the proxy and the KV-cache-aware tier 1.5.
//!
//! The proxy owns an `Option<Arc<dyn AffinityTier>>`; for a rule with `kvExactMode: 3` it asks
//! the tier first and falls back to the rule's `sel` on a miss. The KV engineer implements the
//! trait in `kv/`; the proxy only calls it.

use super::{Candidates, Decision, EpIdx};
use crate::proxy::meta::RequestMeta;
use crate::rules::StoredRule;

/// Tier 1.5 (KV overlap) as the proxy sees it.
pub trait AffinityTier: Send + Sync + 'static {
    /// Tier 1.5 for one request of `rule` (kvExactMode 3). `Some(decision)` on a hit;
    /// `None` on a miss (the tier counts its own miss reason); the proxy then uses the rule's
    /// `sel`. Called again with the failed endpoint in `cands.excluded` on a connect failure.
    fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
    ) -> Option<Decision>;
    /// The proxy sent the request to `ep` (for predicted-block insertion).
    fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx);
}
