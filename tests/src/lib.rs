//! Test support for loxi's integration tests: the daemon harness ([`harness`]) and, from the
//! proxy side, real test backends.
pub mod backend;
pub mod harness;
