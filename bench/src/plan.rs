//! The benchmark plan: one fleet, then for each workload and policy: reset the caches, start the
//! policy's router, replay the workload, read the counters, stop the router.

use super::client::{HttpClient, Outcome, http_client};
use super::fleet::{Fleet, FleetSpec};
use super::gateway::{Gateway, GatewaySpec, RuleKind};
use super::procs::Proc;
use super::report::PolicyResult;
use super::runner::{RunLimits, Target, run};
use super::{oracle, peers, scrape, stats};
use crate::workload::Workload;
use std::path::PathBuf;
use std::time::Duration;

/// Everything a benchmark run needs.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Output directory.
    pub out: PathBuf,
    /// The workers.
    pub fleet: FleetSpec,
    /// The gateway under test.
    pub gateway: GatewaySpec,
    /// Policies in order: `direct`, `rr`, `chwbl`, `kv`, `kv-<law>`, `pd`, `pd-kv`, `pd-trie`, or a name of [`peers::PEERS`].
    pub policies: Vec<String>,
    /// Virtualenv for the peers (installed on first use).
    pub venv: PathBuf,
    /// Per-request timeout (real).
    pub request_timeout: Duration,
    /// Closed-loop concurrency of the replay (0 = open loop), see [`RunLimits::concurrency`].
    pub concurrency: usize,
}

/// Results of one workload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkloadResult {
    /// Workload name.
    pub workload: String,
    /// Requests in the workload.
    pub requests: usize,
    /// Oracle bound (0..1), `None` if the prompts could not be tokenized.
    pub oracle_hit_rate: Option<f64>,
    /// One entry per policy, in plan order.
    pub results: Vec<PolicyResult>,
}

/// A started router for one policy.
enum Router {
    Direct,
    Loxi(Gateway),
    Peer(Proc, String),
}

impl Router {
    fn target(&self, fleet: &Fleet) -> Target {
        match self {
            Router::Direct => Target::Direct(fleet.urls()),
            Router::Loxi(g) => Target::Gateway(g.vip.clone()),
            Router::Peer(_, url) => Target::Gateway(url.clone()),
        }
    }

    async fn stop(self) {
        match self {
            Router::Direct => {}
            Router::Loxi(g) => g.proc.stop().await,
            Router::Peer(p, _) => p.stop().await,
        }
    }
}

/// Runs `workloads` through every policy of `plan`, logging progress to stderr.
pub async fn execute(plan: &Plan, workloads: &[Workload]) -> Result<Vec<WorkloadResult>, String> {
    let client = http_client();
    let logs = plan.out.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let fleet = Fleet::start(&plan.fleet, &client, &logs).await?;
    eprintln!(
        "[bench] {} {} workers on {:?} port {}",
        fleet.hosts.len(),
        if plan.fleet.real_vllm.is_some() {
            "real vLLM"
        } else {
            "vllm-sim"
        },
        fleet.hosts,
        fleet.port
    );
    let mut all = Vec::new();
    for w in workloads {
        all.push(one_workload(plan, &fleet, &client, w).await?);
    }
    for p in fleet.procs {
        p.stop().await;
    }
    Ok(all)
}

async fn one_workload(
    plan: &Plan,
    fleet: &Fleet,
    client: &HttpClient,
    w: &Workload,
) -> Result<WorkloadResult, String> {
    let dir = plan.out.join(&w.name);
    std::fs::create_dir_all(dir.join("metrics")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let oracle_hit_rate = match oracle_for(plan, fleet, client, w).await {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!("[bench] oracle unavailable: {e}");
            None
        }
    };
    eprintln!(
        "[bench] workload {}: {} requests over {:.1}s simulated; oracle {:?}",
        w.name,
        w.requests.len(),
        w.span().as_secs_f64(),
        oracle_hit_rate
    );
    let mut results = Vec::new();
    for policy in &plan.policies {
        eprintln!("[bench] {} / {policy} ...", w.name);
        let r = match one_policy(plan, fleet, client, w, policy).await {
            Ok(r) => r,
            Err(e) => PolicyResult::failed(policy, e),
        };
        eprintln!(
            "[bench] {} / {policy}: hit {:?} ttft {:?} err {:?}",
            w.name, r.prefix_hit_rate, r.ttft_ms, r.error
        );
        results.push(r);
    }
    Ok(WorkloadResult {
        workload: w.name.clone(),
        requests: w.requests.len(),
        oracle_hit_rate,
        results,
    })
}

