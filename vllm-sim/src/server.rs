//! Wiring: builds the codec, block pool, metrics, publisher and engine from the flags, binds the
//! HTTP listener and serves until the task is dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::block_pool::BlockPool;
use super::config::SimArgs;
use super::engine::{Engine, EngineParts};
use super::events::WireFormat;
use super::http::{HttpState, handle};
use super::metrics::{CacheConfigLabels, SimMetrics};
use super::prompt::PromptCodec;
use super::publisher::{BoundEndpoints, Publisher};
use super::timing::{SimClock, TimingModel};

/// A started emulator.
#[derive(Debug)]
pub struct RunningSim {
    /// HTTP address actually bound.
    pub http: SocketAddr,
    /// KV-event sockets actually bound, when events are on.
    pub kv_events: Option<BoundEndpoints>,
    /// The accept loop; abort it to stop serving.
    pub task: tokio::task::JoinHandle<()>,
}

impl RunningSim {
    /// The one-line readiness report printed by the binary (`VLLM_SIM_READY http=… pub=…
    /// replay=…`), parsed by tests and scripts.
    pub fn ready_line(&self) -> String {
        let ev = self.kv_events.as_ref();
        format!(
            "VLLM_SIM_READY http={} pub={} replay={}",
            self.http,
            ev.map_or("-", |e| e.publisher.as_str()),
            ev.and_then(|e| e.replay.as_deref()).unwrap_or("-"),
        )
    }
}

/// Validates `args`, starts every part and begins serving.
pub async fn start(args: SimArgs) -> anyhow::Result<RunningSim> {
    args.validate()?;
    let codec = Arc::new(PromptCodec::new(&args)?);
    let (publisher, kv_events) = match args.kv_events()? {
        Some(cfg) => {
            let (p, b) = Publisher::start(&cfg).await?;
            (Some(p), Some(b))
        }
        None => (None, None),
    };
    let mut registry = Registry::default();
    let metrics = SimMetrics::register(&mut registry, &args.model, cache_labels(&args));
    let listener = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let http = listener.local_addr()?;
    let (tx, rx) = mpsc::unbounded_channel();
    let pool = BlockPool::new(args.num_gpu_blocks);
    let capacity_blocks = pool.capacity();
    let engine = Engine::new(EngineParts {
        pool,
        codec: codec.clone(),
        timing: TimingModel {
            prefill_tokens_per_s: args.prefill_tokens_per_s,
            prefill_floor_s: args.prefill_floor_ms / 1000.0,
            decode_step_s: args.decode_step_ms / 1000.0,
        },
        clock: SimClock::new(args.time_scale),
        metrics,
        publisher,
        wire: WireFormat {
            int_hashes: args.int_hashes(),
            legacy_array: args.kv_events_legacy_array,
        },
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
    });
    tokio::spawn(engine.run(rx));
    let state = Arc::new(HttpState {
        model: args.model.clone(),
        codec,
        engine: tx,
        registry,
        capacity_blocks,
        kv_role: args.kv_role,
        advertised: (http.ip().to_string(), http.port()),
        next_id: AtomicU64::new(0),
        log: parking_lot::Mutex::new(std::collections::VecDeque::new()),
    });
    let task = tokio::spawn(accept_loop(listener, state));
    Ok(RunningSim {
        http,
        kv_events,
        task,
    })
}

fn cache_labels(args: &SimArgs) -> CacheConfigLabels {
    CacheConfigLabels {
        engine: "0".into(),
        block_size: args.block_size.to_string(),
        num_gpu_blocks: args.num_gpu_blocks.to_string(),
        enable_prefix_caching: "True".into(),
        prefix_caching_hash_algo: args.prefix_caching_hash_algo.clone(),
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<HttpState>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let st = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(st.clone(), req));
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
}
