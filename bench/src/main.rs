//! `bench-routing`: the routing-quality benchmark (issue 4).
//!
//! Starts `--workers` `vllm-sim` workers with the tiny model's tokenizer, then for each workload
//! and policy resets the caches, starts the policy's router (`loxilb` + a `loxicmd` rule, or a
//! peer router from PyPI with `--peers`), replays the workload and writes, under `--out`:
//! `summary.json`, `results.md`, `report.json`, `chart.png` (first workload) and per workload
//! `<name>/chart.png`, `<name>/outcomes-<policy>.jsonl`, `<name>/metrics/*.prom`, `logs/`.

use anyhow::{Context, Result, bail};
use clap::Parser;
use loxi_bench::fleet::{FleetSpec, stage_tokenizer};
use loxi_bench::gateway::GatewaySpec;
use loxi_bench::plan::{Plan, WorkloadResult, execute};
use loxi_bench::real_vllm::{self, RealVllmSpec};
use loxi_bench::shared_dir;
use loxi_bench::workload::multi_turn::MultiTurn;
use loxi_bench::workload::shared_prefix::SharedPrefix;
use loxi_bench::workload::trace::{
    SynthTrace, TraceReplay, cache_blocks_for, read_trace, write_trace,
};
use loxi_bench::workload::{Arrival, Vocab, Workload};
use loxi_bench::{chart, peers, report};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `--burst` when not given: requests in the cold burst of `--workload burst`.
const DEFAULT_BURST: usize = 64;

