//! The fullproxy's connection workers: one thread per worker, each running its own
//! single-threaded tokio runtime (`--proxy-workers`, `LOXI_PROXY_WORKERS`).
//!
//! The listeners still accept on the daemon's shared runtime, but every accepted client
//! connection is handed to the worker serving the fewest open connections and lives there to the
//! end: its TLS handshake, its requests, the upstream connections they open (the cleartext
//! HTTP/1.1 pool keeps one idle list per worker, see `upstream_h1.rs`) and their timers. A
//! request's socket reads and writes, its wake-ups and its upstream exchange then stay on one
//! thread, as in nginx's worker processes: no task moves between threads, no cross-thread wake-up
//! per request. On the shared work-stealing runtime the same request path cost ~15 % more CPU
//! per request in `scripts/bench-proxy.sh` (see `docs/architecture.md`).
//!
//! The price is the one nginx pays: a connection's requests share its worker's thread, so CPU
//! work done inline in a request delays the other connections of that worker instead of moving
//! them to another thread. Inline today: parsing the request's JSON body (bounded by the rule's
//! body limit; a 64 KiB prompt parses in tens of µs) and the selection ladders' own work
//! (`routing::ladder::off_reactor`, the P/D ladder). Tokenizing and block hashing for KV
//! routing, single-pool and P/D tier 1.5 alike, are not inline: they run on their own bounded
//! pool within the tier's time budget.
//!
//! Not per worker: the pooled hyper-util clients (HTTP/2 and TLS upstreams, the P/D prefill and
//! decode legs) are shared by all workers, so a connection one worker opened may carry another
//! worker's request and its reads are then woken across threads, as on the shared runtime. And
//! all streams of one HTTP/2 client connection are served by the one worker that holds it: a
//! client that multiplexes everything over a single connection uses one core. For such clients
//! `--proxy-workers 0` keeps connections, and their streams, on the shared work-stealing
//! runtime.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::runtime::Handle;

/// Metric name: open client connections per connection worker.
pub const WORKER_CONNECTIONS: &str = "loxilb_proxy_worker_connections";

thread_local! {
    /// This thread's worker number (1-based); 0 on every other thread.
    static WORKER: Cell<usize> = const { Cell::new(0) };
}

/// The worker number of the calling thread: `1..=n` on a proxy worker, 0 elsewhere (the
/// shared runtime, tests). Used to keep per-worker state, e.g. idle upstream connections, on
/// the thread whose runtime owns their sockets.
pub fn current() -> usize {
    WORKER.with(Cell::get)
}

/// Makes the calling thread count as worker `i` (tests of per-worker state).
#[cfg(test)]
pub(crate) fn pretend(i: usize) {
    WORKER.with(|w| w.set(i));
}

/// A started set of connection workers.
pub struct Workers {
    handles: Vec<Handle>,
    /// Open client connections per worker (index = worker number − 1).
    open: Vec<AtomicUsize>,
    /// One per worker: dropped with the set, which ends the worker's runtime (its remaining
    /// tasks are dropped) and its thread.
    _stop: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers").field("open", &self.open).finish()
    }
}

