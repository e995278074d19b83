//! `bench-gateway`: KV-routed requests per loxilb core (issue 17 §2).
//!
//! Starts `--workers` fast `vllm-sim` engines (time scale `--time-scale`, KV events on) and one
//! `loxilb` pinned to CPU `--core` (`taskset`, `TOKIO_WORKER_THREADS=1`,
//! `LOXI_KV_TOKENIZE_WORKERS=1`) with a `kvExactMode 3` rule over them, then for each mix
//! (`chat`: 8 system prompts × 2,048 tokens + distinct 128-token questions through the chat
//! template; `distinct`: fresh 1,024-token completion prompts) runs a closed loop at each
//! `--concurrency` level and reports requests/s, the daemon's CPU per request, the KV stages'
//! share, and the added-latency p50/p99 (see `loxi_bench::gateway_load`). Writes
//! `results.md` and `summary.json` under `--out`. Run it through `scripts/bench-gateway.sh`,
//! which keeps the client and engines off the daemon's CPU.

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Parser;
use loxi_bench::client::{HttpClient, Outcome, http_client, send, unix_ns};
use loxi_bench::fleet::{Fleet, FleetSpec, stage_tokenizer};
use loxi_bench::gateway::{Gateway, GatewaySpec, RuleKind};
use loxi_bench::gateway_load::{Level, Mix, PromptGen, StageTimes, cpu_ns, markdown, write};
use loxi_bench::shared_dir;
use loxi_bench::workload::Vocab;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Flags.
#[derive(Debug, Parser)]
#[command(
    name = "bench-gateway",
    about = "KV-routed requests per loxilb core in front of fast vllm-sim engines"
)]
struct Args {
    /// Output directory.
    #[arg(long, default_value = "bench-gateway-out")]
    out: PathBuf,
    #[command(flatten)]
    fleet: loxi_bench::cli::FleetArgs,
    /// Mixes to run (comma list): chat, distinct.
    #[arg(long, default_value = "chat,distinct", value_delimiter = ',')]
    mix: Vec<String>,
    /// CPU the daemon is pinned to (default: the last CPU).
    #[arg(long)]
    core: Option<usize>,
    /// Closed-loop concurrency levels (comma list).
    #[arg(long, default_value = "1,2,4,8,16,32", value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Measured seconds per level (after the warm-up).
    #[arg(long, default_value_t = 5.0)]
    level_secs: f64,
    /// Warm-up seconds per level (not measured).
    #[arg(long, default_value_t = 1.0)]
    warmup_secs: f64,
    /// The added-latency p99 bound the headline figure is read at, ms.
    #[arg(long, default_value_t = 10.0)]
    p99_ms: f64,
    /// Output tokens per request (streamed).
    #[arg(long, default_value_t = 4)]
    output_tokens: u32,
    /// The engines' time scale (real seconds per simulated second): small = fast engines.
    #[arg(long, default_value_t = 0.001)]
    time_scale: f64,
    /// Prompt seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// One closed-loop level: `c` tasks send back to back for warm-up + measured time; the
/// measured window is bracketed by CPU and metrics snapshots.
async fn run_level(
    args: &Args,
    client: &HttpClient,
    d: &Gateway,
    prompts: &Arc<Mutex<PromptGen>>,
    c: usize,
) -> Result<Level> {
    let warm = Duration::from_secs_f64(args.warmup_secs);
    let window = Duration::from_secs_f64(args.level_secs);
    let stop = Instant::now() + warm + window;
    let mut tasks = Vec::with_capacity(c);
    for _ in 0..c {
        let (client, prompts) = (client.clone(), prompts.clone());
        let (vip, model, max) = (d.vip.clone(), args.fleet.model.clone(), args.output_tokens);
        tasks.push(tokio::spawn(async move {
            let mut done: Vec<Outcome> = Vec::new();
            while Instant::now() < stop {
                let payload = prompts.lock().expect("prompt generator").next_payload();
                let url = format!("{vip}{}", payload.path());
                let body = Bytes::from(payload.body(&model, max).to_string());
                done.push(send(&client, 0, &url, body, Duration::from_secs(30)).await);
            }
            done
        }));
    }
    tokio::time::sleep(warm).await;
    let metrics_url = format!("{}/netlox/v1/metrics", d.api);
    let pid = d.proc.pid().context("loxilb exited")?;
    let (t0, cpu0) = (unix_ns(), cpu_ns(pid).map_err(anyhow::Error::msg)?);
    let st0 = StageTimes::parse(
        &loxi_bench::scrape::fetch(client, &metrics_url)
            .await
            .map_err(anyhow::Error::msg)?,
    );
    tokio::time::sleep_until(stop.into()).await;
    let (t1, cpu1) = (unix_ns(), cpu_ns(pid).map_err(anyhow::Error::msg)?);
    let st1 = StageTimes::parse(
        &loxi_bench::scrape::fetch(client, &metrics_url)
            .await
            .map_err(anyhow::Error::msg)?,
    );
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await.context("load task")?);
    }
    // Completed in the window, or (failures) sent in it.
    let ok: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.ok() && o.end_ns.is_some_and(|e| e >= t0 && e <= t1))
        .collect();
    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !o.ok() && o.send_ns >= t0 && o.send_ns <= t1)
        .collect();
    if let Some(f) = failed.first() {
        eprintln!(
            "bench-gateway: {} failed at concurrency {c}, e.g. {:?}",
            failed.len(),
            f.error
        );
    }
    let added: Vec<f64> = ok.iter().filter_map(|o| o.added_ms()).collect();
    Ok(Level::from_parts(
        c,
        ok.len() as u64,
        failed.len() as u64,
        (t1 - t0) as f64 / 1e9,
        cpu1.saturating_sub(cpu0),
        &added,
        &st1.since(&st0),
    ))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let mixes: Vec<Mix> = args
        .mix
        .iter()
        .map(|m| Mix::parse(m))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs levels ≥ 1");
    }
    if !(args.level_secs > 0.0 && args.warmup_secs >= 0.0) {
        bail!("--level-secs must be > 0 and --warmup-secs ≥ 0");
    }
    // Without --core: the last CPU this process may use (the script passes --core).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let core = args.core.unwrap_or(cpus.saturating_sub(1));
    let bins = args.fleet.bin_dir()?;
    for b in ["vllm-sim", "loxilb", "loxicmd"] {
        if !bins.join(b).exists() {
            bail!(
                "{} not found (scripts/setup.sh builds it)",
                bins.join(b).display()
            );
        }
    }
    std::fs::create_dir_all(&args.out).with_context(|| args.out.display().to_string())?;
    let logs = args.out.join("logs");
    std::fs::create_dir_all(&logs)?;
    let model_dir = args
        .fleet
        .model_dir
        .clone()
        .unwrap_or_else(|| shared_dir().join("golden/tiny-model"));
    let vocab = Vocab::from_tokenizer_json(&model_dir.join("tokenizer.json"))?;
    let tok_root = args.out.join("tokenizers");
    stage_tokenizer(&model_dir, &tok_root, &args.fleet.model).map_err(anyhow::Error::msg)?;
    let tok_root = std::fs::canonicalize(&tok_root)?;
    let client = http_client();
    let fleet = Fleet::start(
        &FleetSpec {
            bin: bins.join("vllm-sim"),
            workers: args.fleet.workers,
            model: args.fleet.model.clone(),
            tokenizer_dir: tok_root.clone(),
            block_size: 16,
            num_gpu_blocks: 200_000,
            max_num_seqs: 512,
            time_scale: args.time_scale,
            hash_seed: "0".into(),
            hash_algo: "sha256_cbor".into(),
            real_vllm: None,
        },
        &client,
        &logs,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let spec = GatewaySpec {
        loxilb: bins.join("loxilb"),
        loxicmd: bins.join("loxicmd"),
        tokenizer_dir: tok_root,
        hash_seed: "0".into(),
        hash_algo: "sha256_cbor".into(),
        block_size: 16,
        pin_cpu: Some(core),
    };
    let mut md = format!(
        "## bench-gateway: KV-routed requests per loxilb core\n\nloxilb pinned to CPU {core} (taskset, 1 tokio worker, 1 tokenization thread), rule `kvExactMode 3` over {} vllm-sim engines (time scale {}), {} output tokens streamed, {} s per level after {} s warm-up. CPU = every daemon thread's run time (`/proc/<pid>/task/*/schedstat`); per core-second = 1000 / CPU ms per request; stage times are wall time inside the KV stages (`loxilb_kv_routing_stage_seconds`), `rest` = CPU − stages (HTTP, JSON, proxying, streaming). Anchor: Dynamo's frontend, {} req/s per core.\n",
        args.fleet.workers,
        args.time_scale,
        args.output_tokens,
        args.level_secs,
        args.warmup_secs,
        loxi_bench::gateway_load::DYNAMO_REQ_PER_CORE
    );
    let mut summary = serde_json::Map::new();
    for mix in mixes {
        // A fresh daemon per mix: the chat mix's warm tokenizer cache must not help `distinct`.
        let d = Gateway::start(&spec, &RuleKind::Kv(None), &fleet, &client, &logs, None)
            .await
            .map_err(anyhow::Error::msg)?;
        let prompts = Arc::new(Mutex::new(PromptGen::new(vocab.clone(), mix, args.seed)));
        let mut levels = Vec::new();
        for &c in &args.concurrency {
            let l = run_level(&args, &client, &d, &prompts, c).await?;
            eprintln!(
                "[{}] c={c}: {:.0} req/s, loxilb {:.2} cores, {:.3} CPU ms/req ({:.0}/core-s), added p99 {:.2} ms, {} failed",
                mix.name(),
                l.req_per_s,
                l.cpu_util,
                l.cpu_ms_per_req,
                l.req_per_core,
                l.added_p99_ms,
                l.failed
            );
            levels.push(l);
        }
        md.push_str(&markdown(mix, &levels, args.p99_ms));
        summary.insert(mix.name().into(), serde_json::to_value(&levels)?);
        d.proc.stop().await;
    }
    for p in fleet.procs {
        p.stop().await;
    }
    write(&args.out, "results.md", &md).map_err(anyhow::Error::msg)?;
    write(
        &args.out,
        "summary.json",
        &serde_json::to_string_pretty(&summary)?,
    )
    .map_err(anyhow::Error::msg)?;
    println!("{md}");
    Ok(())
}
