//! Per-policy results and their Markdown table, `summary.json` and `report.json`.
//!
//! `summary.json` (the README demo's contract, issue 4): a list of objects
//! `{"policy", "prefix_hit_rate" (0..1, engine-side), "ttft_p50_ms", "ttft_p99_ms",
//! "requests_per_worker": [..], "gateway_added_p99_ms"}`, one per policy, plus `"max_over_mean"`
//! when measured, `"requests_per_replica": [..]` with `--replicas N` (N > 1), and
//! `"oracle_ok_hit_rate"` when some requests failed (the oracle over the successful ones). A policy that
//! failed to start has `null` numbers and an `"error"`; nothing is ever estimated. (`main` adds
//! `"workload"` and `"excluded_requests"` to each entry.)
//!
//! The verdict ([`verdicts`]): one line per policy comparing its TTFT p99 with round robin's
//! (`rr`) and its hit rate with the oracle bound, printed under the table.

use super::stats::Quantiles;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// Everything measured for one policy on one workload. Latencies are simulated ms (real ms ÷
/// time scale) except `gateway_added_ms`, which is real ms (the gateway's own CPU time is not
/// scaled), and `ttft_ms`, which adds that real ms to the engine's simulated TTFT.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PolicyResult {
    /// `direct`, `rr`, `chwbl`, `kv`, `kv-<law>`, or a peer's name.
    pub policy: String,
    /// Why the policy produced no numbers (failed install/start); `None` when it ran.
    pub error: Option<String>,
    /// Requests sent.
    pub requests: usize,
    /// Requests that completed with 2xx and a first token.
    pub ok: usize,
    /// Engine-side prefix hit rate: Δhits / Δqueries summed over workers (tokens).
    pub prefix_hit_rate: Option<f64>,
    /// Time to first token, ms: per request the engine's simulated TTFT plus the real latency
    /// added outside the engine (`client::Outcome::projected_ttft_ms`); the client-side figure
    /// when those are unavailable (then a note says so).
    pub ttft_ms: Option<Quantiles>,
    /// Time to first token measured by the client, simulated ms (real ÷ time scale, so the
    /// client's and the gateway's real time is magnified by 1/scale).
    pub client_ttft_ms: Option<Quantiles>,
    /// The engines' own simulated TTFT (`vllm-sim` SSE comment), ms: routing quality without
    /// any real-time cost of the client or the gateway.
    pub engine_ttft_ms: Option<Quantiles>,
    /// End-to-end latency (client side), simulated ms.
    pub e2e_ms: Option<Quantiles>,
    /// Mean inter-token latency per request (client side: first to last token over the gaps
    /// between tokens), simulated ms.
    pub itl_ms: Option<Quantiles>,
    /// Output tokens per simulated second over the run.
    pub output_tokens_per_s: Option<f64>,
    /// Requests served by each worker (Δ of its request counter).
    pub requests_per_worker: Vec<u64>,
    /// `max / mean` of `requests_per_worker`.
    pub max_over_mean: Option<f64>,
    /// Requests the client sent to each gateway replica (`--replicas N`, N > 1); empty for a
    /// single gateway.
    pub requests_per_replica: Vec<u64>,
    /// Ids of the requests that succeeded (the `ok` ones).
    #[serde(skip)]
    pub ok_ids: Vec<usize>,
    /// When some requests failed at run time: the oracle bound over the successful ones only
    /// (the engines' counters do not see the failed ones); `None` when all succeeded.
    pub oracle_ok_hit_rate: Option<f64>,
    /// Client↔engine latency not spent in the engine, real ms (see `client::Outcome::added_ms`).
    pub gateway_added_ms: Option<Quantiles>,
    /// Notes (engagement check, header availability, errors seen).
    pub notes: Vec<String>,
}

impl PolicyResult {
    /// A policy that could not run.
    pub fn failed(policy: &str, error: String) -> Self {
        Self {
            policy: policy.to_string(),
            error: Some(error),
            ..Self::default()
        }
    }

    /// The run's progress line after the policy: `hit 45.3 %, TTFT p50/p90/p99
    /// 97.5/398.7/740.5 ms`, `n/a` for a figure not measured, `failed: <error>` when it did not
    /// run.
    pub fn progress(&self) -> String {
        if let Some(e) = &self.error {
            return format!("failed: {e}");
        }
        let ttft = self.ttft_ms.as_ref().map_or_else(
            || "n/a".to_string(),
            |q| format!("{:.1}/{:.1}/{:.1} ms", q.p50, q.p90, q.p99),
        );
        format!(
            "hit {}, TTFT p50/p90/p99 {ttft}",
            percent(self.prefix_hit_rate)
        )
    }
}

