//! Parity with real engines, from `../shared/golden` (env `LOXI_SHARED` overrides the path):
//! - `hashes`: every vector of `vllm_block_hashes.json` (all seeds, both CBOR algorithms, all
//!   block sizes: NONE_HASH, CBOR input bytes, digest, wire key) and `sglang_page_hashes.json`;
//! - `tokenize`: our token ids equal vLLM's for every captured request of both captures
//!   (completions, token ids, chat, `/v1/responses`, `/tokenize`, `add_special_tokens`), and the
//!   keys hashed from them are the ones the engine published;
//! - `pool`: scenarios 9 (template failure counted per model), 11 (missing tokenizer: one log,
//!   degraded gauge, negative cache) and 12 (BOS).

#[path = "kv_golden/hashes.rs"]
mod hashes;
#[path = "kv_golden/pool.rs"]
mod pool;
#[path = "kv_golden/support.rs"]
mod support;
#[path = "kv_golden/tokenize.rs"]
mod tokenize;
