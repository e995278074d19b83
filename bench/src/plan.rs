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
    /// loxi gateway replicas per loxi policy (≥ 1): each its own `loxilb` with the same rule
    /// over the same fleet; the client sends request `id` to replica `id mod replicas`.
    pub replicas: usize,
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
    /// Oracle bound (0..1) over the requests sent, `None` if the prompts could not be
    /// tokenized.
    pub oracle_hit_rate: Option<f64>,
    /// Requests of the workload left out of the run and of the oracle because their prompt
    /// plus output cannot fit a worker's KV cache (the engine would refuse them), including
    /// the later rounds of a conversation whose earlier round was left out.
    pub excluded_requests: usize,
    /// One entry per policy, in plan order.
    pub results: Vec<PolicyResult>,
}

/// A started router for one policy.
enum Router {
    Direct,
    /// One or more replicas (`Plan::replicas`), in start order.
    Loxi(Vec<Gateway>),
    /// Boxed: a `Proc` is large next to the other variants.
    Peer(Box<Proc>, String),
}

impl Router {
    fn target(&self, fleet: &Fleet) -> Target {
        match self {
            Router::Direct => Target::Direct(fleet.urls()),
            Router::Loxi(gs) if gs.len() == 1 => Target::Gateway(gs[0].vip.clone()),
            Router::Loxi(gs) => Target::Replicas(gs.iter().map(|g| g.vip.clone()).collect()),
            Router::Peer(_, url) => Target::Gateway(url.clone()),
        }
    }

