//! The seam between the selection ladders (this module's and the P/D one in `pd/`) and an
//! affinity tier (today the KV-cache-aware tier 1.5 in `kv/`).
//!
//! The ladder ([`super::ladder`]) asks the tier first for a rule that enables it and falls back
//! to the rule's `sel` on a miss. Each tier names its own per-request [`AffinityTier::Ticket`]
//! (a typed value, not a `dyn Any`): the caller starts every request with `Ticket::default()`
//! and hands the same ticket to every call, so per-request work (resolving the service,
//! tokenizing, block hashing) is done once.

use super::{Candidates, Decision, EpIdx};
use crate::request::RequestMeta;
use crate::rules::StoredRule;

/// An affinity tier as the ladder sees it.
pub trait AffinityTier: Send + Sync + 'static {
    /// What the tier keeps about one request between its calls.
    type Ticket: Default + Send;

    /// The tier's per-request work that may take time (tokenizing, hashing), done once before
    /// the first [`Self::select`] into `ticket`, off the runtime's threads and within the
    /// tier's own time budget. The default has nothing to prepare.
    fn prepare<'a>(
        &'a self,
        rule: &'a StoredRule,
        meta: &'a RequestMeta,
        ticket: &'a mut Self::Ticket,
    ) -> futures::future::BoxFuture<'a, ()> {
        let _ = (rule, meta, ticket);
        Box::pin(std::future::ready(()))
    }

    /// The tier for one request of `rule`. `Some(decision)` on a hit; `None` on a miss (the
    /// tier counts its own miss reason); the ladder then uses the rule's `sel`. Called again
    /// with the failed endpoint in `cands.excluded` on a connect failure, with the same
    /// `ticket`.
    fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        ticket: &mut Self::Ticket,
    ) -> Option<Decision>;

    /// The token ids of the request's prompt (at most `max`) when this tier has a tokenizer
    /// staged for its model, within the tier's own time budget; `None` otherwise (the caller
    /// then keys by the prompt's text). P/D tier 1 keys its prefix trie with them. The default
    /// has no tokenizer.
    fn prompt_tokens<'a>(
        &'a self,
        meta: &'a RequestMeta,
        max: usize,
    ) -> futures::future::BoxFuture<'a, Option<std::sync::Arc<[u32]>>> {
        let _ = (meta, max);
        Box::pin(std::future::ready(None))
    }

    /// A request of `rule` (a rule that uses this tier) is not a generation request
    /// ([`crate::request::ApiKind::is_generation`]): the ladder routes it by the rule's `sel`
    /// without entering the tier, and tells the tier once per request so it can count it
    /// apart from its misses. The default does nothing.
    fn bypassed(&self, rule: &StoredRule, meta: &RequestMeta) {
        let _ = (rule, meta);
    }

    /// The request is being sent to `ep` (for predicted-block insertion): called at dispatch,
    /// before the upstream answers, and again for the next endpoint after a connect failure
    /// (the failed endpoint's predictions then expire with their TTL). `ticket` is the one the
    /// request's `select` calls filled.
    fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, ticket: &mut Self::Ticket);
}
