//! Multi-turn conversations, like production-stack's multi-round QA benchmark.
//!
//! `users` conversations of `rounds` rounds each share one system prompt. Round `r` of a user
//! sends the system prompt, the user's `r` earlier questions with pre-generated answers of
//! `answer_tokens` tokens, and a new question of `question_tokens` tokens, as a chat request.
//! Round `r + 1` waits for round `r` to complete (`after`). Users are active `active_users` at a
//! time (a wave); within a wave, rounds are ordered round-major with users shuffled within a
//! round, and the next wave starts after the previous one. Arrival offsets come from `arrival`
//! in that order.
//!
//! Answers are generated here, not taken from the engine's output, so the workload (and the
//! oracle computed from it) is fixed before the run.

use super::{Arrival, ChatMessage, Payload, Vocab, WorkRequest, Workload, WorkloadError};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// Parameters of the multi-turn workload (lengths in tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct MultiTurn {
    /// Number of users (conversations), ≥ 1.
    pub users: usize,
    /// Rounds per user, ≥ 1.
    pub rounds: usize,
    /// Shared system-prompt length.
    pub system_tokens: usize,
    /// Question length per round (≥ 1).
    pub question_tokens: usize,
    /// Answer length per round: the history's assistant turns and `max_tokens`.
    pub answer_tokens: u32,
    /// Users in flight at a time (0 or ≥ `users`: all at once).
    pub active_users: usize,
    /// Arrival schedule.
    pub arrival: Arrival,
    /// RNG seed.
    pub seed: u64,
}

impl MultiTurn {
    /// Builds the workload. Errors name a zero `users`, `rounds` or `question_tokens`.
    pub fn build(&self, vocab: &Vocab) -> Result<Workload, WorkloadError> {
        for (field, v) in [
            ("users", self.users),
            ("rounds", self.rounds),
            ("question_tokens", self.question_tokens),
        ] {
            if v == 0 {
                return Err(WorkloadError::Param {
                    field,
                    msg: "must be ≥ 1".into(),
                });
            }
        }
        let mut rng = StdRng::seed_from_u64(self.seed);
        let system = ChatMessage::new("system", vocab.text(&mut rng, self.system_tokens));
        let convs: Vec<Vec<(String, String)>> = (0..self.users)
            .map(|_| {
                (0..self.rounds)
                    .map(|_| self.turn(vocab, &mut rng))
                    .collect()
            })
            .collect();
        let wave = if self.active_users == 0 {
            self.users
        } else {
            self.active_users.min(self.users)
        };
        let mut order = Vec::with_capacity(self.users * self.rounds);
        for first in (0..self.users).step_by(wave) {
            for round in 0..self.rounds {
                let mut users: Vec<usize> = (first..(first + wave).min(self.users)).collect();
                users.shuffle(&mut rng);
                order.extend(users.into_iter().map(|u| (u, round)));
            }
        }
        let offsets = self.arrival.offsets(order.len(), &mut rng);
        let mut last: Vec<Option<usize>> = vec![None; self.users];
        let mut requests = Vec::with_capacity(order.len());
        for (id, ((user, round), at)) in order.into_iter().zip(offsets).enumerate() {
            let messages = history(&system, &convs[user], round);
            requests.push(WorkRequest {
                id,
                at,
                payload: Payload::Chat(messages),
                max_tokens: self.answer_tokens,
                after: last[user],
                group: user,
            });
            last[user] = Some(id);
        }
        Ok(Workload::new("multi_turn", requests))
    }

    fn turn(&self, vocab: &Vocab, rng: &mut StdRng) -> (String, String) {
        let q = vocab.text(rng, self.question_tokens);
        let a = vocab.text(rng, self.answer_tokens as usize);
        (q, a)
    }
}

/// System prompt + rounds `0..round` as question/answer pairs + question `round`.
fn history(system: &ChatMessage, conv: &[(String, String)], round: usize) -> Vec<ChatMessage> {
    let mut messages = vec![system.clone()];
    for (q, a) in &conv[..round] {
        messages.push(ChatMessage::new("user", q.clone()));
        messages.push(ChatMessage::new("assistant", a.clone()));
    }
    messages.push(ChatMessage::new("user", conv[round].0.clone()));
    messages
}
