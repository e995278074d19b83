//! The `loxi_user::kv` items the index needs, and the index itself.

/// Same shape as `loxi_user::kv::BlockKey`: the engine's 64-bit block id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// Same shape as `loxi_user::kv::members`.
pub mod members {
    /// A fleet member id (`loxi_user::kv::members::Member`).
    pub type Member = usize;
}

#[path = "../../../loxi-user/src/kv/index.rs"]
pub mod index;
