//! The KV tier's tokenization pool (issue 9 §1, §2): a fixed number of OS threads and a
//! bounded queue, so the tier's CPU work never runs on a runtime thread and its backlog never
//! grows without bound.
//!
//! - [`TokenizeWorkers::submit`] queues a job or refuses at once when the queue is full (the
//!   request then misses with `overload`); it never blocks.
//! - A worker skips a job whose requester stopped waiting (its decision budget ran out or the
//!   client left) or whose deadline passed while queued, so a backlog drains at the cost of a
//!   check per job, not a tokenization.
//! - A job that started runs to its end (the tokenizer cannot be interrupted); its work is
//!   bounded by the prompt bounds (`PromptBounds`), and its result still fills the tokenizer's
//!   caches for the next turn of the conversation.
//!
//! Dropping the pool closes the queue; the threads finish their current job and exit (they are
//! joined on drop).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// One queued piece of work: run it unless its requester is gone or its deadline passed.
struct Job {
    deadline: Instant,
    run: Box<dyn FnOnce(Instant) -> bool + Send>,
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

/// Counts of the pool's work since start (tests and the benchmark read them).
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Jobs queued and not yet taken by a worker.
    pub queued: AtomicUsize,
    /// Jobs run to their end.
    pub ran: AtomicUsize,
    /// Jobs skipped: requester gone or deadline passed before a worker took them.
    pub skipped: AtomicUsize,
}

/// A fixed-size pool of tokenization threads with a bounded queue.
pub struct TokenizeWorkers {
    tx: Option<SyncSender<Job>>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<WorkerStats>,
}

impl TokenizeWorkers {
    /// Starts `threads` workers (at least 1) over a queue of `queue` jobs (at least 1).
    pub fn new(threads: usize, queue: usize) -> Self {
        let (tx, rx) = sync_channel::<Job>(queue.max(1));
        let rx = Arc::new(Mutex::new(rx));
        let stats = Arc::new(WorkerStats::default());
        let threads = (0..threads.max(1))
            .filter_map(|i| {
                let (rx, stats) = (rx.clone(), stats.clone());
                std::thread::Builder::new()
                    .name(format!("kv-tokenize-{i}"))
                    .spawn(move || work(&rx, &stats))
                    .map_err(|e| tracing::error!(error = %e, "cannot start a tokenization thread"))
                    .ok()
            })
            .collect();
        Self {
            tx: Some(tx),
            threads,
            stats,
        }
    }

    /// The pool's counters.
    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// Queues `f` to run on a worker before `deadline`; the receiver gets its result. Refused
    /// at once when the queue is full or no worker runs. The job is skipped (the receiver sees
    /// a closed channel) when the receiver is dropped or `deadline` passes before a worker
    /// takes it.
    pub fn submit<R: Send + 'static>(
        &self,
        deadline: Instant,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<oneshot::Receiver<R>, QueueFull> {
        let Some(tx) = self.tx.as_ref().filter(|_| !self.threads.is_empty()) else {
            return Err(QueueFull);
        };
        let (rtx, rrx) = oneshot::channel();
        let run = Box::new(move |now: Instant| {
            if rtx.is_closed() || now > deadline {
                return false;
            }
            let _ = rtx.send(f());
            true
        });
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        match tx.try_send(Job { deadline, run }) {
            Ok(()) => Ok(rrx),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                Err(QueueFull)
            }
        }
    }
}

fn work(rx: &Mutex<Receiver<Job>>, stats: &WorkerStats) {
    loop {
        let job = rx.lock().recv();
        let Ok(job) = job else { return };
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        let now = Instant::now();
        let ran = now <= job.deadline && (job.run)(now);
        let counter = if ran { &stats.ran } else { &stats.skipped };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for TokenizeWorkers {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn results_come_back_and_a_full_queue_refuses_at_once() {
        let pool = TokenizeWorkers::new(1, 2);
        let far = Instant::now() + Duration::from_secs(60);
        assert_eq!(pool.submit(far, || 6 * 7).expect("queued").await, Ok(42));
        // Hold the only worker, then fill the queue of 2: the third waiting job is refused.
        let (hold_tx, hold_rx) = mpsc::channel::<()>();
        let busy = pool
            .submit(far, move || hold_rx.recv().is_ok())
            .expect("queued");
        while pool.stats().queued.load(Ordering::Relaxed) > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let a = pool.submit(far, || 1).expect("queued");
        let b = pool.submit(far, || 2).expect("queued");
        assert_eq!(pool.submit(far, || 3).err(), Some(QueueFull));
        hold_tx.send(()).expect("worker waits");
        assert_eq!(busy.await, Ok(true));
        assert_eq!((a.await, b.await), (Ok(1), Ok(2)));
        // The worker counts a job just after handing its result over: wait for the count.
        let until = Instant::now() + Duration::from_secs(5);
        while pool.stats().ran.load(Ordering::Relaxed) < 4 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(pool.stats().ran.load(Ordering::Relaxed), 4);
    }

    #[tokio::test]
    async fn abandoned_and_expired_jobs_are_skipped_without_running() {
        let pool = TokenizeWorkers::new(1, 8);
        let far = Instant::now() + Duration::from_secs(60);
        let (hold_tx, hold_rx) = mpsc::channel::<()>();
        let busy = pool
            .submit(far, move || hold_rx.recv().is_ok())
            .expect("queued");
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        let abandoned = pool
            .submit(far, move || r.fetch_add(1, Ordering::Relaxed))
            .expect("queued");
        drop(abandoned);
        let r = ran.clone();
        let expired = pool
            .submit(Instant::now() + Duration::from_millis(1), move || {
                r.fetch_add(1, Ordering::Relaxed)
            })
            .expect("queued");
        std::thread::sleep(Duration::from_millis(5));
        hold_tx.send(()).expect("worker waits");
        assert_eq!(busy.await, Ok(true));
        assert!(expired.await.is_err(), "an expired job sends nothing");
        assert_eq!(ran.load(Ordering::Relaxed), 0);
        assert_eq!(pool.stats().skipped.load(Ordering::Relaxed), 2);
    }
}
