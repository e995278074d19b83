//! P/D tier 1 (`pd_cache_aware_mode: true`): a multi-endpoint radix tree of the prompts routed
//! to each prefill endpoint, in the manner of SGLang's cache-aware router (its `tree.rs` keeps
//! one character radix tree whose nodes record, per worker, when that worker last took a
//! request through them, and evicts least-recently-used leaves; loxi's structure is its own).
//!
//! Keys are sequences of `u32` symbols: the request's token ids when a tokenizer is staged for
//! its model (or the prompt is token ids), else the prompt text's characters
//! ([`key_of`]). The first symbol is a tag ([`TOKENS_TAG`] or [`TEXT_TAG`]) so that a token key
//! never matches a text key; a key holds at most [`KEY_MAX`] symbols after the tag (a longer
//! prompt is keyed by its first [`KEY_MAX`] symbols, and its match rate is taken over those).
//!
//! Each node holds an edge label (a run of symbols) and the endpoints that hold the node's
//! whole path (from the root), each with the logical time it last did. Inserting a key under
//! an endpoint marks every node on its path, so the set of holders only shrinks going down:
//! the longest match of an endpoint is the deepest node on the key's path that it holds.
//!
//! Memory is bounded per rule: the labels hold at most `capacity` symbols in all
//! ([`TRIE_CAPACITY`] in the daemon, 1 Mi symbols, about 4 MiB of labels plus per-node
//! overhead). An insert that crosses it evicts least-recently-used leaves (a leaf's time is
//! its newest holder's) until the labels hold at most 7/8 of the capacity, so eviction runs
//! once per ~capacity/8 symbols learned rather than on every insert.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::request::{Prompt, RequestMeta};
use crate::routing::EpIdx;

/// Symbols a rule's trie holds at most (labels summed), 1 Mi: about 4 MiB of labels plus
/// per-node overhead (a node per distinct branch point). Fixed per rule; not configurable.
pub const TRIE_CAPACITY: usize = 1 << 20;

/// Symbols of a request's key after its tag (the first 16 Ki tokens or characters).
pub const KEY_MAX: usize = 16 * 1024;

/// First symbol of a key made of token ids.
pub const TOKENS_TAG: u32 = u32::MAX;

/// First symbol of a key made of text characters (Unicode scalar values).
pub const TEXT_TAG: u32 = u32::MAX - 1;

/// The root's index in the arena.
const ROOT: usize = 0;

/// The tier-1 key of a request: `tokens` (the prompt's ids, when a tokenizer is staged) else
/// the prompt's own token ids, else its text (a chat prompt is each message's role and
/// content, separated by U+0000 and U+0001 so that message boundaries are part of the key).
/// `None` when the request has no prompt or an empty one. At most [`KEY_MAX`] symbols after
/// the tag.
pub fn key_of(meta: &RequestMeta, tokens: Option<&[u32]>) -> Option<Vec<u32>> {
    let mut key = Vec::new();
    let prompt = meta.prompt.as_ref()?;
    let tokens = tokens.or(match prompt {
        Prompt::TokenIds(ids) => Some(ids.as_slice()),
        _ => None,
    });
    if let Some(ids) = tokens {
        key.push(TOKENS_TAG);
        key.extend(ids.iter().take(KEY_MAX));
    } else if let Prompt::Messages(msgs) = prompt {
        key.push(TEXT_TAG);
        let text = msgs.iter().flat_map(|m| {
            m.role
                .chars()
                .chain(std::iter::once('\u{1}'))
                .chain(m.content.chars())
                .chain(std::iter::once('\u{0}'))
        });
        key.extend(text.take(KEY_MAX).map(u32::from));
    } else if let Prompt::Text(t) = prompt {
        key.push(TEXT_TAG);
        key.extend(t.chars().take(KEY_MAX).map(u32::from));
    }
    (key.len() > 1).then_some(key)
}

/// One node: the edge label from its parent, its children by first symbol, its holders.
#[derive(Debug, Clone, Default)]
struct Node {
    label: Vec<u32>,
    parent: usize,
    children: HashMap<u32, usize>,
    /// Endpoints holding this node's whole path, with the logical time each last did.
    holders: Vec<(EpIdx, u64)>,
}

impl Node {
    fn newest(&self) -> u64 {
        self.holders.iter().map(|h| h.1).max().unwrap_or(0)
    }
}

/// The longest match of a key among the endpoints a caller accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrieMatch {
    /// Symbols of the key matched, its tag included.
    pub matched: usize,
    /// The accepted endpoints that hold the whole matched prefix, ascending.
    pub holders: Vec<EpIdx>,
}

/// A multi-endpoint radix tree over `u32` symbols (see the module doc). Not synchronised: the
/// P/D state keeps it behind a mutex.
#[derive(Debug, Clone)]
pub struct PrefixTrie {
    /// Arena; index 0 is the root (empty label, no holders). Freed slots are in `free`.
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Symbols in all labels.
    stored: usize,
    capacity: usize,
    clock: u64,
}

impl PrefixTrie {
    /// An empty trie holding at most `capacity` symbols (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            stored: 0,
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    /// Symbols held in all labels (never above the capacity after an insert).
    pub fn stored(&self) -> usize {
        self.stored
    }

