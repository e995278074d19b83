//! The global in-flight valve (`LLB_PD_MAX_TOTAL_INFLIGHT`, LoxiLB's "global valve — refuse new
//! connections beyond this"): one count of requests in flight across every mode-4 listener.
//! A request that would exceed the limit is refused at once, before its body is read, with 429
//! `pd_overloaded` and `Retry-After: 1` ([`super::error::ProxyError::Overloaded`]); nothing is
//! queued. A request counts from its head until its response body ends (or fails, or the
//! client goes away). 0 turns the valve off.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Shared by every listener of the daemon.
#[derive(Debug)]
pub struct Valve {
    limit: u64,
    in_flight: AtomicU64,
}

impl Valve {
    /// A valve admitting at most `limit` requests at once; 0 = unlimited.
    pub fn new(limit: u32) -> Arc<Self> {
        Arc::new(Self {
            limit: u64::from(limit),
            in_flight: AtomicU64::new(0),
        })
    }

    /// The configured limit (0 = off).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Requests currently admitted.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Admits one request, or `None` when `limit` are already in flight.
    pub fn try_admit(self: &Arc<Self>) -> Option<Admitted> {
        let admitted = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (self.limit == 0 || n < self.limit).then_some(n + 1)
            })
            .is_ok();
        admitted.then(|| Admitted {
            valve: self.clone(),
        })
    }
}

/// One admitted request; releases its place when dropped.
#[derive(Debug)]
pub struct Admitted {
    valve: Arc<Valve>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.valve.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_frees_on_drop() {
        let v = Valve::new(2);
        let a = v.try_admit().expect("first");
        let _b = v.try_admit().expect("second");
        assert!(v.try_admit().is_none(), "third is refused");
        assert_eq!(v.in_flight(), 2);
        drop(a);
        assert!(v.try_admit().is_some(), "a freed place is reused");
    }

    #[test]
    fn zero_is_unlimited() {
        let v = Valve::new(0);
        let held: Vec<_> = (0..10_000).filter_map(|_| v.try_admit()).collect();
        assert_eq!(held.len(), 10_000);
    }
}
