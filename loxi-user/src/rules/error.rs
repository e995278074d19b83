//! The error every rule check returns: which field, what is wrong, and the HTTP status class
//! (`api::error` maps `Invalid`/`UnknownField` to 400 and `Conflict`/`IdTaken` to 409).

use super::spec::SpecError;

/// A rejected rule. `field` is the JSON path of the offending field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuleError {
    /// A field's value is out of range or malformed (HTTP 400).
    #[error("{field}: {message}")]
    Invalid {
        /// JSON path, e.g. `serviceArguments.sel`.
        field: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A field that does not exist, with the right spelling when it is a casing or
    /// separator mistake (HTTP 400).
    #[error("\"{}\" is not a field{}", leaf(field), suggestion.as_ref().map(|s| format!("; did you mean \"{s}\"?")).unwrap_or_default())]
    UnknownField {
        /// JSON path of the unknown key (the message names only its last segment).
        field: String,
        /// The right field name, when one is close.
        suggestion: Option<String>,
    },
    /// A rule with the same key has another shape (HTTP 409). This text (the body's `result`,
    /// which kube-loxilb reads) avoids the word "exist": kube-loxilb's `installLB` treats an
    /// error containing "exist" as its rule already installed, and would record a rule that is
    /// not. People read [`RuleError::message`] (the body's `message`, which loxicmd prints).
    #[error("{field}: the rule with this key has {field} = {existing}; delete it first")]
    Conflict {
        /// The field whose value differs.
        field: String,
        /// The existing value.
        existing: String,
    },
    /// Another rule (another key) already has the posted `serviceArguments.id` (HTTP 409): an
    /// id names one rule.
    #[error(
        "serviceArguments.id: {id:?} is the id of rule {rule}; ids are unique (leave id out to \
         have one minted)"
    )]
    IdTaken {
        /// The posted id.
        id: String,
        /// The key of the rule that has it.
        rule: String,
    },
}

impl RuleError {
    /// The error as a person reads it (the API body's `message`, which loxicmd prints). The
    /// same as [`std::fmt::Display`] but for a [`RuleError::Conflict`], which says in words
    /// that the rule already exists, where `Display` (the body's `result`, read by kube-loxilb)
    /// must not.
    pub fn message(&self) -> String {
        match self {
            RuleError::Conflict { field, existing } => format!(
                "{field}: a rule with this key already exists with another shape ({field} = \
                 {existing}); delete it first (loxi does not change a rule's shape in place)"
            ),
            other => other.to_string(),
        }
    }
}

/// The last segment of a JSON path (`serviceArguments.kv_exact_mode` → `kv_exact_mode`).
fn leaf(path: &str) -> &str {
    path.rsplit_once('.').map_or(path, |(_, last)| last)
}

impl From<SpecError> for RuleError {
    fn from(e: SpecError) -> Self {
        RuleError::Invalid {
            field: e.field,
            message: e.message,
        }
    }
}
