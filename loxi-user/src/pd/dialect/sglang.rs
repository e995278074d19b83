//! SGLang's P/D handoff (`kvEngineType: sglang`): both legs get the same body, the client's own
//! plus `bootstrap_host`, `bootstrap_port` and `bootstrap_room`, and are sent at once; the
//! decode engine pulls the KV cache from the prefill engine's bootstrap server
//! (`host:port`), matching the two requests by `room`. The client gets the decode's answer.
//!
//! Checked against SGLang's own balancers:
//! - `python/sglang/srt/disaggregation/mini_lb.py` (sgl-project/sglang@001c2ae0,
//!   `_forward_to_backend` for `/v1/completions` and `/v1/chat/completions`): the request is
//!   copied and updated with `bootstrap_host` (the prefill URL's hostname, IPv6 wrapped in
//!   brackets by `maybe_wrap_ipv6_address`), `bootstrap_port` (the prefill's configured
//!   bootstrap port) and `bootstrap_room` (`random.randint(0, 2**63 - 1)`); the same body is
//!   posted to the prefill and the decode server concurrently (`asyncio.gather`) and the
//!   decode's response (status and body, streamed when `stream`) is returned;
//! - `sgl-router/src/routers/http/pd_router.rs` and `pd_types.rs` (sgl-project/sglang@0105f2a3,
//!   `inject_bootstrap_into_value`, `execute_dual_dispatch_internal`, `generate_room_id`):
//!   the same three fields (room `rand::random::<u64>() & i64::MAX`, port `null` when the
//!   worker has none), both requests sent concurrently, a prefill that fails or answers non-2xx
//!   is an error for the client (its status and message), the decode's answer otherwise.
//!
//! (The router strips IPv6 brackets from `bootstrap_host` where `mini_lb.py` adds them; loxi
//! follows `mini_lb.py`. Both send arrays of the three fields for batched `/generate`
//! requests only; an OpenAI request gets the scalar form.)

use serde_json::{Map, Value, json};

/// The three bootstrap fields of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// The prefill endpoint's IP (IPv6 bracketed, as `mini_lb.py` sends it).
    pub host: String,
    /// The prefill engine's bootstrap port (`pdBootstrapPort`, default 8998).
    pub port: u16,
    /// The room both legs share: a random integer in `0..2^63`.
    pub room: u64,
}

impl Bootstrap {
    /// The fields for a prefill endpoint at `ip` (an IP literal) with a fresh random room.
    pub fn new(ip: &str, port: u16) -> Self {
        let host = if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_string()
        };
        Self {
            host,
            port,
            room: room(),
        }
    }
}

/// A random bootstrap room in `0..2^63` (`random.randint(0, 2**63 - 1)`).
pub fn room() -> u64 {
    rand::random::<u64>() >> 1
}

/// The body of both legs: the client's, plus the bootstrap fields.
pub fn leg_body(client: &Map<String, Value>, b: &Bootstrap) -> Map<String, Value> {
    let mut body = client.clone();
    body.insert("bootstrap_host".into(), json!(b.host));
    body.insert("bootstrap_port".into(), json!(b.port));
    body.insert("bootstrap_room".into(), json!(b.room));
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_legs_get_the_clients_body_plus_the_three_fields() {
        let client = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "stream": true, "max_tokens": 7});
        let b = Bootstrap {
            host: "10.0.0.5".into(),
            port: 8998,
            room: (1 << 63) - 1,
        };
        let body = leg_body(client.as_object().expect("object"), &b);
        let mut want = client.clone();
        want["bootstrap_host"] = json!("10.0.0.5");
        want["bootstrap_port"] = json!(8998);
        want["bootstrap_room"] = json!(9_223_372_036_854_775_807_u64);
        assert_eq!(Value::Object(body), want);
    }

    #[test]
    fn rooms_are_63_bit_and_differ_and_ipv6_hosts_are_bracketed() {
        let rooms: Vec<u64> = (0..256).map(|_| room()).collect();
        assert!(rooms.iter().all(|r| *r < 1 << 63));
        assert!(
            rooms.iter().any(|r| *r >= 1 << 62),
            "the high bit range is used"
        );
        let mut uniq = rooms.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), rooms.len());
        assert_eq!(Bootstrap::new("fd00::7", 9000).host, "[fd00::7]");
        assert_eq!(Bootstrap::new("10.1.2.3", 9000).host, "10.1.2.3");
    }
}