/// Flags. Token lengths are in tokens of the tiny model's tokenizer; times are simulated.
#[derive(Debug, Parser)]
#[command(
    name = "bench-routing",
    about = "Routing-quality benchmark over a vllm-sim fleet"
)]
struct Args {
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Workloads: a = shared prefix, b = multi-turn, c = trace replay, burst = `--burst`
    /// same-prefix requests sent at once to cold caches (comma list). Each may
    /// carry `:key=value` overrides of this run's flags, so one fleet serves several shapes:
    /// `groups`, `per_group` (a: prompts per group), `users`, `rounds` (b), `c` (closed-loop
    /// concurrency), `run` (a repeat: only names it); e.g. `a:groups=6:per_group=8:c=4,a:groups=6:per_group=16:c=16`. A workload
    /// with overrides is reported as `<name>-<overrides>`.
    #[arg(long, default_value = "a", value_delimiter = ',')]
    workload: Vec<String>,
    /// Policies in order (comma list): direct, rr, chwbl, kv, kv-<law>, pd (half the workers
    /// prefill, half decode), pd-kv (pd with tier 1.5 over the prefill workers), pd-trie (pd
    /// with tier 1, the prefix trie).
    #[arg(long, default_value = "direct,rr,chwbl,kv", value_delimiter = ',')]
    policies: Vec<String>,
    /// Also run kv with each of these blend laws (LOXILB_KV_LB_MODE), as kv-<law>.
    #[arg(long, value_delimiter = ',')]
    laws: Vec<String>,
    /// Also run the peer routers (vllm-router 0.1.17, sglang-router 0.3.2) from a virtualenv.
    #[arg(long)]
    peers: bool,
    /// Virtualenv for the peers (default: $XDG_CACHE_HOME or ~/.cache, /loxi-bench/venv).
    #[arg(long)]
    venv: Option<PathBuf>,
    #[command(flatten)]
    fleet: loxi_bench::cli::FleetArgs,
    /// KV block size (vLLM --block-size, kvBlockSize).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache blocks per worker (0: half the shared-prefix working set + 1, and with
    /// workload c at least enough for a `--trace-max-prompt` prompt plus its output).
    #[arg(long, default_value_t = 0)]
    num_gpu_blocks: usize,
    /// vLLM --max-num-seqs.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Real seconds per simulated second (default 0.1 with vllm-sim; real engines run in real
    /// time, so with `--engines real-vllm` only 1 is accepted).
    #[arg(long)]
    time_scale: Option<f64>,
    /// Engines: `sim` (vllm-sim) or `real-vllm` (real vLLM CPU 0.32 engines from the venv of
    /// `../shared/scripts/real-vllm-cpu.sh`; block size must be a multiple of 32).
    #[arg(long, default_value = "sim")]
    engines: String,
    /// (real-vllm) The engines' virtualenv (default: $VLLM_CPU_VENV or ~/.cache/real-vllm-cpu/venv).
    #[arg(long)]
    vllm_venv: Option<PathBuf>,
    /// (real-vllm) OpenMP threads per engine.
    #[arg(long, default_value_t = 1)]
    engine_threads: usize,
    /// (real-vllm) Seconds all engines together may take to become ready.
    #[arg(long, default_value_t = 900)]
    engine_ready_timeout_s: u64,
    /// (real-vllm) `--max-model-len` of the engines (0: what one engine's cache holds,
    /// `(num_gpu_blocks − 1) × block_size`, at most 2048; vLLM refuses a longer one).
    #[arg(long, default_value_t = 0)]
    max_model_len: usize,
    /// Closed-loop replay: at most this many requests in flight, each sent after its arrival
    /// time (0 = open loop: arrivals only).
    #[arg(long, default_value_t = 0)]
    concurrency: usize,
    /// PYTHONHASHSEED of the workers = LLB_KV_NONE_HASH_SEED of loxilb.
    #[arg(long, default_value = "0")]
    hash_seed: String,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Arrival process: poisson or fixed.
    #[arg(long, default_value = "poisson")]
    arrival: String,
    /// Target rate, requests per simulated second.
    #[arg(long, default_value_t = 20.0)]
    qps: f64,
    /// Simulated seconds of traffic for workloads a and b (sets prompts per group / users).
    #[arg(long, default_value_t = 120.0)]
    duration: f64,
    /// (a) prefix groups.
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// (a) system-prompt tokens.
    #[arg(long, default_value_t = 3072)]
    system_tokens: usize,
    /// (a) question tokens.
    #[arg(long, default_value_t = 128)]
    question_tokens: usize,
    /// (a, c) output tokens.
    #[arg(long, default_value_t = 32)]
    output_tokens: u32,
    /// (b) rounds per user (users = qps × duration / rounds).
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    /// (b) shared system-prompt tokens.
    #[arg(long, default_value_t = 1024)]
    mt_system_tokens: usize,
    /// (b) question tokens per round.
    #[arg(long, default_value_t = 96)]
    mt_question_tokens: usize,
    /// (b) answer tokens per round.
    #[arg(long, default_value_t = 64)]
    mt_answer_tokens: u32,
    /// (b) conversations in flight at a time.
    #[arg(long, default_value_t = 16)]
    mt_active_users: usize,
    /// (c) Mooncake JSONL trace; without it a synthetic trace is generated into the output dir.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// (c) tokens per hash id.
    #[arg(long, default_value_t = 512)]
    trace_block_tokens: usize,
    /// (c) trace timestamps are divided by this.
    #[arg(long, default_value_t = 1.0)]
    trace_speedup: f64,
    /// (c) prompts are cut to this many tokens.
    #[arg(long, default_value_t = 3584)]
    trace_max_prompt: usize,
    /// (burst) requests of the burst: one system prompt, distinct questions, all sent at time 0
    /// (default 64; refused without `--workload burst`).
    #[arg(long)]
    burst: Option<usize>,
    /// loxi gateway replicas per loxi policy: N `loxilb` daemons with the same rule over the same
    /// fleet (each its own state dir and API port, each subscribed to the workers' KV events);
    /// the client sends request `id` to replica `id mod N`. Peers and `direct` run once.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Per-request timeout, real seconds.
    #[arg(long, default_value_t = 120)]
    request_timeout_s: u64,
}

fn default_venv() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache")
        });
    cache.join("loxi-bench/venv")
}