    async fn stop(self) {
        match self {
            Router::Direct => {}
            Router::Loxi(gs) => {
                for g in gs {
                    g.proc.stop().await;
                }
            }
            Router::Peer(p, _) => (*p).stop().await,
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
    let usable = plan.fleet.num_gpu_blocks.saturating_sub(1);
    let fit = Fit {
        block_size: plan.fleet.block_size,
        usable_blocks: usable,
        workers: fleet.hosts.len(),
    };
    let (w, excluded, prompts) = match tokenize_all(plan, fleet, client, w).await {
        Ok(prompts) => {
            let (kept, excluded, kept_prompts) = fit.keep(w, &prompts);
            (kept, excluded, Some(kept_prompts))
        }
        Err(e) => {
            eprintln!("[bench] oracle unavailable (nothing excluded): {e}");
            (w.clone(), 0, None)
        }
    };
    let oracle_hit_rate = prompts.as_ref().map(|p| fit.oracle(p));
    if excluded > 0 {
        eprintln!(
            "[bench] workload {}: {excluded} requests excluded (prompt + output beyond {usable} blocks of {} tokens)",
            w.name, plan.fleet.block_size
        );
    }
    if w.requests.is_empty() {
        return Err(format!(
            "workload {}: every request was excluded (prompt + output beyond a worker's {usable} KV blocks); raise --num-gpu-blocks",
            w.name
        ));
    }
    let w = &w;
    eprintln!(
        "[bench] workload {}: {} requests over {:.1}s simulated; oracle hit rate {}",
        w.name,
        w.requests.len(),
        w.span().as_secs_f64(),
        crate::report::percent(oracle_hit_rate)
    );
    let mut results = Vec::new();
    for policy in &plan.policies {
        eprintln!("[bench] {} / {policy} ...", w.name);
        let mut r = match one_policy(plan, fleet, client, w, policy).await {
            Ok(r) => r,
            Err(e) => PolicyResult::failed(policy, e),
        };
        if let Some(p) = &prompts {
            fit.failed_requests(&mut r, p);
        }
        eprintln!("[bench] {} / {policy}: {}", w.name, r.progress());
        results.push(r);
    }
    Ok(WorkloadResult {
        workload: w.name.clone(),
        requests: w.requests.len(),
        oracle_hit_rate,
        excluded_requests: excluded,
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
            return Ok(Router::Peer(Box::new(peer.proc), peer.url));
        }
        p => return Err(format!("unknown policy {p:?}")),
    };
    let mut replicas = Vec::with_capacity(plan.replicas.max(1));
    for i in 0..plan.replicas.max(1) {
        let replica = (plan.replicas > 1).then_some(i);
        match Gateway::start(&plan.gateway, &kind, fleet, client, &logs, replica).await {
            Ok(g) => replicas.push(g),
            Err(e) => {
                Router::Loxi(replicas).stop().await;
                return Err(e);
            }
        }
    }
    Ok(Router::Loxi(replicas))
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
    let replicas = match target {
        Target::Replicas(us) => us.len(),
        _ => 0,
    };
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
    save_metrics(&dir, policy, &after, &gw_after)?;
    save_outcomes(&dir, policy, &outcomes)?;
    let mut r = summarize(
        policy,
        &outcomes,
        &before,
        &after,
        wall,
        plan.fleet.time_scale,
    );
    r.requests_per_replica = per_replica(&outcomes, replicas);
    if replicas > 1 {
        r.notes.push(format!(
            "{replicas} loxilb replicas (client round robin), requests per replica {:?}",
            r.requests_per_replica
        ));
    }
    if !gw_before.is_empty() && gw_before.len() == gw_after.len() {
        // Replicas' counters summed (each series once per replica).
        r.notes.extend(gateway_notes(
            policy,
            &gw_before.concat(),
            &gw_after.concat(),
        ));
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
    let base = target.first().to_string();
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

/// Each replica's metrics text (empty when the router is not loxi or a scrape failed).
async fn gateway_metrics(router: &Router, client: &HttpClient) -> Vec<String> {
    let Router::Loxi(gs) = router else {
        return Vec::new();
    };
    let mut texts = Vec::with_capacity(gs.len());
    for g in gs {
        match g.metrics(client).await {
            Ok(t) => texts.push(t),
            Err(_) => return Vec::new(),
        }
    }
    texts
}

/// Requests the client sent to each of `replicas` replicas (empty for 0: a single target).
pub fn per_replica(outcomes: &[Outcome], replicas: usize) -> Vec<u64> {
    let mut n = vec![0u64; replicas];
    for r in outcomes.iter().filter_map(|o| o.replica) {
        if let Some(c) = n.get_mut(r) {
            *c += 1;
        }
    }
    n
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
    gw: &[String],
) -> Result<(), String> {
    for (i, text) in workers.iter().enumerate() {
        super::report::write(
            &dir.join("metrics"),
            &format!("{policy}-worker{i}.prom"),
            text,
        )?;
    }
    for (i, g) in gw.iter().enumerate() {
        let name = if gw.len() == 1 {
            format!("{policy}-loxilb.prom")
        } else {
            format!("{policy}-loxilb{i}.prom")
        };
        super::report::write(&dir.join("metrics"), &name, g)?;
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
        requests_per_replica: Vec::new(),
        ok_ids: ok.iter().map(|o| o.id).collect(),
        oracle_ok_hit_rate: None,
        gateway_added_ms: (!added.is_empty()).then(|| stats::Quantiles::of(&added)),
        notes,
    }
}

/// The oracle bound for `w`: prompts tokenized by worker 0's `/tokenize` (chat template and
/// generation prompt included, as the engine sees them), pooled cache of every worker's usable
/// blocks (`num_gpu_blocks − 1`, block 0 being vLLM's null block).
async fn tokenize_all(
    plan: &Plan,
    fleet: &Fleet,
    client: &HttpClient,
    w: &Workload,
) -> Result<Vec<Vec<u32>>, String> {
    let url = format!("{}/tokenize", fleet.url(0));
    let mut prompts = Vec::with_capacity(w.requests.len());
    for r in &w.requests {
        prompts.push(tokenize(client, &url, &plan.fleet.model, &r.payload).await?);
    }
    Ok(prompts)
}

/// The fleet's KV geometry, for the fit check and the oracle.
#[derive(Debug, Clone, Copy)]
pub struct Fit {
    /// Tokens per block.
    pub block_size: usize,
    /// Usable blocks per worker (`num_gpu_blocks − 1`: block 0 is vLLM's null block).
    pub usable_blocks: usize,
    /// Workers (the oracle pools their caches).
    pub workers: usize,
}

impl Fit {
    /// Leaves out of `w` every request whose prompt (`prompts[id]`, token ids) plus
    /// `max_tokens` cannot fit one worker's cache (and the rounds that wait for it). Returns
    /// the workload to send, the number left out and the kept requests' prompts (by new id),
    /// for [`Self::oracle`]: both sides of the comparison cover the same requests.
    pub fn keep(&self, w: &Workload, prompts: &[Vec<u32>]) -> (Workload, usize, Vec<Vec<u32>>) {
        let drop: Vec<bool> = w
            .requests
            .iter()
            .map(|r| {
                let len = prompts.get(r.id).map_or(0, Vec::len);
                !crate::workload::fits_cache(len, r.max_tokens, self.block_size, self.usable_blocks)
            })
            .collect();
        let (kept, excluded) = w.excluding(&drop);
        // `excluding` keeps the order, so the kept prompts are the survivors in order.
        let gone = w.with_followers(&drop);
        let kept_prompts: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&gone)
            .filter(|(_, g)| !**g)
            .map(|(p, _)| p.clone())
            .collect();
        (kept, excluded, kept_prompts)
    }

    /// The oracle bound over `prompts` (arrival order) for the fleet's pooled cache.
    pub fn oracle(&self, prompts: &[Vec<u32>]) -> f64 {
        let cap = self.workers * self.usable_blocks;
        oracle::oracle_bound(prompts, self.block_size, cap).rate()
    }

    /// When some of `r`'s requests failed at run time (they never reached an engine, or
    /// stopped), its engine-side figures cover only the others: sets
    /// [`PolicyResult::oracle_ok_hit_rate`], the oracle over the requests that succeeded
    /// (`r.ok_ids`, ids into `prompts`), and says so in the notes. Nothing when all succeeded.
    pub fn failed_requests(&self, r: &mut PolicyResult, prompts: &[Vec<u32>]) {
        if r.error.is_some() || r.ok_ids.len() == r.requests {
            return;
        }
        let ok: Vec<Vec<u32>> = r
            .ok_ids
            .iter()
            .filter_map(|&id| prompts.get(id).cloned())
            .collect();
        let rate = self.oracle(&ok);
        r.oracle_ok_hit_rate = Some(rate);
        r.notes.push(format!(
            "{} of {} requests failed: compare its hit rate with the oracle over its {} successful requests, {:.1}%",
            r.requests - r.ok_ids.len(),
            r.requests,
            r.ok_ids.len(),
            rate * 100.0
        ));
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Payload, WorkRequest};

    fn workload(max_tokens: &[u32]) -> Workload {
        let requests = max_tokens
            .iter()
            .enumerate()
            .map(|(id, &m)| WorkRequest {
                id,
                at: Duration::from_millis(id as u64),
                payload: Payload::Completion(format!("p{id}")),
                max_tokens: m,
                after: None,
                group: 0,
            })
            .collect();
        Workload::new("t", requests)
    }

    #[test]
    fn fit_excludes_unfit_requests_from_the_run_and_the_oracle() {
        // 4-token blocks, 3 usable per worker (12 tokens), 1 worker.
        let fit = Fit {
            block_size: 4,
            usable_blocks: 3,
            workers: 1,
        };
        // Request 1 (10 + 4 = 14 tokens) does not fit; 0 and 2 share their first two blocks.
        let w = workload(&[2, 4, 2]);
        let prompts = vec![
            vec![1, 2, 3, 4, 5, 6, 7, 8, 9],
            vec![9; 10],
            vec![1, 2, 3, 4, 5, 6, 7, 8, 10],
        ];
        let (kept, excluded, kept_prompts) = fit.keep(&w, &prompts);
        let rate = fit.oracle(&kept_prompts);
        assert_eq!(excluded, 1);
        let sent: Vec<&Payload> = kept.requests.iter().map(|r| &r.payload).collect();
        assert_eq!(
            sent,
            [
                &Payload::Completion("p0".into()),
                &Payload::Completion("p2".into())
            ]
        );
        // Oracle over 0 and 2 only: 8 of 18 prompt tokens hit. With request 1 in between, its
        // 2 blocks would have evicted request 0's from the 3-block cache (0 hits).
        assert_eq!(rate, 8.0 / 18.0);
        let all = oracle::oracle_bound(&prompts, 4, 3).rate();
        assert_eq!(all, 0.0);
        // Everything fits: nothing excluded, the oracle sees every prompt.
        let roomy = Fit {
            usable_blocks: 8,
            ..fit
        };
        let (kept, excluded, _) = roomy.keep(&w, &prompts);
        assert_eq!((kept.requests.len(), excluded), (3, 0));
    }

    #[test]
    fn failed_requests_get_an_oracle_over_the_successful_ones() {
        let fit = Fit {
            block_size: 4,
            usable_blocks: 8,
            workers: 1,
        };
        let prompts = vec![vec![1, 2, 3, 4, 5], vec![9; 5], vec![1, 2, 3, 4, 6]];
        // Request 0 failed: request 2's hit on 0's block is not in the engines' counters.
        let mut r = PolicyResult {
            requests: 3,
            ok: 2,
            ok_ids: vec![1, 2],
            ..PolicyResult::default()
        };
        fit.failed_requests(&mut r, &prompts);
        assert_eq!(r.oracle_ok_hit_rate, Some(0.0));
        assert!(
            r.notes[0].starts_with("1 of 3 requests failed"),
            "{:?}",
            r.notes
        );
        // All succeeded: the workload's oracle stands, no note.
        let mut all = PolicyResult {
            requests: 3,
            ok: 3,
            ok_ids: vec![0, 1, 2],
            ..PolicyResult::default()
        };
        fit.failed_requests(&mut all, &prompts);
        assert_eq!((all.oracle_ok_hit_rate, all.notes.len()), (None, 0));
        assert_eq!(fit.oracle(&prompts), 4.0 / 15.0);
    }

    #[test]
    fn per_replica_counts_the_client_spread() {
        let o = |replica| Outcome {
            replica,
            ..Outcome::default()
        };
        let outs = [o(Some(0)), o(Some(1)), o(Some(0)), o(Some(2))];
        assert_eq!(per_replica(&outs, 3), [2, 1, 1]);
        assert!(per_replica(&[o(None)], 0).is_empty());
    }
}
