//! Endpoint readiness: what the parity report (`GET /netlox/v1/config/ai/kv/parity`,
//! `loxicmd get kvparity`) says of EVERY endpoint of a rule, the gauge
//! `loxilb_kv_endpoint_readiness{service,ep_idx,state}` and a one-line log with the remedy on
//! every change (published once a second by `kv::wiring`).
//!
//! States, first match wins:
//! - `not_subscribed`: tier 1.5 does not follow its events (a decode endpoint of a P/D rule).
//! - `syncing`: one of its ranks connected and is replaying, from the engine's replay socket
//!   (rule or endpoint `kvReplayPort`), what the engine still holds; until that catch-up ends.
//! - `crossed`: the crossed-stream check (`kv::cross`): of the new prompts sent to it alone
//!   (its last 8 outcomes, none landing), at least 3 were published on one other endpoint's
//!   event stream and not on its own (its engine publishes on that endpoint's `kvZmqPort`:
//!   swapped ports, or a rotation; the endpoint named reads `crossed` too, its stream carrying
//!   the other engine's blocks). The remedy names the ports. These endpoints' blocks are not
//!   used for routing until it clears.
//! - `unseen`: the same check: at least 3 of them (none landing, none straying) were published
//!   on no stream of the rule within 30 s while its own stream carried other blocks: its port
//!   is an engine's outside the rule, or its engine already held those prompts before loxi
//!   saw them (an engine publishes a block once: after a loxilb restart without a replay
//!   port); the first new prompt it stores clears it. Its blocks are not used for routing
//!   meanwhile.
//!   Ahead of the states below: its own stream may carry nothing (`no_blocks`) or another
//!   engine's events (`ok`).
//! - `no_events`: no event batch applied from any of its ranks yet and none connected (the
//!   publisher is not reached: the remedy names the port). Connected with no batch yet is
//!   `no_blocks` (below), ahead of the other states.
//! - `mismatch`: the parity check found the engine's hashes differ (with the `leg`: `seed`,
//!   `algorithm`, `block_size`, `unknown`, and the remedy, e.g. "set
//!   LLB_KV_NONE_HASH_SEED=0 to match the engine"); token re-hash is active.
//! - `disconnected`: heard from before (a batch applied), and one of its streams is down now
//!   (the engine or its publisher stopped): its blocks are as last published, new ones are not
//!   seen; the remedy names the sockets. A restarted engine's blocks are cleared when it
//!   reconnects if it has a replay socket (`kvReplayPort`), else at its first event (until
//!   then it reads `ok` with the blocks it held before).
//! - `never_matched`: the zero-hit watchdog: it holds blocks, `LOXI_KV_NEVER_MATCHED_AFTER`
//!   requests with block keys were routed to it, none of its confirmed blocks was ever the
//!   first block of a scored request, and the first block of none of the last 4 requests
//!   routed to it showed up among its blocks afterwards (so a workload without reuse, whose
//!   requests the engine hashes as loxi does, is not flagged): its blocks are unreachable,
//!   another tokenizer, chat template, LoRA path or seed. Counted once per endpoint in
//!   `loxilb_pd_kv_zero_hit_watchdog_total{service}`.
//! - `ok`: events with token ids were checked and agree (or are still being checked without a
//!   disagreement).
//! - `no_blocks`: connected, or events arrive, but loxi's index holds no block of it (an idle
//!   engine, or one that just restarted) and none was checked: parity is checked at its first
//!   stored blocks.
//! - `events_no_tokens`: blocks were stored but no event carried token ids, so parity is
//!   unchecked.
//!

use serde::Serialize;
use tokio::time::Instant;

use super::cross::{PROBE_WINDOW, Verdict as Cross};
use super::ingest::parity::{EpParity, Verdict};
use super::members::{Member, Members};
use super::metrics::{EpStateLabels, READINESS_STATES, ServiceLabels};
use super::state::{KvState, ServiceKv};
use crate::rules::KvEndpoint;