/// A rate as `45.3 %`, `n/a` when not measured.
pub fn percent(rate: Option<f64>) -> String {
    rate.map_or_else(|| "n/a".to_string(), |r| format!("{:.1} %", r * 100.0))
}

/// One `summary.json` entry.
#[derive(Debug, Serialize)]
struct SummaryEntry<'a> {
    policy: &'a str,
    prefix_hit_rate: Option<f64>,
    ttft_p50_ms: Option<f64>,
    ttft_p99_ms: Option<f64>,
    requests_per_worker: &'a [u64],
    #[serde(skip_serializing_if = "Option::is_none")]
    max_over_mean: Option<f64>,
    #[serde(skip_serializing_if = "<[u64]>::is_empty")]
    requests_per_replica: &'a [u64],
    #[serde(skip_serializing_if = "Option::is_none")]
    oracle_ok_hit_rate: Option<f64>,
    gateway_added_p99_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
}

/// The `summary.json` value for `results`.
pub fn summary_json(results: &[PolicyResult]) -> serde_json::Value {
    let entries: Vec<SummaryEntry<'_>> = results
        .iter()
        .map(|r| SummaryEntry {
            policy: &r.policy,
            prefix_hit_rate: r.prefix_hit_rate,
            ttft_p50_ms: r.ttft_ms.map(|q| q.p50),
            ttft_p99_ms: r.ttft_ms.map(|q| q.p99),
            requests_per_worker: &r.requests_per_worker,
            max_over_mean: r.max_over_mean,
            requests_per_replica: &r.requests_per_replica,
            oracle_ok_hit_rate: r.oracle_ok_hit_rate,
            gateway_added_p99_ms: r.gateway_added_ms.map(|q| q.p99),
            error: r.error.as_deref(),
        })
        .collect();
    serde_json::json!(entries)
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}"))
        .unwrap_or_else(|| "–".into())
}

fn pct(v: Option<f64>) -> String {
    v.map(|x| format!("{:.1}%", x * 100.0))
        .unwrap_or_else(|| "–".into())
}

/// The Markdown table for one workload: one row per policy plus the oracle row.
pub fn markdown(workload: &str, results: &[PolicyResult], oracle: Option<f64>) -> String {
    let mut s = format!("### Workload `{workload}`\n\n");
    s.push_str("| policy | prefix hit | TTFT p50 | TTFT p90 | TTFT p99 | engine TTFT p50 | engine TTFT p99 | client TTFT p99 | E2E p50 | E2E p99 | ITL p50 | ITL p99 | out tok/s | req/worker | max/mean | added p50 | added p99 | ok |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|\n");
    for r in results {
        if let Some(e) = &r.error {
            let _ = writeln!(
                s,
                "| {} | failed: {} | | | | | | | | | | | | | | | | |",
                r.policy,
                e.replace('|', "/").replace('\n', " ")
            );
            continue;
        }
        let (t, e2e, add) = (r.ttft_ms, r.e2e_ms, r.gateway_added_ms);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:?} | {} | {} | {} | {}/{} |",
            r.policy,
            pct(r.prefix_hit_rate),
            num(t.map(|q| q.p50), 1),
            num(t.map(|q| q.p90), 1),
            num(t.map(|q| q.p99), 1),
            num(r.engine_ttft_ms.map(|q| q.p50), 1),
            num(r.engine_ttft_ms.map(|q| q.p99), 1),
            num(r.client_ttft_ms.map(|q| q.p99), 1),
            num(e2e.map(|q| q.p50), 1),
            num(e2e.map(|q| q.p99), 1),
            num(r.itl_ms.map(|q| q.p50), 2),
            num(r.itl_ms.map(|q| q.p99), 2),
            num(r.output_tokens_per_s, 0),
            r.requests_per_worker,
            num(r.max_over_mean, 2),
            num(add.map(|q| q.p50), 3),
            num(add.map(|q| q.p99), 3),
            r.ok,
            r.requests,
        );
    }
    if let Some(o) = oracle {
        let _ = writeln!(
            s,
            "| oracle (bound) | {} | | | | | | | | | | | | | | | | |",
            pct(Some(o))
        );
    }
    s.push_str("\nVerdict (TTFT p99 against round robin, engine-side hit rate against the oracle bound):\n\n");
    for v in verdicts(results, oracle) {
        let _ = writeln!(s, "- {v}");
    }
    s.push_str("\nTTFT: per request, the engine's simulated TTFT (queueing + prefill) plus the real ms the path added outside the engine, i.e. what a client of real-speed engines would see (time scaling does not magnify the gateway's real cost). engine TTFT: the workers' simulated TTFT alone, ms. client TTFT, E2E and ITL (mean inter-token latency per request: first to last token over the gaps): measured by the client, real ms ÷ time scale (so the client's and gateway's real time is magnified by 1/scale). added: real ms between the client and the engine outside the engine (`x-sim-*` headers)");
    if results.iter().any(|r| r.policy == "direct") {
        s.push_str("; `direct` is the no-gateway baseline");
    }
    s.push_str(".\n");
    for r in results.iter().filter(|r| !r.notes.is_empty()) {
        let _ = writeln!(s, "- `{}`: {}", r.policy, r.notes.join("; "));
    }
    s
}

