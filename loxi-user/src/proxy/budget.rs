//! The request-body bytes every fullproxy listener holds at once (issue 9 §1: the total across
//! requests is bounded, not only each body). A request reserves the body bytes it has
//! received, as they arrive (whole KiB; never by a declared `Content-Length`, which a client
//! that sends nothing could otherwise use to hold the budget), and keeps the reservation until
//! its upstream answered. A body's first bytes may wait for budget (holding none meanwhile; the
//! wait counts against the body read timeout, `LOXI_BODY_TIMEOUT_MS`, 408). A body that holds
//! part of the budget and finds the rest spent waits for it only if it is the eldest holder
//! (the first of the bodies now holding budget to have got it), and for at most
//! [`ELDEST_WAIT`]; any other is refused at once (503 `body_budget_exhausted`). Younger
//! holders never wait, so they release what they hold and the eldest proceeds: concurrent
//! uploads can neither deadlock (each holding a part and waiting for the others') nor all be
//! refused together. The bound covers budget held by requests whose bodies are read and whose
//! upstream has not answered yet (a long generation): the eldest is then refused too, instead
//! of holding its part, and the bodies queued behind it, until the body timeout. A body larger
//! than the whole budget gets through alone.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use tokio::sync::{Semaphore, SemaphorePermit};

/// Default budget: 256 MiB of request bodies at once.
pub const DEFAULT_BODY_BYTES_IN_FLIGHT: u64 = 256 << 20;

/// How long the eldest holder waits for more budget before it is refused as the others are.
pub const ELDEST_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Shared budget of request-body bytes, in KiB permits (clones share it).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    sem: Arc<Semaphore>,
    total_kib: u32,
    /// Order of first reservation of the bodies now holding budget (see [`Holder`]).
    holders: Arc<Holders>,
}

/// The tickets of the bodies holding budget, one set per connection worker (index
/// [`super::workers::current`] modulo the count; 0 for threads that are no worker): a
/// request's ticket is added and removed on its own worker's set, so the lock and the set's
/// nodes stay in that worker's cache (one set shared by all workers was ~2 % of the proxy's
/// CPU under load, most of it those lines moving between cores). Only the rare eldest check
/// reads every set.
#[derive(Debug)]
struct Holders {
    next: AtomicU64,
    live: Box<[Shard]>,
}

/// One worker's set of tickets, on a cache line (two, for adjacent-line prefetch) of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<BTreeSet<u64>>);

impl Holders {
    /// Sets for the connection workers this machine can have (one per CPU) and one more for
    /// other threads; a larger worker index shares a set (correct, only less local).
    fn new() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        Self {
            next: AtomicU64::new(0),
            live: (0..=cpus.min(64)).map(|_| Shard::default()).collect(),
        }
    }

    /// The set of the calling thread.
    fn shard(&self) -> usize {
        super::workers::current() % self.live.len()
    }
}

impl BodyBudget {
    /// A budget of `bytes` (`LOXI_MAX_BODY_BYTES_IN_FLIGHT`; at least 1 KiB).
    pub fn new(bytes: u64) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .max(1);
        Self {
            sem: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            holders: Arc::new(Holders::new()),
        }
    }

    /// The budget in bytes.
    pub fn bytes(&self) -> u64 {
        u64::from(self.total_kib) * 1024
    }

    /// Bytes not reserved now.
    pub fn available(&self) -> u64 {
        self.sem.available_permits() as u64 * 1024
    }

    /// Waits until `bytes` (rounded up to KiB, at most the whole budget, so one body larger
    /// than the budget still gets through alone) can be reserved. Only for a caller that holds
    /// none of the budget (see [`Self::try_grow`]).
    pub async fn reserve(&self, bytes: usize) -> Reservation<'_> {
        let kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .min(self.total_kib);
        let permit = if kib == 0 {
            None
        } else {
            self.sem.acquire_many(kib).await.ok()
        };
        let holder = permit.as_ref().map(|_| Holder::new(&self.holders));
        Reservation { permit, holder }
    }

    /// Adds `bytes` (rounded up to KiB) to `held`: at once when the budget has them; else, if
    /// `held` is the eldest holder, waits for them up to [`ELDEST_WAIT`]; else (or when that
    /// wait ends) false, `held` unchanged. A `held` that holds nothing reserves
    /// as [`Self::reserve`] does. Never grows `held` past the whole budget.
    pub async fn grow<'a>(&'a self, held: &mut Reservation<'a>, bytes: usize) -> bool {
        if held.kib() == 0 {
            *held = self.reserve(bytes).await;
            return true;
        }
        if self.try_grow(held, bytes) {
            return true;
        }
        if !held.holder.as_ref().is_some_and(Holder::is_eldest) {
            return false;
        }
        let kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .min(self.total_kib.saturating_sub(held.kib()));
        match tokio::time::timeout(ELDEST_WAIT, self.sem.acquire_many(kib)).await {
            Ok(Ok(p)) => {
                held.merge(Reservation {
                    permit: Some(p),
                    holder: None,
                });
                true
            }
            Ok(Err(_)) | Err(_) => false,
        }
    }
}

