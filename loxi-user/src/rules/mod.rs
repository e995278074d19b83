//! Rules: the LoxiLB-compatible model, validation, the typed spec validation compiles, the
//! snapshot store and its state file.
pub mod addr;
pub mod error;
pub mod json;
pub mod model;
pub mod persist;
pub mod schema;
pub mod spec;
pub mod store;
pub mod text;
pub mod unsupported;
pub mod validate;

pub use error::RuleError;
pub use model::{Endpoint, LbRule, RuleKey, ServiceArgs};
pub use spec::{KvEndpoint, KvMode, KvSpec, ServiceSpec};
pub use store::{RuleSnapshot, RuleStore, StoredRule, UpsertOutcome};
