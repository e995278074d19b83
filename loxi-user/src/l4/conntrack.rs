//! Reading the XDP conntrack map ([`MAP_CONNTRACK`]) from userspace, for
//! `GET /config/conntrack/all`.
//!
//! The L4 task owns the loaded program; it publishes the conntrack map's kernel id in a
//! [`ConntrackHandle`] once the program is loaded (and withdraws it on shutdown). A reader opens
//! its own file descriptor on the map from that id, so listing never blocks the L4 task.
use std::sync::Arc;

use aya::maps::{HashMap, Map, MapData};
use loxi_common::maps::{CtKey, CtValue, MAP_CONNTRACK};
use parking_lot::Mutex;

use super::L4Error;

/// Most entries one listing returns (the map holds at most
/// [`loxi_common::maps::CT_ENTRIES`], up to two per flow).
pub const CT_LIST_CAP: usize = 65_536;

/// One listing of the conntrack map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CtDump {
    /// Live entries (both directions of every flow; a DNAT flow whose reply entry is deferred
    /// has its forward entry only until its first reply), in map order; idle-expired entries the
    /// data path has not reclaimed yet are left out.
    pub entries: Vec<(CtKey, CtValue)>,
    /// True when the map held more live entries than the cap: `entries` is a prefix.
    pub truncated: bool,
}

/// Where the API finds the loaded conntrack map: empty until the L4 task has loaded the XDP
/// program, and again after it stops. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct ConntrackHandle {
    map_id: Arc<Mutex<Option<u32>>>,
}

impl ConntrackHandle {
    /// Publishes the kernel id of the loaded conntrack map.
    pub fn publish(&self, map_id: u32) {
        *self.map_id.lock() = Some(map_id);
    }

    /// Withdraws the map (the data path stopped).
    pub fn withdraw(&self) {
        *self.map_id.lock() = None;
    }

    /// True while a loaded conntrack map is published.
    pub fn is_live(&self) -> bool {
        self.map_id.lock().is_some()
    }

    /// Lists up to `cap` live entries. Blocking (two syscalls per entry): call it from a
    /// blocking thread. `Ok(None)` when no data path is loaded.
    ///
    /// Errors: [`L4Error::Map`] when the map cannot be opened or read.
    pub fn read(&self, cap: usize) -> Result<Option<CtDump>, L4Error> {
        let Some(id) = *self.map_id.lock() else {
            return Ok(None);
        };
        let err = |e| L4Error::map(MAP_CONNTRACK, e);
        let data = MapData::from_id(id).map_err(err)?;
        let map: HashMap<MapData, CtKey, CtValue> =
            HashMap::try_from(Map::from_map_data(data).map_err(err)?).map_err(err)?;
        let now = monotonic_ns();
        let mut dump = CtDump::default();
        // Entries deleted while we walk can make the kernel restart the walk from the first
        // key; the seen-set drops the repeats and the step bound ends the walk regardless.
        let mut seen = std::collections::HashSet::new();
        let mut steps = 0usize;
        for item in map.iter() {
            steps += 1;
            if steps > cap.saturating_mul(2).max(1024) {
                break;
            }
            let (k, v) = match item {
                Ok(kv) => kv,
                // Removed between "next key" and "lookup": skip it.
                Err(_) => continue,
            };
            if expired(&v, now) || !seen.insert(k) {
                continue;
            }
            if dump.entries.len() == cap {
                dump.truncated = true;
                break;
            }
            dump.entries.push((k, v));
        }
        Ok(Some(dump))
    }
}

/// True when the entry has been idle longer than its timeout (the data path's own test, see
/// `loxi-ebpf/src/ct.rs`), so a stale entry is not listed as a live flow.
pub fn expired(v: &CtValue, now_ns: u64) -> bool {
    now_ns.saturating_sub(v.last_ns) > u64::from(v.timeout_s) * 1_000_000_000
}

/// `CLOCK_MONOTONIC` in ns: the clock of `bpf_ktime_get_coarse_ns()` (which lags it by at most
/// a scheduler tick, nothing next to idle timeouts of seconds).
#[allow(
    unsafe_code,
    reason = "clock_gettime(2) through libc: the data path's clock has no std equivalent"
)]
pub(super) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}