impl Args {
    /// The `--engines real-vllm` settings, `None` for vllm-sim; refuses what real engines
    /// cannot honour.
    fn real_vllm(&self, model_dir: &Path) -> Result<Option<RealVllmSpec>> {
        match self.engines.as_str() {
            "sim" => Ok(None),
            "real-vllm" => {
                if self.time_scale.is_some_and(|t| t != 1.0) {
                    bail!(
                        "--time-scale: real engines run in real time (only 1 is accepted with --engines real-vllm)"
                    );
                }
                if !self.block_size.is_multiple_of(32) {
                    bail!(
                        "--block-size {}: vLLM's CPU attention needs a multiple of 32 (--engines real-vllm)",
                        self.block_size
                    );
                }
                let spec = RealVllmSpec {
                    venv: self
                        .vllm_venv
                        .clone()
                        .unwrap_or_else(real_vllm::default_venv),
                    model_dir: std::fs::canonicalize(model_dir)
                        .with_context(|| model_dir.display().to_string())?,
                    threads: self.engine_threads.max(1),
                    max_model_len: match self.max_model_len {
                        // Block 0 is vLLM's null block.
                        0 => (self.gpu_blocks().saturating_sub(1) * self.block_size).min(2048),
                        n => n,
                    },
                    ready_timeout: Duration::from_secs(self.engine_ready_timeout_s),
                };
                spec.python().map_err(anyhow::Error::msg)?;
                Ok(Some(spec))
            }
            other => bail!("--engines: unknown {other:?} (sim or real-vllm)"),
        }
    }

    fn time_scale(&self) -> f64 {
        match self.engines.as_str() {
            "real-vllm" => 1.0,
            _ => self.time_scale.unwrap_or(0.1),
        }
    }

    fn arrival(&self) -> Result<Arrival> {
        Ok(Arrival::parse(&self.arrival, self.qps)?)
    }

    fn total_requests(&self) -> usize {
        (self.qps * self.duration).round().max(1.0) as usize
    }

    fn shared_prefix(&self) -> Result<SharedPrefix> {
        Ok(SharedPrefix {
            groups: self.groups,
            prompts_per_group: self.total_requests().div_ceil(self.groups.max(1)),
            system_tokens: self.system_tokens,
            question_tokens: self.question_tokens,
            output_tokens: self.output_tokens,
            arrival: self.arrival()?,
            seed: self.seed,
        })
    }

    /// Blocks per worker: explicit, or half of workload (a)'s working set (its system prompts),
    /// raised with workload c so that a `--trace-max-prompt` prompt and its output fit.
    fn gpu_blocks(&self) -> usize {
        if self.num_gpu_blocks > 0 {
            return self.num_gpu_blocks;
        }
        let working_set = self.groups * self.system_tokens.div_ceil(self.block_size.max(1));
        let shared = (working_set / 2).max(64) + 1;
        if self.workload.iter().any(|w| w == "c" || w == "trace") {
            shared.max(cache_blocks_for(
                self.trace_max_prompt,
                self.trace_max_output(),
                self.block_size,
            ))
        } else {
            shared
        }
    }

    /// (c) output tokens are capped to this.
    fn trace_max_output(&self) -> u32 {
        self.output_tokens.max(1) * 8
    }

    /// Flags no run can honour, or that would do nothing.
    fn check(&self) -> Result<()> {
        if self.replicas == 0 {
            bail!("--replicas must be ≥ 1 (loxilb daemons per loxi policy)");
        }
        let burst_run = self.workload.iter().any(|w| w == "burst");
        match self.burst {
            Some(0) if burst_run => bail!("--burst must be ≥ 1 with --workload burst"),
            Some(_) if !burst_run => {
                bail!("--burst sizes the burst workload only: add `burst` to --workload")
            }
            _ => {}
        }
        let loxi = |p: &String| p != "direct" && !peers::PEERS.contains(&p.as_str());
        if self.replicas > 1 && !self.policies().iter().any(loxi) {
            bail!(
                "--replicas {} applies to loxi policies only, and none is selected",
                self.replicas
            );
        }
        Ok(())
    }

    fn workloads(&self, vocab: &Vocab) -> Result<Vec<Workload>> {
        self.workload
            .iter()
            .map(|w| self.one_workload(w, vocab))
            .collect()
    }

    fn one_workload(&self, spec: &str, vocab: &Vocab) -> Result<Workload> {
        let (w, o) = parse_workload(spec)?;
        let mut built = self.build_workload(&w, &o, vocab)?;
        if !o.is_empty() {
            built.name = format!("{}-{}", built.name, o.label);
        }
        built.concurrency = o.concurrency.unwrap_or(0);
        Ok(built)
    }