/// A ratio as a factor: one decimal below 100 (`3.4×`), none above (`145×`).
fn factor(x: f64) -> String {
    if x < 100.0 {
        format!("{x:.1}×")
    } else {
        format!("{x:.0}×")
    }
}

/// The last `max` characters of `s` (an error's end says what failed), `…`-prefixed when cut.
fn tail(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let cut: String = s.chars().skip(n - max).collect();
    format!("…{}", cut.trim_start())
}

/// One policy's verdict against `baseline` (round robin's row, if it ran) and the oracle bound:
/// `kv: TTFT p99 7.3× lower than rr (104.9 vs 765.2 ms), hit rate 94.7 % (oracle 95.4 %)`.
/// The ratio is `baseline p99 / p99` when lower, `p99 / baseline p99` ("higher") when not;
/// failed policies (with the last 200 characters of their error), missing numbers and failed
/// requests are said as such.
pub fn verdict(r: &PolicyResult, baseline: Option<&PolicyResult>, oracle: Option<f64>) -> String {
    if let Some(err) = &r.error {
        return format!(
            "{}: failed ({})",
            r.policy,
            tail(&err.replace('\n', " "), 200)
        );
    }
    let p99 = r.ttft_ms.map(|q| q.p99);
    let base = baseline.filter(|b| b.policy != r.policy && b.error.is_none());
    let ttft = match (p99, base.and_then(|b| b.ttft_ms.map(|q| q.p99))) {
        (Some(p), Some(b)) if p > 0.0 && b > 0.0 => {
            let name = &base.map(|b| b.policy.as_str()).unwrap_or("rr");
            if p <= b {
                format!(
                    "TTFT p99 {} lower than {name} ({p:.1} vs {b:.1} ms)",
                    factor(b / p)
                )
            } else {
                format!(
                    "TTFT p99 {} higher than {name} ({p:.1} vs {b:.1} ms)",
                    factor(p / b)
                )
            }
        }
        (Some(p), _) if r.policy == "rr" => format!("TTFT p99 {p:.1} ms (the baseline)"),
        (Some(p), _) => format!("TTFT p99 {p:.1} ms (no rr row to compare with)"),
        (None, _) => "no TTFT measured".into(),
    };
    let hit = match r.prefix_hit_rate {
        Some(h) => format!("hit rate {:.1} %", h * 100.0),
        None => "no hit rate measured".into(),
    };
    let bound = oracle
        .map(|o| format!(" (oracle {:.1} %)", o * 100.0))
        .unwrap_or_default();
    let failed = if r.ok < r.requests {
        format!("; {} of {} requests failed", r.requests - r.ok, r.requests)
    } else {
        String::new()
    };
    format!("{}: {ttft}, {hit}{bound}{failed}", r.policy)
}

/// [`verdict`] for every policy, in order, against the `rr` row of `results`.
pub fn verdicts(results: &[PolicyResult], oracle: Option<f64>) -> Vec<String> {
    let rr = results
        .iter()
        .find(|r| r.policy == "rr" && r.error.is_none());
    results.iter().map(|r| verdict(r, rr, oracle)).collect()
}