async fn start_router(
    plan: &Plan,
    fleet: &Fleet,
    client: &HttpClient,
    policy: &str,
) -> Result<Router, String> {
    let logs = plan.out.join("logs");
    let kind = match policy {
        "direct" => return Ok(Router::Direct),
        "rr" => RuleKind::RoundRobin,
        "chwbl" => RuleKind::Chwbl,
        "kv" => RuleKind::Kv(None),
        "pd" => RuleKind::Pd(false),
        "pd-kv" => RuleKind::Pd(true),
        "pd-trie" => RuleKind::PdTrie,
        p if p.starts_with("kv-") => RuleKind::Kv(Some(p["kv-".len()..].to_string())),
        p if peers::PEERS.contains(&p) => {
            let bin = peers::ensure_venv(&plan.venv).await?;
            let peer = peers::start(
                p,
                &bin,
                fleet,
                &plan.fleet.model,
                plan.fleet.block_size,
                &logs,
            )
            .await?;
            return Ok(Router::Peer(peer.proc, peer.url));
        }
        p => return Err(format!("unknown policy {p:?}")),
    };
    Ok(Router::Loxi(
        Gateway::start(&plan.gateway, &kind, fleet, client, &logs).await?,
    ))
}

async fn one_policy(
    plan: &Plan,
    fleet: &Fleet,
    client: &HttpClient,
    w: &Workload,
    policy: &str,
) -> Result<PolicyResult, String> {
    let router = start_router(plan, fleet, client, policy).await?;
    let target = router.target(fleet);
    let res = measure(plan, fleet, client, w, policy, &target, &router).await;
    router.stop().await;
    res
}

async fn measure(
    plan: &Plan,
    fleet: &Fleet,
    client: &HttpClient,
    w: &Workload,
    policy: &str,
    target: &Target,
    router: &Router,
) -> Result<PolicyResult, String> {
    warm_up(client, target, &plan.fleet.model, plan.request_timeout).await?;
    fleet.reset_caches(client).await?;
    let before = fleet.metrics(client).await?;
    let gw_before = gateway_metrics(router, client).await;
    let limits = RunLimits {
        request_timeout: plan.request_timeout,
        time_scale: plan.fleet.time_scale,
        concurrency: match w.concurrency {
            0 => plan.concurrency,
            c => c,
        },
    };
    let (outcomes, wall) = run(client, target, w, &plan.fleet.model, limits).await;
    let after = fleet.metrics(client).await?;
    let gw_after = gateway_metrics(router, client).await;
    let dir = plan.out.join(&w.name);
    save_metrics(&dir, policy, &after, gw_after.as_deref())?;
    save_outcomes(&dir, policy, &outcomes)?;
    let mut r = summarize(
        policy,
        &outcomes,
        &before,
        &after,
        wall,
        plan.fleet.time_scale,
    );
    if let (Some(b), Some(a)) = (gw_before, gw_after) {
        r.notes.extend(gateway_notes(policy, &b, &a));
    }
    Ok(r)
}

/// One short request through the target, so a broken route fails before the run.
async fn warm_up(
    client: &HttpClient,
    target: &Target,
    model: &str,
    timeout: Duration,
) -> Result<(), String> {
    let base = match target {
        Target::Gateway(u) => u.clone(),
        Target::Direct(us) => us[0].clone(),
    };
    let body =
        serde_json::json!({"model": model, "prompt": " warm up", "max_tokens": 2, "stream": true});
    let mut last = String::new();
    for _ in 0..20 {
        let o = super::client::send(
            client,
            0,
            &format!("{base}/v1/completions"),
            body.to_string().into(),
            timeout,
        )
        .await;
        if o.ok() {
            return Ok(());
        }
        last = o.error.unwrap_or_else(|| format!("status {}", o.status));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("warm-up request through {base} failed: {last}"))
}

async fn gateway_metrics(router: &Router, client: &HttpClient) -> Option<String> {
    match router {
        Router::Loxi(g) => g.metrics(client).await.ok(),
        _ => None,
    }
}