impl BodyBudget {
    /// Adds `bytes` (rounded up to KiB) to `held` if the budget has them now, without waiting;
    /// `held` never grows past the whole budget (a body larger than the budget holds all of
    /// it). False when the budget cannot cover them now (`held` unchanged).
    pub fn try_grow<'a>(&'a self, held: &mut Reservation<'a>, bytes: usize) -> bool {
        let kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        let kib = kib.min(self.total_kib.saturating_sub(held.kib()));
        if kib == 0 {
            return true;
        }
        match self.sem.try_acquire_many(kib) {
            Ok(p) => {
                held.merge(Reservation {
                    permit: Some(p),
                    holder: None,
                });
                true
            }
            Err(_) => false,
        }
    }
}

/// A body's place in the order of first reservation while it holds budget; removed on drop.
#[derive(Debug)]
struct Holder<'a> {
    ticket: u64,
    /// The set the ticket is in (the worker's that reserved: a request's future may be
    /// dropped on another thread).
    shard: usize,
    holders: &'a Holders,
}

impl<'a> Holder<'a> {
    fn new(holders: &'a Holders) -> Self {
        let ticket = holders.next.fetch_add(1, Ordering::Relaxed);
        let shard = holders.shard();
        holders.live[shard].0.lock().insert(ticket);
        Self {
            ticket,
            shard,
            holders,
        }
    }

    /// True when no body holding budget got it before this one (reads every worker's set).
    fn is_eldest(&self) -> bool {
        self.holders
            .live
            .iter()
            .all(|s| s.0.lock().first().is_none_or(|&t| t >= self.ticket))
    }
}

impl Drop for Holder<'_> {
    fn drop(&mut self) {
        self.holders.live[self.shard].0.lock().remove(&self.ticket);
    }
}

impl Default for BodyBudget {
    fn default() -> Self {
        Self::new(DEFAULT_BODY_BYTES_IN_FLIGHT)
    }
}

/// Bytes reserved in a [`BodyBudget`]; released on drop.
/// Borrows the budget (no reference count taken per request).
#[derive(Debug, Default)]
pub struct Reservation<'a> {
    permit: Option<SemaphorePermit<'a>>,
    /// Set on a reservation made by [`BodyBudget::reserve`] while it holds budget.
    holder: Option<Holder<'a>>,
}

impl<'a> Reservation<'a> {
    /// KiB held.
    pub fn kib(&self) -> u32 {
        self.permit
            .as_ref()
            .map_or(0, |p| u32::try_from(p.num_permits()).unwrap_or(u32::MAX))
    }