    fn build_workload(&self, w: &str, o: &Overrides, vocab: &Vocab) -> Result<Workload> {
        match w {
            "a" | "shared_prefix" => {
                let mut sp = self.shared_prefix()?;
                if let Some(g) = o.groups {
                    sp.groups = g;
                    sp.prompts_per_group = self.total_requests().div_ceil(g.max(1));
                }
                if let Some(n) = o.per_group {
                    sp.prompts_per_group = n;
                }
                Ok(sp.build(vocab)?)
            }
            "b" | "multi_turn" => Ok(MultiTurn {
                users: o
                    .users
                    .unwrap_or_else(|| self.total_requests().div_ceil(self.rounds.max(1))),
                rounds: o.rounds.unwrap_or(self.rounds),
                system_tokens: self.mt_system_tokens,
                question_tokens: self.mt_question_tokens,
                answer_tokens: self.mt_answer_tokens,
                active_users: self.mt_active_users,
                arrival: self.arrival()?,
                seed: self.seed,
            }
            .build(vocab)?),
            "c" | "trace" if !o.is_shape() => self.trace_workload(vocab),
            "c" | "trace" => bail!("--workload {w}: only `c=N` applies to a trace"),
            "burst" if !o.is_shape() => self.burst_workload(vocab),
            "burst" => bail!("--workload {w}: only `c=N` applies to a burst"),
            other => bail!("--workload: unknown {other:?} (a, b, c or burst)"),
        }
    }

    /// `--burst` requests sharing one `--system-tokens` prompt (distinct `--question-tokens`
    /// questions), all at offset 0: a cold burst (every policy starts on reset caches).
    fn burst_workload(&self, vocab: &Vocab) -> Result<Workload> {
        let w = SharedPrefix {
            groups: 1,
            prompts_per_group: self.burst.unwrap_or(DEFAULT_BURST),
            ..self.shared_prefix()?
        }
        .build(vocab)?;
        let requests = w
            .requests
            .into_iter()
            .map(|r| loxi_bench::workload::WorkRequest {
                at: Duration::ZERO,
                ..r
            })
            .collect();
        Ok(Workload::new("burst", requests))
    }

    fn trace_workload(&self, vocab: &Vocab) -> Result<Workload> {
        let records = match &self.trace {
            Some(p) => read_trace(p)?,
            None => {
                let synth = SynthTrace {
                    requests: self.total_requests(),
                    documents: 12,
                    doc_blocks: 5,
                    max_unique_blocks: 1,
                    block_tokens: self.trace_block_tokens,
                    output_length: self.output_tokens,
                    arrival: self.arrival()?,
                    seed: self.seed,
                };
                let recs = synth.generate();
                let path = self.out.join("synthetic-trace.jsonl");
                write_trace(&path, &recs).with_context(|| path.display().to_string())?;
                recs
            }
        };
        let replay = TraceReplay {
            block_tokens: self.trace_block_tokens,
            max_prompt_tokens: self.trace_max_prompt,
            max_output_tokens: self.trace_max_output(),
            arrival: None,
            speedup: self.trace_speedup,
            seed: self.seed,
        };
        Ok(replay.build(vocab, &records)?)
    }

    fn policies(&self) -> Vec<String> {
        let mut p = self.policies.clone();
        p.extend(self.laws.iter().map(|l| format!("kv-{l}")));
        if self.peers {
            p.extend(peers::PEERS.iter().map(|s| s.to_string()));
        }
        p
    }
}

/// `:key=value` overrides of one `--workload` entry.
#[derive(Debug, Default, PartialEq)]
struct Overrides {
    groups: Option<usize>,
    per_group: Option<usize>,
    users: Option<usize>,
    rounds: Option<usize>,
    concurrency: Option<usize>,
    /// Repeat number (only names the run: `a:c=4:run=2`).
    run: Option<usize>,
    /// The overrides as given, `-` between them (`groups6-per_group8-c4`), for the report name.
    label: String,
}

impl Overrides {
    fn is_empty(&self) -> bool {
        self.label.is_empty()
    }

    /// Overrides of the workload's shape (all but `c`).
    fn is_shape(&self) -> bool {
        self.groups.is_some()
            || self.per_group.is_some()
            || self.users.is_some()
            || self.rounds.is_some()
    }
}

