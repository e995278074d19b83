//! Prefill/decode disaggregation (`pd_disagg_mode: true`): the P/D selection ladder, the tier-0
//! session pins, the handoff dialects (vLLM, SGLang, TensorRT-LLM) and the P/D metrics.
//!
//! Layer 1 beside `kv/` and `routing/`: it reads the typed [`crate::rules::spec::PdSpec`], the
//! request vocabulary and the routing candidates, and reaches tier 1.5 only through the
//! [`crate::routing::AffinityTier`] seam. The proxy (`proxy/pd.rs`) runs the two legs.
//!
//! Files: `ladder.rs` (tiers 0, 1, 1.5 and 2, the decode leg, the role-0 fallback), `pins.rs`
//! (bounded LRU + TTL pin table), `trie.rs` (tier 1's bounded multi-endpoint radix tree and
//! the request key), `handoff.rs` (the vLLM dialect: leg bodies, transfer parameters, request
//! id), `dialect/` (SGLang's bootstrap fields, TensorRT-LLM's `disaggregated_params`),
//! `metrics.rs`.

pub mod dialect;
pub mod handoff;
pub mod ladder;
pub mod metrics;
pub mod pins;
pub mod trie;

pub use ladder::{Choice, PdLadder, PdState, PdTier, TrieOutcome};
pub use metrics::PdMetrics;
pub use pins::{Pin, PinTable};
