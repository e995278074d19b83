//! KV-routed requests per loxilb core (issue 17 §2): the pieces of `bench-gateway`.
//!
//! A closed-loop load of many distinct prompts goes through one `loxilb` pinned to one CPU
//! (`taskset`, one tokio worker, one tokenization thread) in front of fast `vllm-sim` engines,
//! at increasing concurrency. Per level it measures the requests/s the client got, the
//! gateway's added latency (client ↔ engine, from the engines' `x-sim-*` headers), the CPU the
//! daemon spent (every thread's `/proc/<pid>/task/*/schedstat` run time, ns) and the KV tier's
//! per-stage time (`loxilb_kv_routing_stage_seconds{stage}` deltas). CPU per request is the
//! per-core capacity that does not depend on the client keeping the core busy:
//! `1000 / cpu_ms_per_request` requests per CPU-second.
//!
//! - [`Mix`], [`PromptGen`]: the two request mixes of the issue.
//! - [`cpu_ns`]: a process's CPU time. [`StageTimes`]: the KV stage histogram sums and counts.
//! - [`Level`], [`best_under`], [`markdown`]: per-level results and the report.

use crate::stats::percentile;
use crate::workload::{ChatMessage, Payload, Vocab};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::collections::BTreeMap;
use std::path::Path;

/// Dynamo's published frontend cost: 6.5–6.8 ms of CPU per request (HTTP + tokenize + route +
/// stream), about 150 requests/s per core; the anchor of issue 17 §2.
pub const DYNAMO_REQ_PER_CORE: f64 = 150.0;

/// The request mixes of issue 17 §2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// `/v1/chat/completions`: one of 8 system prompts of 2,048 tokens + a distinct 128-token
    /// user question (the gateway renders the chat template).
    Chat,
    /// `/v1/completions`: fully distinct 1,024-token prompts.
    Distinct,
}

impl Mix {
    /// `chat` or `distinct`. Errors name the bad value.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "chat" => Ok(Mix::Chat),
            "distinct" => Ok(Mix::Distinct),
            other => Err(format!("unknown mix {other:?} (chat or distinct)")),
        }
    }

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mix::Chat => "chat",
            Mix::Distinct => "distinct",
        }
    }

    /// The target, as a multiple of [`DYNAMO_REQ_PER_CORE`]: 10× for the chat mix,
    /// 3× for distinct prompts.
    pub fn target_ratio(self) -> f64 {
        match self {
            Mix::Chat => 10.0,
            Mix::Distinct => 3.0,
        }
    }
}

/// Number of system prompts of the chat mix.
pub const CHAT_SYSTEMS: usize = 8;
/// System-prompt length of the chat mix, tokens.
pub const CHAT_SYSTEM_TOKENS: usize = 2048;
/// Question length of the chat mix, tokens.
pub const CHAT_QUESTION_TOKENS: usize = 128;
/// Prompt length of the distinct mix, tokens.
pub const DISTINCT_TOKENS: usize = 1024;

/// An endless, seeded source of never-repeated prompts of one [`Mix`].
pub struct PromptGen {
    vocab: Vocab,
    mix: Mix,
    systems: Vec<String>,
    rng: StdRng,
    next: usize,
}

impl PromptGen {
    /// A generator over `vocab` (single-token words, so lengths are exact in tokens).
    pub fn new(vocab: Vocab, mix: Mix, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let systems = match mix {
            Mix::Chat => (0..CHAT_SYSTEMS)
                .map(|_| vocab.text(&mut rng, CHAT_SYSTEM_TOKENS))
                .collect(),
            Mix::Distinct => Vec::new(),
        };
        Self {
            vocab,
            mix,
            systems,
            rng,
            next: 0,
        }
    }

    /// The next request payload: chat requests cycle through the system prompts, each with a
    /// fresh question; completion prompts are fresh throughout.
    pub fn next_payload(&mut self) -> Payload {
        let i = self.next;
        self.next += 1;
        match self.mix {
            Mix::Chat => Payload::Chat(vec![
                ChatMessage::new("system", self.systems[i % CHAT_SYSTEMS].trim_start()),
                ChatMessage::new(
                    "user",
                    self.vocab
                        .text(&mut self.rng, CHAT_QUESTION_TOKENS)
                        .trim_start(),
                ),
            ]),
            Mix::Distinct => Payload::Completion(self.vocab.text(&mut self.rng, DISTINCT_TOKENS)),
        }
    }
}