/// Splits `a:groups=6:c=4` into the workload letter and its overrides; values must be ≥ 1.
fn parse_workload(spec: &str) -> Result<(String, Overrides)> {
    let mut parts = spec.split(':');
    let w = parts.next().unwrap_or_default().to_string();
    let mut o = Overrides::default();
    let mut label = Vec::new();
    for kv in parts {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--workload {spec}: {kv:?} is not key=value"))?;
        let n: usize = v
            .parse()
            .ok()
            .filter(|n| *n >= 1)
            .with_context(|| format!("--workload {spec}: {k}={v:?} is not an integer ≥ 1"))?;
        let slot = match k {
            "groups" => &mut o.groups,
            "per_group" => &mut o.per_group,
            "users" => &mut o.users,
            "rounds" => &mut o.rounds,
            "c" => &mut o.concurrency,
            // A repeat of the same workload, reported under its own name.
            "run" => &mut o.run,
            _ => bail!(
                "--workload {spec}: unknown override {k:?} (groups, per_group, users, rounds, c, run)"
            ),
        };
        *slot = Some(n);
        label.push(format!("{k}{n}"));
    }
    o.label = label.join("-");
    Ok((w, o))
}

fn plan(args: &Args, tokenizer_root: &Path, model_dir: &Path) -> Result<Plan> {
    let bins = args.fleet.bin_dir()?;
    let real_vllm = args.real_vllm(model_dir)?;
    for b in ["vllm-sim", "loxilb", "loxicmd"] {
        if b == "vllm-sim" && real_vllm.is_some() {
            continue;
        }
        if !bins.join(b).exists() {
            bail!(
                "{} not found (build with scripts/setup.sh or pass --bin-dir)",
                bins.join(b).display()
            );
        }
    }
    Ok(Plan {
        out: args.out.clone(),
        fleet: FleetSpec {
            bin: bins.join("vllm-sim"),
            workers: args.fleet.workers,
            model: args.fleet.model.clone(),
            tokenizer_dir: tokenizer_root.to_path_buf(),
            block_size: args.block_size,
            num_gpu_blocks: args.gpu_blocks(),
            max_num_seqs: args.max_num_seqs,
            time_scale: args.time_scale(),
            hash_seed: args.hash_seed.clone(),
            hash_algo: "sha256_cbor".into(),
            real_vllm,
        },
        gateway: GatewaySpec {
            loxilb: bins.join("loxilb"),
            loxicmd: bins.join("loxicmd"),
            tokenizer_dir: tokenizer_root.to_path_buf(),
            hash_seed: args.hash_seed.clone(),
            hash_algo: "sha256_cbor".into(),
            block_size: args.block_size,
            pin_cpu: None,
        },
        policies: args.policies(),
        venv: args.venv.clone().unwrap_or_else(default_venv),
        request_timeout: Duration::from_secs(args.request_timeout_s),
        replicas: args.replicas,
        concurrency: args.concurrency,
    })
}

fn write_outputs(out: &Path, results: &[WorkloadResult]) -> Result<String> {
    let mut md = String::new();
    let mut summary = Vec::new();
    for (i, w) in results.iter().enumerate() {
        md.push_str(&report::markdown(
            &w.workload,
            &w.results,
            w.oracle_hit_rate,
        ));
        md.push_str(&excluded_line(w));
        md.push('\n');
        for mut e in report::summary_json(&w.results)
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            e["workload"] = serde_json::json!(w.workload);
            e["excluded_requests"] = serde_json::json!(w.excluded_requests);
            summary.push(e);
        }
        let title = format!("Workload {}", w.workload);
        chart::draw(
            &out.join(&w.workload).join("chart.png"),
            &title,
            &w.results,
            w.oracle_hit_rate,
        )
        .map_err(anyhow::Error::msg)?;
        if i == 0 {
            chart::draw(
                &out.join("chart.png"),
                &title,
                &w.results,
                w.oracle_hit_rate,
            )
            .map_err(anyhow::Error::msg)?;
        }
    }
    report::write(out, "results.md", &md).map_err(anyhow::Error::msg)?;
    report::write(
        out,
        "summary.json",
        &serde_json::to_string_pretty(&summary)?,
    )
    .map_err(anyhow::Error::msg)?;
    report::write(out, "report.json", &serde_json::to_string_pretty(results)?)
        .map_err(anyhow::Error::msg)?;
    Ok(md)
}

