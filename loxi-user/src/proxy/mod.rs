//! The mode-4 fullproxy.
pub mod meta;
