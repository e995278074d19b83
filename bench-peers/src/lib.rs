//! loxi's KV index (`loxi-user/src/kv/index.rs`), compiled from its source file so that the
//! peer benchmark measures the same code without building loxi-user (whose build script
//! compiles the eBPF programs) in this separate workspace. The two items the index imports
//! from its parent module are re-declared in [`kv`] with the same shapes.

pub mod kv;