/// The results.md line on requests left out of the run and of the oracle.
fn excluded_line(w: &WorkloadResult) -> String {
    if w.excluded_requests == 0 {
        return format!(
            "- {} requests sent; none excluded (every prompt plus its output fits a worker's KV cache).\n",
            w.requests
        );
    }
    format!(
        "- {} requests sent; {} excluded from the run and from the oracle: prompt plus output beyond a worker's KV cache (raise --num-gpu-blocks or lower --trace-max-prompt).\n",
        w.requests, w.excluded_requests
    )
}

/// Resolves on SIGINT or SIGTERM (children are killed when their handles drop on return).
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    args.check()?;
    // The chart needs a font: refuse now rather than after minutes of benchmark.
    chart::locate_font()?;
    std::fs::create_dir_all(&args.out).with_context(|| args.out.display().to_string())?;
    let model_dir = args
        .fleet
        .model_dir
        .clone()
        .unwrap_or_else(|| shared_dir().join("golden/tiny-model"));
    let vocab = Vocab::from_tokenizer_json(&model_dir.join("tokenizer.json"))?;
    let tok_root = args.out.join("tokenizers");
    stage_tokenizer(&model_dir, &tok_root, &args.fleet.model).map_err(anyhow::Error::msg)?;
    let tok_root = std::fs::canonicalize(&tok_root)?;
    let plan = plan(&args, &tok_root, &model_dir)?;
    let workloads = args.workloads(&vocab)?;
    let results = tokio::select! {
        r = execute(&plan, &workloads) => r.map_err(anyhow::Error::msg)?,
        sig = stop_signal() => bail!("interrupted by {sig}; workers and routers stopped"),
    };
    let md = write_outputs(&args.out, &results)?;
    // results.md holds the tables and each workload's verdict lines: printed once, here.
    println!("{md}");
    let out = std::fs::canonicalize(&args.out)?;
    println!(
        "summary: {}/summary.json\nchart:   {}/chart.png\ntables:  {}/results.md",
        out.display(),
        out.display(),
        out.display()
    );
    println!(
        "metrics: {}/<workload>/metrics/ (workers' /metrics and loxilb's /netlox/v1/metrics after each policy)",
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_that_would_do_nothing_are_refused() {
        let check = |argv: &[&str]| {
            let mut all = vec!["bench-routing"];
            all.extend_from_slice(argv);
            Args::try_parse_from(all)
                .map_err(anyhow::Error::from)?
                .check()
        };
        assert!(check(&["--workload", "burst", "--burst", "32"]).is_ok());
        assert!(check(&["--workload", "burst"]).is_ok());
        let e = check(&["--workload", "a", "--burst", "32"]).expect_err("burst without burst");
        assert!(e.to_string().contains("--burst"), "{e}");
        assert!(check(&["--workload", "burst", "--burst", "0"]).is_err());
        assert!(check(&["--policies", "rr,kv", "--replicas", "2"]).is_ok());
        let e = check(&["--policies", "direct", "--replicas", "2"]).expect_err("no loxi policy");
        assert!(e.to_string().contains("--replicas 2"), "{e}");
        assert!(check(&["--replicas", "0"]).is_err());
    }

    #[test]
    fn workload_overrides_parse_and_name_the_run() {
        let (w, o) = parse_workload("a:groups=6:per_group=16:c=16").unwrap_or_default();
        assert_eq!(w, "a");
        assert_eq!(o.groups, Some(6));
        assert_eq!(o.per_group, Some(16));
        assert_eq!(o.concurrency, Some(16));
        assert_eq!(o.label, "groups6-per_group16-c16");
        assert!(o.is_shape());
        let (w, o) = parse_workload("b").unwrap_or_default();
        assert_eq!((w.as_str(), o.is_empty()), ("b", true));
        let (_, o) = parse_workload("c:c=4").unwrap_or_default();
        assert!(!o.is_shape());
        assert_eq!(o.concurrency, Some(4));
        for bad in ["a:groups=0", "a:c", "a:speed=2", "a:c=x"] {
            assert!(parse_workload(bad).is_err(), "{bad}");
        }
    }
}
