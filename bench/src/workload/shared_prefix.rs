//! Shared-prefix groups, like inference-perf's `shared_prefix` data generator.
//!
//! `groups` system prompts of `system_tokens` tokens; each group has `prompts_per_group`
//! completion prompts = the group's system prompt + a unique question of `question_tokens`
//! tokens. All prompts are shuffled (seeded) and given arrival offsets from `arrival`.

use super::{Arrival, Payload, Vocab, WorkRequest, Workload, WorkloadError};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// Parameters of the shared-prefix workload (lengths in tokens of the tiny model's tokenizer).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefix {
    /// Number of groups (distinct system prompts), ≥ 1.
    pub groups: usize,
    /// Prompts per group, ≥ 1.
    pub prompts_per_group: usize,
    /// System-prompt length, tokens.
    pub system_tokens: usize,
    /// Question length, tokens (≥ 1 so every prompt is unique).
    pub question_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: u32,
    /// Arrival schedule.
    pub arrival: Arrival,
    /// RNG seed.
    pub seed: u64,
}

impl SharedPrefix {
    /// Builds the workload. Errors name a zero `groups`, `prompts_per_group` or `question_tokens`.
    pub fn build(&self, vocab: &Vocab) -> Result<Workload, WorkloadError> {
        self.check()?;
        let mut rng = StdRng::seed_from_u64(self.seed);
        let systems: Vec<String> = (0..self.groups)
            .map(|_| vocab.text(&mut rng, self.system_tokens))
            .collect();
        let mut pairs: Vec<(usize, String)> = Vec::new();
        for (g, sys) in systems.iter().enumerate() {
            for _ in 0..self.prompts_per_group {
                pairs.push((
                    g,
                    format!("{sys}{}", vocab.text(&mut rng, self.question_tokens)),
                ));
            }
        }
        pairs.shuffle(&mut rng);
        let offsets = self.arrival.offsets(pairs.len(), &mut rng);
        let requests = pairs
            .into_iter()
            .zip(offsets)
            .enumerate()
            .map(|(id, ((group, prompt), at))| WorkRequest {
                id,
                at,
                payload: Payload::Completion(prompt),
                max_tokens: self.output_tokens,
                after: None,
                group,
            })
            .collect();
        Ok(Workload::new("shared_prefix", requests))
    }

    fn check(&self) -> Result<(), WorkloadError> {
        let zero = |field, v: usize| {
            (v == 0).then(|| WorkloadError::Param {
                field,
                msg: "must be ≥ 1".into(),
            })
        };
        match zero("groups", self.groups)
            .or_else(|| zero("prompts_per_group", self.prompts_per_group))
            .or_else(|| zero("question_tokens", self.question_tokens))
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