    /// Nodes in use, the root included.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// The longest prefix of `key` held by an endpoint for which `accept` is true, and the
    /// accepted endpoints that hold all of it; `None` when no accepted endpoint holds even the
    /// key's first symbol.
    pub fn longest_match(&self, key: &[u32], accept: impl Fn(EpIdx) -> bool) -> Option<TrieMatch> {
        let (mut node, mut pos) = (ROOT, 0);
        let mut best: Option<TrieMatch> = None;
        while pos < key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[pos]) else {
                break;
            };
            let n = &self.nodes[child];
            let common = common_len(&n.label, &key[pos..]);
            let mut holders: Vec<EpIdx> = n
                .holders
                .iter()
                .map(|h| h.0)
                .filter(|&ep| accept(ep))
                .collect();
            if holders.is_empty() {
                // Descendants hold a subset of this node's holders.
                break;
            }
            holders.sort_unstable();
            pos += common;
            best = Some(TrieMatch {
                matched: pos,
                holders,
            });
            if common < n.label.len() {
                break;
            }
            node = child;
        }
        best
    }

    /// Records that `key` (at most the capacity's worth of it) was routed to `ep`: every node
    /// on its path is marked with `ep` at a new logical time, splitting an edge where the key
    /// leaves it; then least-recently-used leaves are evicted if the capacity is crossed.
    pub fn insert(&mut self, key: &[u32], ep: EpIdx) {
        let key = &key[..key.len().min(self.capacity)];
        self.clock += 1;
        let now = self.clock;
        let (mut node, mut pos) = (ROOT, 0);
        while pos < key.len() {
            let child = match self.nodes[node].children.get(&key[pos]) {
                Some(&c) => c,
                None => {
                    let leaf = self.alloc(Node {
                        label: key[pos..].to_vec(),
                        parent: node,
                        children: HashMap::new(),
                        holders: vec![(ep, now)],
                    });
                    self.stored += key.len() - pos;
                    self.nodes[node].children.insert(key[pos], leaf);
                    break;
                }
            };
            let common = common_len(&self.nodes[child].label, &key[pos..]);
            let child = if common < self.nodes[child].label.len() {
                self.split(node, child, common)
            } else {
                child
            };
            touch(&mut self.nodes[child].holders, ep, now);
            pos += common;
            node = child;
        }
        if self.stored > self.capacity {
            self.evict(self.capacity - self.capacity / 8);
        }
    }

    /// Renumbers the holders after the rule changed: `map(old)` is the endpoint's new index,
    /// or `None` for an endpoint that was removed, which the trie forgets (subtrees left with
    /// no holder are freed).
    pub fn remap(&mut self, map: impl Fn(EpIdx) -> Option<EpIdx>) {
        let mut stack: Vec<usize> = self.nodes[ROOT].children.values().copied().collect();
        while let Some(n) = stack.pop() {
            let holders = std::mem::take(&mut self.nodes[n].holders);
            let kept: Vec<(EpIdx, u64)> = holders
                .into_iter()
                .filter_map(|(ep, t)| map(ep).map(|e| (e, t)))
                .collect();
            if kept.is_empty() {
                self.remove_subtree(n);
            } else {
                self.nodes[n].holders = kept;
                stack.extend(self.nodes[n].children.values().copied());
            }
        }
    }

    /// Forgets endpoint `ep` (the other indices are unchanged).
    pub fn forget(&mut self, ep: EpIdx) {
        self.remap(|e| (e != ep).then_some(e));
    }

    /// Splits `child` (of `parent`) after `at` label symbols; returns the new upper node,
    /// which keeps `child`'s holders.
    fn split(&mut self, parent: usize, child: usize, at: usize) -> usize {
        let lower_label = self.nodes[child].label.split_off(at);
        let upper_label = std::mem::take(&mut self.nodes[child].label);
        let first = upper_label[0];
        let upper = self.alloc(Node {
            children: HashMap::from([(lower_label[0], child)]),
            holders: self.nodes[child].holders.clone(),
            label: upper_label,
            parent,
        });
        self.nodes[child].label = lower_label;
        self.nodes[child].parent = upper;
        self.nodes[parent].children.insert(first, upper);
        upper
    }

    /// Frees least-recently-used leaves until at most `target` symbols remain.
    fn evict(&mut self, target: usize) {
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (1..self.nodes.len())
            .filter(|&i| self.live(i) && self.nodes[i].children.is_empty())
            .map(|i| Reverse((self.nodes[i].newest(), i)))
            .collect();
        while self.stored > target {
            let Some(Reverse((_, leaf))) = heap.pop() else {
                break;
            };
            let parent = self.nodes[leaf].parent;
            self.remove_subtree(leaf);
            if parent != ROOT && self.nodes[parent].children.is_empty() {
                heap.push(Reverse((self.nodes[parent].newest(), parent)));
            }
        }
    }

    /// Unlinks `n` from its parent and frees it and its descendants.
    fn remove_subtree(&mut self, n: usize) {
        let parent = self.nodes[n].parent;
        let first = self.nodes[n].label[0];
        self.nodes[parent].children.remove(&first);
        let mut stack = vec![n];
        while let Some(i) = stack.pop() {
            let node = std::mem::take(&mut self.nodes[i]);
            self.stored -= node.label.len();
            stack.extend(node.children.into_values());
            self.free.push(i);
        }
    }

    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// A slot in use (freed slots have an empty label; only the root has one in use).
    fn live(&self, i: usize) -> bool {
        i == ROOT || !self.nodes[i].label.is_empty()
    }
}

fn touch(holders: &mut Vec<(EpIdx, u64)>, ep: EpIdx, now: u64) {
    match holders.iter_mut().find(|h| h.0 == ep) {
        Some(h) => h.1 = now,
        None => holders.push((ep, now)),
    }
}

fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
#[path = "trie_tests.rs"]
mod tests;
