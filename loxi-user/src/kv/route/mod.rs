//! KV routing at request time (tier 1.5): the guard ladder and scoring (`select.rs`, returning
//! a typed [`select::KvTicket`] the retry and `routed` reuse), the blend laws (`blend.rs`) and
//! the miss reasons (`miss.rs`), the tokenization pool (`workers.rs`). Per request: the index's one read lock, the per-service watchdog and waiting mutexes; `routed` takes the index's write lock to predict.

pub mod blend;
pub mod miss;
pub mod select;
pub mod workers;