impl Workers {
    /// Starts `n` (≥ 1) worker threads named `loxi-proxy-{i}`, each with a current-thread
    /// runtime (I/O and timers enabled) that runs until the set is dropped (the last
    /// `Arc<Workers>`, including every [`Seat`], is gone): then each runtime drops the tasks it
    /// still holds and its thread ends.
    ///
    /// # Errors
    /// The OS refused a thread or a runtime could not be built (the error names which).
    pub fn start(n: usize) -> std::io::Result<Arc<Self>> {
        let mut handles = Vec::with_capacity(n);
        let mut stops = Vec::with_capacity(n);
        for i in 1..=n.max(1) {
            let (tx, rx) = std::sync::mpsc::channel();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("loxi-proxy-{i}"))
                .spawn(move || {
                    WORKER.with(|w| w.set(i));
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    match rt {
                        Ok(rt) => {
                            let _ = tx.send(Ok(rt.handle().clone()));
                            // Ends when the sender is dropped with the set.
                            let _ = rt.block_on(stopped);
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                })?;
            let handle = rx.recv().map_err(|_| {
                std::io::Error::other(format!("proxy worker {i} exited while starting"))
            })??;
            handles.push(handle);
            stops.push(stop);
        }
        let open = handles.iter().map(|_| AtomicUsize::new(0)).collect();
        Ok(Arc::new(Self {
            handles,
            open,
            _stop: stops,
        }))
    }

    /// How many workers run.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Always false: a set has at least one worker.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The worker with the fewest open connections (the lowest number on a tie), its runtime
    /// and a seat that counts the connection there until dropped.
    pub fn pick(self: &Arc<Self>) -> (Handle, Seat) {
        let i = (0..self.open.len())
            .min_by_key(|&i| self.open[i].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.open[i].fetch_add(1, Ordering::Relaxed);
        (
            self.handles[i].clone(),
            Seat {
                workers: self.clone(),
                index: i,
            },
        )
    }

    /// Open connections per worker, in worker order.
    pub fn open(&self) -> Vec<usize> {
        self.open
            .iter()
            .map(|o| o.load(Ordering::Relaxed))
            .collect()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: String,
}

/// `loxilb_proxy_worker_connections{worker}` (worker = 1..=n), read at scrape time: how the
/// open client connections are spread over the workers.
#[derive(Debug)]
pub struct WorkersCollector(Arc<Workers>);

impl WorkersCollector {
    /// Registers the gauge family of `workers` in `registry`.
    pub fn register(registry: &mut Registry, workers: Arc<Workers>) {
        registry.register_collector(Box::new(Self(workers)));
    }
}

impl Collector for WorkersCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            WORKER_CONNECTIONS,
            "Open client connections served by each fullproxy connection worker",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for (i, n) in self.0.open().into_iter().enumerate() {
            let labels = WorkerLabel {
                worker: (i + 1).to_string(),
            };
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// A connection's place on its worker; dropping it frees the place.
#[derive(Debug)]
pub struct Seat {
    workers: Arc<Workers>,
    index: usize,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.workers.open[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_run_tasks_on_their_own_numbered_threads() {
        let w = Workers::start(2).expect("start");
        assert_eq!(w.len(), 2);
        let (h, seat) = w.pick();
        let (tx, rx) = std::sync::mpsc::channel();
        h.spawn(async move {
            let name = std::thread::current().name().map(str::to_owned);
            tx.send((name, current())).expect("send");
        });
        let (name, n) = rx.recv().expect("the task ran");
        assert_eq!(name.as_deref(), Some("loxi-proxy-1"));
        assert_eq!(n, 1);
        assert_eq!(current(), 0, "the test thread is no worker");
        drop(seat);
    }

    #[test]
    fn dropping_the_set_ends_the_workers_runtimes_and_their_tasks() {
        /// Sends on drop: tells the test its task was dropped with the runtime.
        struct Tell(std::sync::mpsc::Sender<()>);
        impl Drop for Tell {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let w = Workers::start(2).expect("start");
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (h, seat) = w.pick();
            let tell = Tell(tx.clone());
            h.spawn(async move {
                let _tell = tell;
                std::future::pending::<()>().await;
            });
            drop(seat);
        }
        drop(tx);
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200))
                .is_err(),
            "the tasks run while the set lives"
        );
        drop(w);
        for _ in 0..2 {
            rx.recv_timeout(std::time::Duration::from_secs(5))
                .expect("each runtime dropped its pending task");
        }
    }

    #[test]
    fn pick_takes_the_least_loaded_worker_and_a_dropped_seat_frees_its_place() {
        let w = Workers::start(3).expect("start");
        let mut seats: Vec<Seat> = (0..4).map(|_| w.pick().1).collect();
        assert_eq!(
            seats.iter().map(|s| s.index).collect::<Vec<_>>(),
            [0, 1, 2, 0]
        );
        assert_eq!(w.open(), [2, 1, 1]);
        drop(seats.remove(1));
        assert_eq!(w.open(), [2, 0, 1]);
        assert_eq!(w.pick().1.index, 1);
        assert_eq!(w.open(), [2, 0, 1], "the temporary seat was dropped");
    }
}
