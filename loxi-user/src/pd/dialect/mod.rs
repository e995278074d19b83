//! The SGLang and TensorRT-LLM handoff dialects: how the client's body becomes each leg's body
//! and what is read back from a leg's answer. Pure functions over JSON, like the vLLM dialect
//! (`pd/handoff.rs`, which also owns the request id all three put on both legs); the proxy
//! (`proxy/pd_dialects.rs`) sends the legs.

pub mod sglang;
pub mod trtllm;