/// CPU time of every thread of process `pid`, ns: the sum of the first field of
/// `/proc/<pid>/task/<tid>/schedstat` (time spent on a CPU). Threads that exited are not
/// counted, so take deltas over intervals in which the daemon's fixed threads live.
/// Errors: `/proc/<pid>/task` unreadable (process gone, or not Linux).
pub fn cpu_ns(pid: u32) -> Result<u64, String> {
    let dir = format!("/proc/{pid}/task");
    let tasks = std::fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))?;
    let mut total = 0u64;
    for t in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        total += parse_schedstat(&text).unwrap_or(0);
    }
    Ok(total)
}

/// The run time (ns) in a `schedstat` line `"<run ns> <wait ns> <slices>"`.
pub fn parse_schedstat(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// Sums (seconds) and counts of `loxilb_kv_routing_stage_seconds` per stage label
/// (`Tokenize`: chat template + tokenizer, `Hash`, `Score`), from one metrics scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageTimes {
    /// stage → Σ seconds.
    pub sum: BTreeMap<String, f64>,
    /// stage → observations.
    pub count: BTreeMap<String, f64>,
}

impl StageTimes {
    /// Reads the histogram's `_sum` and `_count` series from Prometheus text.
    pub fn parse(metrics: &str) -> Self {
        Self {
            sum: crate::scrape::by_label(metrics, "loxilb_kv_routing_stage_seconds_sum", "stage"),
            count: crate::scrape::by_label(
                metrics,
                "loxilb_kv_routing_stage_seconds_count",
                "stage",
            ),
        }
    }

    /// `self − earlier`, per stage.
    pub fn since(&self, earlier: &StageTimes) -> StageTimes {
        let diff = |now: &BTreeMap<String, f64>, then: &BTreeMap<String, f64>| {
            now.iter()
                .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or(0.0)))
                .collect()
        };
        StageTimes {
            sum: diff(&self.sum, &earlier.sum),
            count: diff(&self.count, &earlier.count),
        }
    }
}

/// One concurrency level's result.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Level {
    /// Requests in flight at once (closed loop).
    pub concurrency: usize,
    /// Completed 2xx requests in the measured window.
    pub ok: u64,
    /// Failed requests (non-2xx, transport errors, timeouts).
    pub failed: u64,
    /// Measured window, s.
    pub secs: f64,
    /// `ok / secs`.
    pub req_per_s: f64,
    /// The daemon's CPU over the window, CPU-seconds per wall second (1.0 = one core busy).
    pub cpu_util: f64,
    /// Daemon CPU per completed request, ms.
    pub cpu_ms_per_req: f64,
    /// `1000 / cpu_ms_per_req`: requests one loxilb core serves per CPU-second.
    pub req_per_core: f64,
    /// Added latency p50 / p99, ms (client ↔ engine, outside the engine).
    pub added_p50_ms: f64,
    /// See `added_p50_ms`.
    pub added_p99_ms: f64,
    /// KV decisions in the window (`Tokenize` observations): equals `ok` when every request
    /// was tokenized and scored, lower when requests skipped the KV tier (budget, overload).
    pub kv_decisions: f64,
    /// Mean time per request in each KV stage, ms (stage → ms; wall time inside the stage).
    pub stage_ms: BTreeMap<String, f64>,
}

impl Level {
    /// Builds a level from raw counters. `added` are per-request added latencies (ms);
    /// `cpu_ns` the daemon's CPU delta; `stages` the stage deltas.
    pub fn from_parts(
        concurrency: usize,
        ok: u64,
        failed: u64,
        secs: f64,
        cpu_ns: u64,
        added: &[f64],
        stages: &StageTimes,
    ) -> Self {
        let cpu_s = cpu_ns as f64 / 1e9;
        let cpu_ms_per_req = if ok > 0 { cpu_s * 1e3 / ok as f64 } else { 0.0 };
        let stage_ms = stages
            .sum
            .iter()
            .map(|(k, s)| {
                let per = if ok > 0 { s * 1e3 / ok as f64 } else { 0.0 };
                (k.clone(), per)
            })
            .collect();
        Level {
            concurrency,
            ok,
            failed,
            secs,
            req_per_s: if secs > 0.0 { ok as f64 / secs } else { 0.0 },
            cpu_util: if secs > 0.0 { cpu_s / secs } else { 0.0 },
            cpu_ms_per_req,
            req_per_core: if cpu_ms_per_req > 0.0 {
                1e3 / cpu_ms_per_req
            } else {
                0.0
            },
            added_p50_ms: percentile(added, 50.0).unwrap_or(f64::NAN),
            added_p99_ms: percentile(added, 99.0).unwrap_or(f64::NAN),
            kv_decisions: stages.count.get("Tokenize").copied().unwrap_or(0.0),
            stage_ms,
        }
    }