/// One endpoint's readiness.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// One of [`READINESS_STATES`].
    pub state: &'static str,
    /// For `mismatch`: the leg that looks wrong (`seed`, `algorithm`, `block_size`, `unknown`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leg: Option<String>,
    /// What to do about it (absent for `ok`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remedy: Option<String>,
}

/// The readiness of `member` (endpoint `ep` of the rule) with its parity report `p`.
pub fn readiness(
    svc: &ServiceKv,
    members: &Members,
    member: Member,
    ep: &KvEndpoint,
    p: Option<&EpParity>,
    never_matched_after: u64,
) -> Readiness {
    let r = |state, leg, remedy: Option<String>| Readiness { state, leg, remedy };
    let no_blocks = || {
        r(
            "no_blocks",
            None,
            Some("loxi's index holds no block of this engine: it is idle or just restarted, or it cached its blocks before loxi subscribed (an engine publishes a block once; a rule with kvReplayPort catches up from the engine's replay socket). Parity is checked at its next stored blocks (send it a new prompt)".into()),
        )
    };
    if !ep.subscribed {
        return r("not_subscribed", None, None);
    }
    if svc
        .streams
        .lock()
        .iter()
        .any(|((m, _), st)| *m == member && st.syncing)
    {
        return r(
            "syncing",
            None,
            Some("replaying the engine's held blocks from its replay socket; wait".into()),
        );
    }
    let (verdict, carries) = {
        let c = svc.cross.lock();
        (
            c.verdict(member, svc.index.blocks(member) > 0),
            c.carries(member),
        )
    };
    let name = |x: Member| {
        members
            .iter()
            .find(|(_, _, m)| *m == x)
            .map(|(i, e, _)| {
                format!(
                    "endpoint {i} ({}:{}, kvZmqPort {})",
                    e.ip, e.port, e.zmq_port
                )
            })
            .unwrap_or_else(|| "an endpoint that left the rule".into())
    };
    const FIX: &str = "check every endpoint's kvZmqPort against the port its own engine publishes on (two swapped, or a rotation); until then these blocks are not used for routing";
    match verdict {
        Some(Cross::Strays { to, n, of }) => {
            return r(
                "crossed",
                None,
                Some(format!(
                    "the first blocks of {n} of its last {of} new prompts (sent to it alone) were published on the event stream of {}, none on its own (kvZmqPort {}): its engine publishes on that endpoint's port; {FIX}",
                    name(to),
                    ep.zmq_port
                )),
            );
        }
        Some(Cross::Unseen { n, of }) => {
            return r(
                "unseen",
                None,
                Some(format!(
                    "the first blocks of {n} of its last {of} new prompts (sent to it alone) were published on no event stream of the rule within {} s, while its stream (kvZmqPort {}) carries other blocks: either that port is another engine's, one outside the rule (check it against the port its own engine publishes on), or its engine already held those prompts before loxi saw them (engines publish a block once; e.g. after a loxilb restart without kvReplayPort), which the first new prompt it stores clears; until then its blocks are not used for routing",
                    PROBE_WINDOW.as_secs(),
                    ep.zmq_port
                )),
            );
        }
        None => {}
    }
    if let Some((y, Cross::Strays { n, .. })) = carries {
        return r(
            "crossed",
            None,
            Some(format!(
                "its event stream (kvZmqPort {}) carries the first blocks of {n} new prompts sent to {} alone: that endpoint's engine publishes on this endpoint's port; {FIX}",
                ep.zmq_port,
                name(y)
            )),
        );
    }
    let seen = p.is_some()
        || svc
            .streams
            .lock()
            .iter()
            .any(|((m, _), st)| *m == member && st.last_seq.is_some());
    // Connected to a publisher that has sent nothing yet (an idle engine; its replay, if any,
    // answered with no batch): the engine holds no block, as after a restart.
    if !seen && svc.heard(member) {
        return no_blocks();
    }
    if !seen {
        return r(
            "no_events",
            None,
            Some(format!(
                "no KV event received: start the engine with a ZMQ publisher bound to tcp://*:{} (kvZmqPort{})",
                ep.zmq_port,
                if svc.config.dp_ranks > 1 {
                    " + DP rank"
                } else {
                    ""
                }
            )),
        );
    }
    if let Some(p) = p.filter(|p| p.verdict == Verdict::Mismatch) {
        let diag = p.diagnosis.clone().unwrap_or_default();
        let leg = diag.split(':').next().unwrap_or("unknown").to_owned();
        return r(
            "mismatch",
            Some(leg),
            Some(remedy_of(&diag, svc.hasher.seed_set())),
        );
    }
    if let Some(p) = p.filter(|p| p.only_block_size_rejects()) {
        let remedy = match p.engine_block_size.filter(|b| *b > 0) {
            Some(b) => format!(
                "the engine publishes {b}-token blocks: set kvBlockSize {b} (or the engine's \
                 --block-size {}) to match the engine",
                svc.config.block_size
            ),
            // A block size no engine runs with (0): the publisher is broken, not mistuned.
            None => format!(
                "the engine publishes events with block_size 0, which no vLLM engine runs with: \
                 check what publishes on this endpoint's event port (kvBlockSize is {})",
                svc.config.block_size
            ),
        };
        return r("mismatch", Some("block_size".into()), Some(remedy));
    }
    // Heard from before, and a stream of it is down now (a stopped engine or publisher): its
    // blocks are as last published.
    let mut down: Vec<u32> = svc
        .streams
        .lock()
        .iter()
        .filter(|((m, _), st)| *m == member && !st.connected)
        .map(|((_, rank), _)| *rank)
        .collect();
    if !down.is_empty() {
        down.sort_unstable();
        let socks: Vec<String> = down
            .iter()
            .map(|rank| format!("tcp://{}:{}", ep.ip, u32::from(ep.zmq_port) + rank))
            .collect();
        return r(
            "disconnected",
            None,
            Some(format!(
                "its event stream {} is down (engine or publisher stopped?): its {} blocks are as last published and new ones are not seen until it reconnects (a restarted engine's are cleared at once on reconnect with a kvReplayPort, else at its first event)",
                socks.join(", "),
                svc.index.blocks(member)
            )),
        );
    }
    let w = {
        let mut watch = svc.watch.lock();
        let w = watch.entry(member).or_default();
        // A request loxi routed here whose first block the engine then published under
        // loxi's key: tokenizer, template and hashing agree, whatever the reuse.
        if !w.matched
            && w.probes
                .iter()
                .flatten()
                .any(|k| svc.index.holds_key(member, *k))
        {
            w.matched = true;
        }
        *w
    };
    if !w.matched && w.routed_holding >= never_matched_after && svc.index.blocks(member) > 0 {
        return r(
            "never_matched",
            None,
            Some(format!(
                "none of its {} blocks matched a request in {} routed to it: compare the engine's model, tokenizer, chat template and LoRA paths with loxi's (LLB_KV_HASH_DEBUG=1 logs loxi's keys)",
                svc.index.blocks(member),
                w.routed_holding
            )),
        );
    }
    if p.is_some_and(|p| p.checked_blocks > 0 || p.unverified_blocks > 0) {
        return r("ok", None, None);
    }
    if svc.index.blocks(member) == 0 {
        return no_blocks();
    }
    r(
        "events_no_tokens",
        None,
        Some("events carry no token ids: the parity check cannot run; use an engine that publishes token_ids (vLLM 0.32 does)".into()),
    )
}