/// KV-tier engagement (spec §9.1): tier-1.5 hits must advance under a shared-prefix workload;
/// for `pd`, the tier mix of each leg and the prefill answers without transfer parameters.
fn gateway_notes(policy: &str, before: &str, after: &str) -> Vec<String> {
    if policy.starts_with("pd") {
        return pd_notes(before, after);
    }
    if !policy.starts_with("kv") {
        return Vec::new();
    }
    let delta = |name: &str| {
        scrape::sum_by_name(after).get(name).copied().unwrap_or(0.0)
            - scrape::sum_by_name(before)
                .get(name)
                .copied()
                .unwrap_or(0.0)
    };
    let hits = delta("loxilb_pd_kv_tier15_hits_total");
    let fall = delta("loxilb_pd_kv_tier15_fallthrough_total");
    let mut notes = vec![format!(
        "tier-1.5 hits Δ{hits:.0}, fallthrough Δ{fall:.0}, spills Δ{:.0}, cold seeds Δ{:.0}",
        delta("loxilb_pd_kv_tier15_spills_total"),
        delta("loxilb_pd_kv_tier15_cold_seeds_total")
    )];
    if hits == 0.0 {
        notes.push(
            "WARNING: tier-1.5 hits flat: these numbers measure the fallback selector".into(),
        );
    }
    notes
}

/// `leg tier=Δ` of `loxilb_ai_pd_tier_selected_total`, and the missing-params count.
fn pd_notes(before: &str, after: &str) -> Vec<String> {
    let mut notes = Vec::new();
    for leg in ["prefill", "decode"] {
        let pick = |text: &str| {
            let only: String = text
                .lines()
                .filter(|l| l.contains(&format!("leg=\"{leg}\"")))
                .map(|l| format!("{l}\n"))
                .collect();
            scrape::by_label(&only, "loxilb_ai_pd_tier_selected_total", "tier")
        };
        let (b, a) = (pick(before), pick(after));
        let mix: Vec<String> = a
            .iter()
            .map(|(tier, v)| (tier, v - b.get(tier).copied().unwrap_or(0.0)))
            .filter(|(_, d)| *d > 0.0)
            .map(|(tier, d)| format!("tier {tier} {d:.0}"))
            .collect();
        notes.push(format!("P/D {leg} leg: {}", mix.join(", ")));
    }
    let missing = |t: &str| {
        scrape::sum_by_name(t)
            .get("loxilb_ai_pd_kv_params_missing_total")
            .copied()
            .unwrap_or(0.0)
    };
    notes.push(format!(
        "prefill answers without kv_transfer_params Δ{:.0}",
        missing(after) - missing(before)
    ));
    notes.push(
        "P/D TTFT is client-side ÷ time scale: the decode engine's own TTFT leaves out the prefill leg"
            .into(),
    );
    notes
}

fn save_metrics(
    dir: &std::path::Path,
    policy: &str,
    workers: &[String],
    gw: Option<&str>,
) -> Result<(), String> {
    for (i, text) in workers.iter().enumerate() {
        super::report::write(
            &dir.join("metrics"),
            &format!("{policy}-worker{i}.prom"),
            text,
        )?;
    }
    if let Some(g) = gw {
        super::report::write(&dir.join("metrics"), &format!("{policy}-loxilb.prom"), g)?;
    }
    Ok(())
}

fn save_outcomes(dir: &std::path::Path, policy: &str, outcomes: &[Outcome]) -> Result<(), String> {
    let lines: Vec<String> = outcomes
        .iter()
        .filter_map(|o| serde_json::to_string(o).ok())
        .collect();
    super::report::write(
        dir,
        &format!("outcomes-{policy}.jsonl"),
        &(lines.join("\n") + "\n"),
    )
}