    /// Daemon CPU per request outside the KV stages (HTTP parse, body, proxying, streaming), ms.
    /// Approximate: stage times are wall time, which on a pinned, saturated core includes
    /// waiting for the other threads.
    pub fn rest_ms(&self) -> f64 {
        (self.cpu_ms_per_req - self.stage_ms.values().sum::<f64>()).max(0.0)
    }
}

/// The highest-throughput level whose added p99 is within `p99_ms`, had no failures and
/// tokenized every request (so the figure is KV routing, not a fallback). The KV decisions
/// come from metrics scraped at the window's edges and `ok` from the client, so the two may
/// differ by the requests in flight at either edge: up to `2 × concurrency`.
pub fn best_under(levels: &[Level], p99_ms: f64) -> Option<&Level> {
    levels
        .iter()
        .filter(|l| l.failed == 0 && l.ok > 0 && l.added_p99_ms <= p99_ms)
        .filter(|l| l.kv_decisions + 2.0 * l.concurrency as f64 >= l.ok as f64)
        .max_by(|a, b| a.req_per_s.total_cmp(&b.req_per_s))
}

/// The Markdown report of one mix.
pub fn markdown(mix: Mix, levels: &[Level], p99_ms: f64) -> String {
    let mut s = format!(
        "\n### {} mix\n\n| concurrency | req/s | loxilb CPU (cores) | CPU ms/req | req per core-second | added p50 / p99 ms | KV decisions / ok | tokenize / hash / score / rest ms per req | failed |\n|---|---|---|---|---|---|---|---|---|\n",
        mix.name()
    );
    for l in levels {
        let st = |k: &str| l.stage_ms.get(k).copied().unwrap_or(0.0);
        s.push_str(&format!(
            "| {} | {:.0} | {:.2} | {:.3} | {:.0} | {:.2} / {:.2} | {:.0} / {} | {:.3} / {:.3} / {:.3} / {:.3} | {} |\n",
            l.concurrency,
            l.req_per_s,
            l.cpu_util,
            l.cpu_ms_per_req,
            l.req_per_core,
            l.added_p50_ms,
            l.added_p99_ms,
            l.kv_decisions,
            l.ok,
            st("Tokenize"),
            st("Hash"),
            st("Score"),
            l.rest_ms(),
            l.failed
        ));
    }
    match best_under(levels, p99_ms) {
        Some(b) => {
            s.push_str(&format!(
                "\nAt added p99 ≤ {p99_ms} ms: {:.0} req/s at concurrency {} with loxilb at {:.2} cores → {:.0} req per loxilb core-second (CPU {:.3} ms/req): {:.1}× Dynamo's {DYNAMO_REQ_PER_CORE:.0} req/s/core (target {}×).\n",
                b.req_per_s,
                b.concurrency,
                b.cpu_util,
                b.req_per_core,
                b.cpu_ms_per_req,
                b.req_per_core / DYNAMO_REQ_PER_CORE,
                mix.target_ratio()
            ));
        }
        None => s.push_str(&format!(
            "\nNo level kept added p99 ≤ {p99_ms} ms with every request KV-routed and none failed.\n"
        )),
    }
    s
}