/// The remedy for a parity diagnosis (`parity::diagnose`'s text).
pub fn remedy_of(diagnosis: &str, seed_set: bool) -> String {
    let seed = diagnosis
        .split_once("with seed \"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .map(|(s, _)| s);
    let seed_fix = |s: &str| {
        if s == super::block_hash::VLLM_UNSET_SEED {
            if seed_set {
                "unset LLB_KV_NONE_HASH_SEED".to_owned()
            } else {
                "keep LLB_KV_NONE_HASH_SEED unset".to_owned()
            }
        } else {
            format!("set LLB_KV_NONE_HASH_SEED={s}")
        }
    };
    match (diagnosis.split(':').next(), seed) {
        (Some("seed"), Some(s)) => format!("{} to match the engine", seed_fix(s)),
        (Some("algorithm"), Some(s)) if s != super::block_hash::VLLM_UNSET_SEED => {
            let algo = diagnosis
                .split_once("engine matches ")
                .and_then(|(_, r)| r.split_whitespace().next())
                .unwrap_or("the engine's algorithm");
            format!("set kvHashAlgo {algo} and LLB_KV_NONE_HASH_SEED={s} to match the engine")
        }
        (Some("algorithm"), Some(s)) => {
            let algo = diagnosis
                .split_once("engine matches ")
                .and_then(|(_, r)| r.split_whitespace().next())
                .unwrap_or("the engine's algorithm");
            format!("set kvHashAlgo {algo} and {} to match the engine", seed_fix(s))
        }
        (Some("block_size"), _) => {
            "set kvBlockSize to the engine's --block-size to match the engine".into()
        }
        _ => "compare the engine's tokenizer, chat template and PYTHONHASHSEED with loxi's (LLB_KV_HASH_DEBUG=1 logs loxi's keys)".into(),
    }
}

/// Sets every endpoint's readiness gauge, counts newly flagged `never_matched` endpoints and
/// logs each change of state once, with its remedy.
pub fn publish(state: &KvState) {
    let after = state.settings.never_matched_after;
    for svc in state.all() {
        if svc.is_retired() {
            continue;
        }
        let members = svc.members.read();
        let ids: Vec<Member> = members.iter().map(|(_, _, m)| m).collect();
        let (suspects, tally) = {
            let mut c = svc.cross.lock();
            c.resolve(&ids, Instant::now());
            (c.suspects(|m| svc.index.blocks(m) > 0), c.take_tally())
        };
        for (pos, _, member) in members.iter() {
            if let Some(counts) = tally.get(&member) {
                state.metrics.cross_probes(&svc.label, pos, *counts);
            }
        }
        if *svc.crossed.read() != suspects {
            *svc.crossed.write() = suspects;
        }
        for (pos, ep, member) in members.iter() {
            let p = svc.parity.lock().get(member).cloned();
            let now = readiness(&svc, &members, member, ep, p.as_ref(), after);
            for s in READINESS_STATES {
                state
                    .metrics
                    .readiness
                    .get_or_create(&EpStateLabels {
                        service: svc.label.clone(),
                        ep_idx: pos.to_string(),
                        state: (*s).into(),
                    })
                    .set(i64::from(*s == now.state));
            }
            let mut w = svc.watch.lock();
            let e = w.entry(member).or_default();
            if now.state == "never_matched" && !e.flagged {
                e.flagged = true;
                state
                    .metrics
                    .zero_hit_watchdog
                    .get_or_create(&ServiceLabels {
                        service: svc.label.clone(),
                    })
                    .inc();
            }
            if e.reported != Some(now.state) {
                e.reported = Some(now.state);
                let remedy = now.remedy.as_deref().unwrap_or("");
                match now.state {
                    "mismatch" | "never_matched" | "crossed" | "unseen" => {
                        tracing::warn!(service = svc.id, ep_idx = pos, endpoint = %ep.ip, port = ep.port, kv_zmq_port = ep.zmq_port, state = now.state, leg = now.leg.as_deref().unwrap_or(""), remedy, "kv endpoint readiness")
                    }
                    _ => {
                        tracing::info!(service = svc.id, ep_idx = pos, endpoint = %ep.ip, port = ep.port, kv_zmq_port = ep.zmq_port, state = now.state, remedy, "kv endpoint readiness")
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "readiness_tests.rs"]
mod tests;