    /// Adds `other` to this reservation; the elder of the two places in the order of first
    /// reservation is kept.
    pub fn merge(&mut self, other: Reservation<'a>) {
        match (&mut self.permit, other.permit) {
            (Some(p), Some(o)) => p.merge(o),
            (None, o) => self.permit = o,
            (Some(_), None) => {}
        }
        match (&self.holder, other.holder) {
            (None, h) => self.holder = h,
            (Some(mine), Some(h)) if h.ticket < mine.ticket => self.holder = Some(h),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_body_waits_while_the_budget_is_spent_and_gets_it_when_freed() {
        let b = BodyBudget::new(1 << 20);
        let first = b.reserve(600 << 10).await;
        assert_eq!(b.available(), (1 << 20) - (600 << 10));
        let waiting = tokio::time::timeout(Duration::from_millis(50), b.reserve(600 << 10)).await;
        assert!(waiting.is_err(), "600 KiB more do not fit in 1 MiB");
        drop(first);
        let mut second = tokio::time::timeout(Duration::from_secs(5), b.reserve(600 << 10))
            .await
            .expect("fits once the first is released");
        second.merge(b.reserve(1).await);
        assert_eq!(b.available(), (1 << 20) - (601 << 10));
        drop(second);
        // Larger than the whole budget: reserves all of it rather than waiting for ever.
        let huge = b.reserve(8 << 20).await;
        assert_eq!(b.available(), 0);
        drop(huge);
        assert_eq!(b.available(), b.bytes());
    }

    #[tokio::test]
    async fn growing_never_waits_and_stops_at_the_whole_budget() {
        let b = BodyBudget::new(1 << 20);
        let mut one = b.reserve(512 << 10).await;
        let mut two = b.reserve(256 << 10).await;
        assert!(b.try_grow(&mut two, 200 << 10));
        assert_eq!(two.kib(), 456);
        // 56 KiB left: 100 more do not fit now, and nothing changes.
        assert!(!b.try_grow(&mut one, 100 << 10));
        assert_eq!((one.kib(), b.available()), (512, 56 << 10));
        drop(two);
        // Alone, a body grows up to the whole budget and then on without more permits.
        assert!(b.try_grow(&mut one, 600 << 10));
        assert_eq!((one.kib(), b.available()), (1024, 0));
        assert!(b.try_grow(&mut one, 5 << 20));
        assert_eq!(one.kib(), 1024);
        drop(one);
        assert_eq!(b.available(), b.bytes());
    }

    #[tokio::test]
    async fn when_holders_all_find_the_budget_spent_the_eldest_waits_and_the_others_are_refused() {
        let b = BodyBudget::new(1 << 20);
        let mut first = b.reserve(340 << 10).await;
        let mut second = b.reserve(340 << 10).await;
        let mut third = b.reserve(340 << 10).await;
        // 4 KiB left; each wants 100 more.
        assert!(
            !b.grow(&mut second, 100 << 10).await,
            "younger: refused at once"
        );
        assert!(
            !b.grow(&mut third, 100 << 10).await,
            "younger: refused at once"
        );
        let waiting =
            tokio::time::timeout(Duration::from_millis(50), b.grow(&mut first, 100 << 10));
        assert!(
            waiting.await.is_err(),
            "the eldest waits rather than being refused"
        );
        assert_eq!(first.kib(), 340);
        drop(second);
        let grew = tokio::time::timeout(Duration::from_secs(5), b.grow(&mut first, 100 << 10))
            .await
            .expect("the eldest gets the budget a refused body released");
        assert!(grew);
        assert_eq!(first.kib(), 440);
        drop(first);
        // The third is now the eldest holder.
        assert!(b.grow(&mut third, 600 << 10).await);
        assert_eq!((third.kib(), b.available()), (940, 84 << 10));
        drop(third);
        assert_eq!(b.available(), b.bytes());
    }

    #[tokio::test]
    async fn the_eldest_is_found_across_the_workers_sets_and_each_ticket_leaves_its_own() {
        let b = BodyBudget::new(1 << 20);
        assert!(
            b.holders.live.len() >= 2,
            "a set for other threads and one per CPU"
        );
        super::super::workers::pretend(1);
        let mut on_one = b.reserve(512 << 10).await;
        super::super::workers::pretend(2 % b.holders.live.len());
        let mut on_two = b.reserve(400 << 10).await;
        super::super::workers::pretend(0);
        let tickets = |b: &BodyBudget| -> Vec<Vec<u64>> {
            b.holders
                .live
                .iter()
                .map(|s| s.0.lock().iter().copied().collect())
                .collect()
        };
        let sets = tickets(&b);
        assert_eq!(sets[1], vec![0], "the first ticket is in worker 1's set");
        assert_eq!(sets[2 % sets.len()].last(), Some(&1));
        // 112 KiB left: the younger holder (on another worker's set) is refused at once, the
        // elder one (found as eldest though its ticket is in another set) waits and gets it.
        let refused = tokio::time::timeout(
            std::time::Duration::from_millis(500),
            b.grow(&mut on_two, 200 << 10),
        )
        .await
        .expect("refused at once: it is not the eldest, whatever its own set holds");
        assert!(!refused);
        let (grew, ()) = tokio::join!(b.grow(&mut on_one, 200 << 10), async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            drop(on_two);
        });
        assert!(grew, "the eldest waits for the budget the other releases");
        assert_eq!(on_one.kib(), 712);
        drop(on_one);
        assert_eq!(
            tickets(&b).concat(),
            Vec::<u64>::new(),
            "every ticket left its set"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_eldest_waits_at_most_eldest_wait_for_budget_held_elsewhere() {
        let b = BodyBudget::new(1 << 20);
        let mut first = b.reserve(512 << 10).await;
        // Read and waiting for its upstream: holds its part for as long as that takes.
        let answered_later = b.reserve(512 << 10).await;
        let t = tokio::time::Instant::now();
        assert!(
            !b.grow(&mut first, 100 << 10).await,
            "refused once the wait ends"
        );
        assert!(t.elapsed() >= ELDEST_WAIT, "{:?}", t.elapsed());
        assert_eq!((first.kib(), b.available()), (512, 0));
        drop(answered_later);
        assert!(b.grow(&mut first, 100 << 10).await);
        assert_eq!(first.kib(), 612);
    }
}
