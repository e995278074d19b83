//! Engine timing and scheduling on tokio's paused clock: simulated times are exact.

use std::sync::Arc;

use clap::Parser;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use super::{Command, Engine, EngineParts};
use crate::block_pool::BlockPool;
use crate::config::SimArgs;
use crate::events::WireFormat;
use crate::metrics::{CacheConfigLabels, SimMetrics};
use crate::prompt::{PromptCodec, RequestExtras};
use crate::seq::{SeqEvent, SeqRequest, SeqSummary};
use crate::timing::{SimClock, TimingModel};

struct Rig {
    tx: mpsc::UnboundedSender<Command>,
    codec: Arc<PromptCodec>,
}

fn rig(flags: &[&str]) -> Rig {
    let mut argv = vec!["vllm-sim"];
    argv.extend_from_slice(flags);
    let args = SimArgs::parse_from(argv);
    let codec = Arc::new(PromptCodec::new(&args).expect("codec"));
    let mut reg = Registry::default();
    let cache = CacheConfigLabels {
        engine: "0".into(),
        block_size: args.block_size.to_string(),
        num_gpu_blocks: args.num_gpu_blocks.to_string(),
        enable_prefix_caching: "True".into(),
        prefix_caching_hash_algo: args.prefix_caching_hash_algo.clone(),
    };
    let engine = Engine::new(EngineParts {
        pool: BlockPool::new(args.num_gpu_blocks),
        codec: codec.clone(),
        timing: TimingModel::default(),
        clock: SimClock::new(1.0),
        metrics: SimMetrics::register(&mut reg, "tiny", cache),
        publisher: None,
        wire: WireFormat::default(),
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
    });
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(engine.run(rx));
    Rig { tx, codec }
}

impl Rig {
    fn submit(&self, prompt: Vec<u32>, max_tokens: usize) -> mpsc::UnboundedReceiver<SeqEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        let extras = RequestExtras::default();
        let req = SeqRequest {
            prompt_hashes: self.codec.hash_prompt(&prompt, &extras),
            prompt: prompt.into(),
            extras,
            max_tokens,
            remote_prefill: false,
            skip_prefix_cache: false,
            report_all_blocks: false,
            events: tx,
        };
        self.tx.send(Command::Submit(req)).expect("engine running");
        rx
    }
}

async fn finish(mut rx: mpsc::UnboundedReceiver<SeqEvent>) -> (usize, SeqSummary) {
    let mut tokens = 0;
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token(_) => tokens += 1,
            SeqEvent::Done(s) => return (tokens, s),
        }
    }
    panic!("engine dropped the request");
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[tokio::test(start_paused = true)]
async fn ttft_is_the_prefill_step_and_each_further_token_a_decode_step() {
    let r = rig(&[]);
    let (tokens, s) = finish(r.submit((0..100).collect(), 3)).await;
    assert_eq!(tokens, 3);
    assert!(close(s.ttft_s, 0.031), "ttft {}", s.ttft_s);
    assert!(close(s.e2e_s, 0.031 + 2.0 * 0.008), "e2e {}", s.e2e_s);
}

#[tokio::test(start_paused = true)]
async fn a_request_beyond_max_num_seqs_waits_for_a_free_slot() {
    let r = rig(&["--max-num-seqs", "1"]);
    let first = r.submit((0..100).collect(), 2);
    let second = r.submit((1000..1100).collect(), 2);
    let (_, a) = finish(first).await;
    let (_, b) = finish(second).await;
    assert!(close(a.e2e_s, 0.039), "first e2e {}", a.e2e_s);
    assert!(
        close(b.ttft_s, 0.039 + 0.031),
        "second waited for the first: ttft {}",
        b.ttft_s
    );
    assert!(close(b.e2e_s, 0.078), "second e2e {}", b.e2e_s);
}

#[tokio::test(start_paused = true)]
async fn a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() {
    let r = rig(&[
        "--max-num-batched-tokens",
        "1000",
        "--num-gpu-blocks",
        "1000",
    ]);
    let (_, s) = finish(r.submit((0..3300).collect(), 1)).await;
    // 1000, 1000, 1000, 300 tokens: four steps of max(31 ms, n / 33,000 tok/s).
    let want = 3.0 * (1000.0f64 / 33_000.0).max(0.031) + 0.031;
    assert!(close(s.ttft_s, want), "ttft {} want {want}", s.ttft_s);
}

#[tokio::test(start_paused = true)]
async fn a_cache_hit_shortens_ttft_and_is_reported_in_cached_tokens() {
    let r = rig(&["--num-gpu-blocks", "1000"]);
    let prompt: Vec<u32> = (0..6600).collect();
    let (_, cold) = finish(r.submit(prompt.clone(), 1)).await;
    let (_, warm) = finish(r.submit(prompt, 1)).await;
    assert!(close(cold.ttft_s, 0.2), "cold {}", cold.ttft_s);
    assert_eq!(
        warm.cached_tokens, 6592,
        "412 full blocks of 16; the last token is computed"
    );
    assert!(close(warm.ttft_s, 0.031), "warm {}", warm.ttft_s);
}

#[tokio::test(start_paused = true)]
async fn sequences_short_of_blocks_are_preempted_and_still_finish() {
    // 4 usable blocks of 4 tokens; each request grows to ceil((4 + 7) / 4) = 3 blocks.
    let r = rig(&["--block-size", "4", "--num-gpu-blocks", "5"]);
    let a = r.submit(vec![1, 2, 3, 4], 8);
    let b = r.submit(vec![5, 6, 7, 8], 8);
    let ((ta, sa), (tb, sb)) = tokio::join!(finish(a), finish(b));
    assert_eq!((ta, tb), (8, 8));
    assert_eq!((sa.completion_tokens, sb.completion_tokens), (8, 8));
    assert!(sb.e2e_s > sa.e2e_s, "the preempted request finishes later");
}