/// Writes `text` to `dir/name`, creating `dir`. Errors name the path.
pub fn write(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let p = dir.join(name);
    std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> Vocab {
        let path = crate::shared_dir().join("golden/tiny-model/tokenizer.json");
        Vocab::from_tokenizer_json(&path).expect("tiny model vocab")
    }

    #[test]
    fn chat_prompts_share_eight_systems_and_never_repeat_a_question() {
        let mut g = PromptGen::new(vocab(), Mix::Chat, 7);
        let mut systems = std::collections::HashSet::new();
        let mut questions = std::collections::HashSet::new();
        for _ in 0..32 {
            let Payload::Chat(m) = g.next_payload() else {
                panic!("chat mix sends chat requests")
            };
            assert_eq!(m.len(), 2);
            assert_eq!(m[0].content.split(' ').count(), CHAT_SYSTEM_TOKENS);
            assert_eq!(m[1].content.split(' ').count(), CHAT_QUESTION_TOKENS);
            systems.insert(m[0].content.clone());
            questions.insert(m[1].content.clone());
        }
        assert_eq!(systems.len(), CHAT_SYSTEMS);
        assert_eq!(questions.len(), 32);
    }

    #[test]
    fn distinct_prompts_have_1024_tokens_of_the_real_tokenizer() {
        let tok = tokenizers::Tokenizer::from_file(
            crate::shared_dir().join("golden/tiny-model/tokenizer.json"),
        )
        .expect("tokenizer");
        let mut g = PromptGen::new(vocab(), Mix::Distinct, 3);
        let (Payload::Completion(a), Payload::Completion(b)) = (g.next_payload(), g.next_payload())
        else {
            panic!("distinct mix sends completions")
        };
        assert_ne!(a, b);
        let n = tok.encode_fast(a.as_str(), false).expect("encode").len();
        assert_eq!(n, DISTINCT_TOKENS);
    }

    #[test]
    fn a_busy_process_cpu_time_is_read_from_its_tasks() {
        // A child of its own (the test binary's other threads come and go, and a thread that
        // exits takes its run time out of the sum): it burns 60 ms of CPU by its own clock,
        // says so, and waits until stdin closes.
        use std::io::{BufRead, BufReader};
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import sys, time\n\
                 t = time.process_time()\n\
                 while time.process_time() - t < 0.06: pass\n\
                 print('done', flush=True)\n\
                 sys.stdin.read()",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read");
        assert_eq!(line.trim(), "done");
        let spent = cpu_ns(child.id()).expect("child's schedstat");
        drop(child.stdin.take());
        let _ = child.wait();
        assert!(
            spent >= 60_000_000,
            "a process that burnt 60 ms of CPU by its own clock showed {spent} ns"
        );
        assert_eq!(parse_schedstat("123 456 7\n"), Some(123));
        assert!(cpu_ns(u32::MAX).is_err());
    }

    #[test]
    fn stage_deltas_and_levels_follow_the_counters() {
        let before = StageTimes::parse(
            "loxilb_kv_routing_stage_seconds_sum{stage=\"Tokenize\"} 1.0\n\
             loxilb_kv_routing_stage_seconds_count{stage=\"Tokenize\"} 10\n\
             loxilb_kv_routing_stage_seconds_sum{stage=\"Hash\"} 0.1\n",
        );
        let after = StageTimes::parse(
            "loxilb_kv_routing_stage_seconds_sum{stage=\"Tokenize\"} 1.5\n\
             loxilb_kv_routing_stage_seconds_count{stage=\"Tokenize\"} 1010\n\
             loxilb_kv_routing_stage_seconds_sum{stage=\"Hash\"} 0.2\n",
        );
        let d = after.since(&before);
        // 1,000 requests in 2 s with 1.2 CPU-seconds: 1.2 ms each, 833 per core-second.
        let added: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Level::from_parts(4, 1000, 0, 2.0, 1_200_000_000, &added, &d);
        assert_eq!(l.req_per_s, 500.0);
        assert!((l.cpu_util - 0.6).abs() < 1e-9);
        assert!((l.cpu_ms_per_req - 1.2).abs() < 1e-9);
        assert!((l.req_per_core - 1000.0 / 1.2).abs() < 1e-6);
        assert!((l.stage_ms["Tokenize"] - 0.5).abs() < 1e-9);
        assert!((l.stage_ms["Hash"] - 0.1).abs() < 1e-9);
        assert!((l.rest_ms() - 0.6).abs() < 1e-9);
        assert_eq!(l.kv_decisions, 1000.0);
        assert_eq!(l.added_p99_ms, 99.0);

        let mut slow = l.clone();
        slow.concurrency = 8;
        slow.req_per_s = 900.0;
        slow.added_p99_ms = 40.0;
        let mut skipped = l.clone();
        skipped.concurrency = 16;
        skipped.req_per_s = 990.0;
        skipped.kv_decisions = 10.0;
        let levels = [l.clone(), slow, skipped];
        assert_eq!(best_under(&levels, 100.0).map(|b| b.concurrency), Some(8));
        assert_eq!(best_under(&levels, 20.0), None);
        assert_eq!(
            best_under(&levels[..1], 100.0).map(|b| b.concurrency),
            Some(4)
        );
        assert!(markdown(Mix::Chat, &levels, 100.0).contains("concurrency 8"));
    }
}
