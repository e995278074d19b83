//! KV event ingest: what the engines publish, applied to the per-service block index.
//!
//! `manager.rs` reconciles one `subscriber.rs` task per (endpoint, DP rank) with the rule
//! snapshots; its sockets reach the engine through `guard.rs` (a loopback relay bounding the
//! size of a ZeroMQ message); a stream tracks sequence numbers and repairs gaps (`replay.rs`), decodes msgpack
//! batches (`events.rs`) and applies them to its service (`apply.rs`: block-size guard, parity
//! self-check and token re-hash in `parity.rs`). Writers only: nothing here runs per request.

pub mod apply;
pub mod events;
pub mod guard;
pub mod manager;
pub mod parity;
pub mod replay;
pub mod subscriber;