/// Writes `text` to `dir/name`, naming the file on error.
pub fn write(dir: &Path, name: &str, text: &str) -> Result<(), String> {
    let p = dir.join(name);
    std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_is_human_readable() {
        let r = PolicyResult {
            policy: "rr".into(),
            prefix_hit_rate: Some(0.4526),
            ttft_ms: Some(Quantiles {
                p50: 97.500176,
                p90: 398.70339199999995,
                p99: 740.490256,
            }),
            ..PolicyResult::default()
        };
        assert_eq!(
            r.progress(),
            "hit 45.3 %, TTFT p50/p90/p99 97.5/398.7/740.5 ms"
        );
        let unmeasured = PolicyResult {
            policy: "rr".into(),
            ..PolicyResult::default()
        };
        assert_eq!(unmeasured.progress(), "hit n/a, TTFT p50/p90/p99 n/a");
        assert_eq!(
            PolicyResult::failed("kv", "router did not start".into()).progress(),
            "failed: router did not start"
        );
    }

    #[test]
    fn summary_has_the_contract_fields_and_nulls_for_failures() {
        let ok = PolicyResult {
            policy: "kv".into(),
            prefix_hit_rate: Some(0.8),
            ttft_ms: Some(Quantiles {
                p50: 40.0,
                p90: 60.0,
                p99: 90.0,
            }),
            requests_per_worker: vec![3, 4],
            gateway_added_ms: Some(Quantiles {
                p50: 0.2,
                p90: 0.3,
                p99: 0.5,
            }),
            ..PolicyResult::default()
        };
        let bad = PolicyResult::failed("sglang-router", "pip install failed".into());
        let v = summary_json(&[ok, bad]);
        assert_eq!(
            v[0],
            serde_json::json!({"policy": "kv", "prefix_hit_rate": 0.8, "ttft_p50_ms": 40.0,
                "ttft_p99_ms": 90.0, "requests_per_worker": [3, 4], "gateway_added_p99_ms": 0.5})
        );
        assert_eq!(v[1]["prefix_hit_rate"], serde_json::Value::Null);
        assert_eq!(v[1]["error"], "pip install failed");
    }

    #[test]
    fn markdown_rows_show_percent_and_failures() {
        let r = PolicyResult {
            policy: "rr".into(),
            prefix_hit_rate: Some(0.25),
            requests: 2,
            ok: 2,
            ..PolicyResult::default()
        };
        let f = PolicyResult::failed("vllm-router", "exit 1 | boom".into());
        let md = markdown("shared_prefix", &[r, f], Some(0.9));
        assert!(md.contains("| rr | 25.0% |"), "{md}");
        assert!(
            md.contains("| vllm-router | failed: exit 1 / boom |"),
            "{md}"
        );
        assert!(md.contains("| oracle (bound) | 90.0% |"), "{md}");
    }

    fn row(policy: &str, hit: f64, p99: f64) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            requests: 1200,
            ok: 1200,
            prefix_hit_rate: Some(hit),
            ttft_ms: Some(Quantiles {
                p50: 30.0,
                p90: p99,
                p99,
            }),
            ..PolicyResult::default()
        }
    }

    #[test]
    fn verdicts_compare_p99_with_rr_and_hit_rate_with_the_oracle() {
        let mut slow = row("vllm-router-kv_aware", 0.45, 1530.4);
        slow.ok = 1190;
        let results = [
            row("rr", 0.449, 765.2),
            row("kv", 0.947, 104.9),
            row("chwbl", 0.919, 98.4),
            slow,
            row("kv-big", 0.95, 0.5),
            PolicyResult::failed("sglang-router-cache_aware", "pip\nfailed".into()),
        ];
        let v = verdicts(&results, Some(0.954));
        assert_eq!(
            v[0],
            "rr: TTFT p99 765.2 ms (the baseline), hit rate 44.9 % (oracle 95.4 %)"
        );
        assert_eq!(
            v[1],
            "kv: TTFT p99 7.3× lower than rr (104.9 vs 765.2 ms), hit rate 94.7 % (oracle 95.4 %)"
        );
        assert!(
            v[2].starts_with("chwbl: TTFT p99 7.8× lower than rr"),
            "{}",
            v[2]
        );
        assert_eq!(
            v[3],
            "vllm-router-kv_aware: TTFT p99 2.0× higher than rr (1530.4 vs 765.2 ms), hit rate 45.0 % (oracle 95.4 %); 10 of 1200 requests failed"
        );
        assert!(v[4].contains("1530× lower than rr"), "{}", v[4]);
        assert_eq!(v[5], "sglang-router-cache_aware: failed (pip failed)");
        let long = format!(
            "{} Address already in use (os error 98)",
            "backtrace ".repeat(100)
        );
        let v = verdict(&PolicyResult::failed("p", long), None, None);
        assert!(
            v.starts_with("p: failed (…") && v.ends_with("(os error 98))"),
            "{v}"
        );
        assert!(v.chars().count() < 220, "{v}");
        // Without an rr row (or with rr failed) nothing is compared, and without an oracle no bound.
        let alone = verdicts(&results[1..2], None);
        assert_eq!(
            alone,
            ["kv: TTFT p99 104.9 ms (no rr row to compare with), hit rate 94.7 %"]
        );
        let md = markdown("shared_prefix", &results, Some(0.954));
        assert!(md.contains("\n- kv: TTFT p99 7.3× lower than rr"), "{md}");
    }
}