/// Turns outcomes and worker counter snapshots into a [`PolicyResult`].
pub fn summarize(
    policy: &str,
    outcomes: &[Outcome],
    before: &[String],
    after: &[String],
    wall: Duration,
    scale: f64,
) -> PolicyResult {
    let delta = |i: usize, name: &str| {
        let a = scrape::sum_by_name(&after[i])
            .get(name)
            .copied()
            .unwrap_or(0.0);
        let b = scrape::sum_by_name(&before[i])
            .get(name)
            .copied()
            .unwrap_or(0.0);
        (a - b).max(0.0)
    };
    let n = after.len().min(before.len());
    let hits: f64 = (0..n)
        .map(|i| delta(i, "vllm:prefix_cache_hits_total"))
        .sum();
    let queries: f64 = (0..n)
        .map(|i| delta(i, "vllm:prefix_cache_queries_total"))
        .sum();
    let per_worker: Vec<u64> = (0..n)
        .map(|i| delta(i, "vllm:request_success_total") as u64)
        .collect();
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let client_ttft: Vec<f64> = ok
        .iter()
        .filter_map(|o| o.ttft_ms())
        .map(|t| t / scale)
        .collect();
    let projected: Vec<f64> = ok.iter().filter_map(|o| o.projected_ttft_ms()).collect();
    // Projected TTFT when every request reported its engine TTFT and timing headers; else the
    // client-side figure (real ÷ scale), with a note.
    // P/D: the decode engine's TTFT leaves out the prefill leg, so only the client's clock counts.
    let is_projected = !policy.starts_with("pd") && !ok.is_empty() && projected.len() == ok.len();
    let ttft = if is_projected {
        projected
    } else {
        client_ttft.clone()
    };
    let e2e: Vec<f64> = ok
        .iter()
        .filter_map(|o| o.e2e_ms())
        .map(|t| t / scale)
        .collect();
    let itl: Vec<f64> = ok
        .iter()
        .filter_map(|o| o.itl_ms())
        .map(|t| t / scale)
        .collect();
    let engine_ttft: Vec<f64> = ok.iter().filter_map(|o| o.engine_ttft_ms()).collect();
    let added: Vec<f64> = ok.iter().filter_map(|o| o.added_ms()).collect();
    let out_tokens: u64 = ok.iter().map(|o| o.output_tokens).sum();
    let sim_secs = wall.as_secs_f64() / scale;
    let mut notes = Vec::new();
    if ok.len() < outcomes.len() {
        let first = outcomes
            .iter()
            .find_map(|o| o.error.clone())
            .unwrap_or_default();
        notes.push(format!(
            "{} failed requests (first: {first})",
            outcomes.len() - ok.len()
        ));
    }
    if !ok.is_empty() && !is_projected && !policy.starts_with("pd") {
        notes.push(
            "TTFT is client-side ÷ time scale (engine TTFT or timing headers missing)".into(),
        );
    }
    if added.is_empty() && !ok.is_empty() {
        notes.push("no x-sim-* timing headers: gateway added latency unavailable".into());
    }
    PolicyResult {
        policy: policy.to_string(),
        error: None,
        requests: outcomes.len(),
        ok: ok.len(),
        prefix_hit_rate: Some(stats::hit_rate(hits, queries)),
        ttft_ms: (!ttft.is_empty()).then(|| stats::Quantiles::of(&ttft)),
        client_ttft_ms: (!client_ttft.is_empty()).then(|| stats::Quantiles::of(&client_ttft)),
        engine_ttft_ms: (!engine_ttft.is_empty()).then(|| stats::Quantiles::of(&engine_ttft)),
        e2e_ms: (!e2e.is_empty()).then(|| stats::Quantiles::of(&e2e)),
        itl_ms: (!itl.is_empty()).then(|| stats::Quantiles::of(&itl)),
        output_tokens_per_s: (sim_secs > 0.0).then(|| out_tokens as f64 / sim_secs),
        max_over_mean: stats::max_over_mean(&per_worker),
        requests_per_worker: per_worker,
        gateway_added_ms: (!added.is_empty()).then(|| stats::Quantiles::of(&added)),
        notes,
    }
}

/// The oracle bound for `w`: prompts tokenized by worker 0's `/tokenize` (chat template and
/// generation prompt included, as the engine sees them), pooled cache of every worker's usable
/// blocks (`num_gpu_blocks − 1`, block 0 being vLLM's null block).
async fn oracle_for(
    plan: &Plan,
    fleet: &Fleet,
    client: &HttpClient,
    w: &Workload,
) -> Result<f64, String> {
    let url = format!("{}/tokenize", fleet.url(0));
    let mut prompts = Vec::with_capacity(w.requests.len());
    for r in &w.requests {
        prompts.push(tokenize(client, &url, &plan.fleet.model, &r.payload).await?);
    }
    let cap = fleet.hosts.len() * plan.fleet.num_gpu_blocks.saturating_sub(1);
    Ok(oracle::oracle_bound(&prompts, plan.fleet.block_size, cap).rate())
}

async fn tokenize(
    client: &HttpClient,
    url: &str,
    model: &str,
    p: &crate::workload::Payload,
) -> Result<Vec<u32>, String> {
    use http_body_util::BodyExt;
    let body = match p {
        crate::workload::Payload::Completion(s) => serde_json::json!({"model": model, "prompt": s}),
        crate::workload::Payload::Chat(m) => {
            serde_json::json!({"model": model, "messages": m, "add_generation_prompt": true})
        }
    };
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .map_err(|e| e.to_string())?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{url}: {e}"))?
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| format!("{url}: {e}"))?;
    let tokens = v["tokens"]
        .as_array()
        .ok_or_else(|| format!("{url}: no tokens in {v}"))?;
    Ok(tokens
        .iter()
        .filter_map(|t| t.as_u64().map(|x| x as u32))
        .collect())
}
