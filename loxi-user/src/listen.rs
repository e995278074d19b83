//! The fullproxy's listening sockets, shared by the REST API and the proxy.
//!
//! A mode-4 rule is only worth acknowledging if its `externalIP:port` can be listened on. The
//! API therefore [`ListenSockets::reserve`]s the address *before* the rule is stored: it binds
//! the socket itself and stages it; the proxy then [`ListenSockets::acquire`]s that very socket
//! when it reconciles the new snapshot, so there is no window in which another process can take
//! the port between the check and the listener. An address the proxy already serves (another
//! model pool on the same `VIP:port`) needs no new socket.
//!
//! Rules restored at start are not reserved (nobody is waiting for an answer): when the proxy
//! cannot bind one, the failure is recorded here ([`ListenerStatus::Unbound`], shown as the
//! rule's `listenerState` by `GET .../all`, and the metrics below) and the proxy retries with
//! [`backoff`].
//!
//! Sockets are bound with `SO_REUSEADDR` (like tokio's `TcpListener::bind`, so a restart is not
//! blocked by `TIME_WAIT`) and `IP_FREEBIND`, so a VIP that the L4 task adds to `--vip-iface`
//! a moment later is not a bind error.
//!
//! Each served address also keeps its [`Traffic`] (connections accepted and open, bytes read
//! from and written to clients), which `GET .../protocol/{proto}/stats` reports as LoxiLB's
//! per-rule statistics quad. The counters live while the address is served and start from zero
//! when it is served again (LoxiLB's are in memory too, reset on restart).
//!
//! Metrics (label `address` = `ip:port` of a stored rule, never a client-chosen value):
//! `loxilb_fullproxy_listener_up{address}` (1 listening, 0 unbound and retrying) and
//! `loxilb_fullproxy_listener_bind_failures_total{address}`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub mod plain;

/// Backlog of every fullproxy listening socket.
pub const LISTEN_BACKLOG: i32 = 1024;

/// First retry delay of an unbindable restored listener.
pub const RETRY_FIRST: Duration = Duration::from_secs(1);

/// Longest retry delay of an unbindable restored listener.
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// The delay before retry number `attempt` (1-based): 1 s, 2 s, 4 s, ... capped at 30 s.
pub fn backoff(attempt: u32) -> Duration {
    let shift = attempt.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(1 << shift).min(RETRY_MAX)
}

/// Binds a listening TCP socket on `addr` (non-blocking, `SO_REUSEADDR`, free-bind).
pub fn bind_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_freebind_v6(true)?;
    } else {
        socket.set_freebind_v4(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// What is known about a fullproxy address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenerStatus {
    /// The proxy listens on it (or will in a moment: the API's socket is bound and listening).
    Listening,
    /// The proxy could not bind it (the OS error) and retries with backoff.
    Unbound(String),
    /// Not (yet) handled by the proxy: no mode-4 rule, or a snapshot still being applied.
    Pending,
}

impl ListenerStatus {
    /// The `listenerState` text of `GET .../all`: `listening`, `unbound: <error>; retrying`,
    /// or `pending`.
    pub fn describe(&self) -> String {
        match self {
            Self::Listening => "listening".into(),
            Self::Unbound(e) => format!("unbound: {e}; retrying"),
            Self::Pending => "pending".into(),
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AddressLabel {
    address: String,
}

/// The listener metric families (see the module doc).
#[derive(Debug, Clone, Default)]
pub struct ListenMetrics {
    up: Family<AddressLabel, Gauge>,
    bind_failures: Family<AddressLabel, Counter>,
}

impl ListenMetrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "loxilb_fullproxy_listener_up",
            "1 while the fullproxy listens on a rule's address, 0 while it cannot bind it (retrying)",
            m.up.clone(),
        );
        registry.register(
            "loxilb_fullproxy_listener_bind_failures",
            "Failed attempts to bind a restored rule's fullproxy address",
            m.bind_failures.clone(),
        );
        m
    }

    fn label(addr: SocketAddr) -> AddressLabel {
        AddressLabel {
            address: addr.to_string(),
        }
    }
}

#[derive(Default)]
struct Inner {
    /// Bound by the API for a rule being stored; taken by the proxy.
    staged: HashMap<SocketAddr, std::net::TcpListener>,
    /// Served by a proxy listener.
    held: HashSet<SocketAddr>,
    /// The proxy's last bind error, while it retries.
    failed: HashMap<SocketAddr, String>,
    /// Client traffic of each served address.
    traffic: HashMap<SocketAddr, Arc<Traffic>>,
}

/// Client-side traffic of one fullproxy listener (`VIP:port`): what LoxiLB's
/// `GET .../externalipaddress/{ip}/port/{port}/protocol/{proto}/stats` reports
/// (`loxilb-inference-gateway` `models.LoadbalanceStats`). Counted by the proxy on the client
/// socket: bytes are TCP payload bytes as read and written (HTTP heads and bodies), not
/// backend traffic.
#[derive(Debug, Default)]
pub struct Traffic {
    accepted: AtomicU64,
    open: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

/// A reading of [`Traffic`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrafficSnapshot {
    /// Client connections open now.
    pub active_connections: u64,
    /// Client connections accepted since the address was first served (monotonic).
    pub total_connections: u64,
    /// Bytes read from clients.
    pub bytes_in: u64,
    /// Bytes written to clients.
    pub bytes_out: u64,
}

impl Traffic {
    /// A connection was accepted; it counts as open until [`Traffic::closed`].
    pub fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
        self.open.fetch_add(1, Ordering::Relaxed);
    }

    /// An accepted connection closed.
    pub fn closed(&self) {
        // Saturating: never wraps below zero even if called unpaired.
        let _ = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// `n` bytes were read from a client.
    pub fn read(&self, n: usize) {
        self.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// `n` bytes were written to a client.
    pub fn written(&self, n: usize) {
        self.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> TrafficSnapshot {
        TrafficSnapshot {
            active_connections: self.open.load(Ordering::Relaxed),
            total_connections: self.accepted.load(Ordering::Relaxed),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
        }
    }
}

/// The shared socket table (see the module doc). Share as `Arc<ListenSockets>`.
#[derive(Default)]
pub struct ListenSockets {
    inner: Mutex<Inner>,
    metrics: ListenMetrics,
}

impl ListenSockets {
    /// An empty table reporting to `metrics`.
    pub fn new(metrics: ListenMetrics) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner::default()),
            metrics,
        })
    }

    /// API side: makes sure `addr` can be listened on before a rule for it is stored. Binds and
    /// stages a socket unless the proxy already serves `addr`, retries binding it, or one is
    /// staged. Dropping the returned [`Reservation`] without [`Reservation::commit`] closes a
    /// socket it staged.
    pub fn reserve(self: &Arc<Self>, addr: SocketAddr) -> std::io::Result<Reservation> {
        let mut g = self.inner.lock();
        // Served, staged, or wanted by the proxy and retrying its bind (a restored rule whose
        // port another process holds): the address is the proxy's already, and a rule for it
        // (an update of the restored one, another model pool) is stored and served once the
        // retry binds. Binding here would only fail the same way.
        let staged = if g.held.contains(&addr)
            || g.staged.contains_key(&addr)
            || g.failed.contains_key(&addr)
        {
            false
        } else {
            g.staged.insert(addr, bind_listener(addr)?);
            true
        };
        Ok(Reservation {
            sockets: self.clone(),
            addr,
            staged,
        })
    }

    /// Proxy side: the socket to serve `addr` with: the one the API staged, else a fresh bind.
    /// Success marks `addr` listening; failure is recorded (status, metrics) for the retry loop.
    pub fn acquire(&self, addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
        let mut g = self.inner.lock();
        let label = ListenMetrics::label(addr);
        let result = match g.staged.remove(&addr) {
            Some(l) => Ok(l),
            None => bind_listener(addr),
        };
        match &result {
            Ok(_) => {
                g.held.insert(addr);
                g.failed.remove(&addr);
                self.metrics.up.get_or_create(&label).set(1);
            }
            Err(e) => {
                g.failed.insert(addr, e.to_string());
                self.metrics.up.get_or_create(&label).set(0);
                self.metrics.bind_failures.get_or_create(&label).inc();
            }
        }
        result
    }

    /// Proxy side: `addr` is no longer served (its last rule was deleted, or shutdown).
    pub fn release(&self, addr: SocketAddr) {
        let mut g = self.inner.lock();
        g.held.remove(&addr);
        g.failed.remove(&addr);
        g.traffic.remove(&addr);
        let label = ListenMetrics::label(addr);
        self.metrics.up.remove(&label);
        self.metrics.bind_failures.remove(&label);
    }

    /// Proxy side: closes staged sockets whose address no rule wants any more (a rule deleted
    /// before the proxy applied it) and forgets failures of such addresses.
    pub fn retain_wanted(&self, wanted: impl Fn(&SocketAddr) -> bool) {
        let mut g = self.inner.lock();
        g.staged.retain(|a, _| wanted(a));
        let gone: Vec<SocketAddr> = g.failed.keys().filter(|a| !wanted(a)).copied().collect();
        for a in gone {
            g.failed.remove(&a);
            let label = ListenMetrics::label(a);
            self.metrics.up.remove(&label);
            self.metrics.bind_failures.remove(&label);
        }
    }

    /// Proxy side: the traffic counters of `addr` (created on first use, dropped by
    /// [`ListenSockets::release`]).
    pub fn traffic(&self, addr: SocketAddr) -> Arc<Traffic> {
        self.inner.lock().traffic.entry(addr).or_default().clone()
    }

    /// API side: the traffic of `addr` now; `None` when no proxy listener has served it since it
    /// was last released (a rule stored but not yet served, or an L4 rule).
    pub fn traffic_snapshot(&self, addr: SocketAddr) -> Option<TrafficSnapshot> {
        self.inner.lock().traffic.get(&addr).map(|t| t.snapshot())
    }

    /// What is known about `addr`.
    pub fn status(&self, addr: SocketAddr) -> ListenerStatus {
        let g = self.inner.lock();
        // A staged socket is bound and listening already (connections wait in its backlog
        // until the proxy takes it).
        if g.held.contains(&addr) || g.staged.contains_key(&addr) {
            ListenerStatus::Listening
        } else if let Some(e) = g.failed.get(&addr) {
            ListenerStatus::Unbound(e.clone())
        } else {
            ListenerStatus::Pending
        }
    }
}

/// A socket staged for a rule being stored (see [`ListenSockets::reserve`]).
#[must_use = "dropping a reservation without commit() closes its socket"]
pub struct Reservation {
    sockets: Arc<ListenSockets>,
    addr: SocketAddr,
    staged: bool,
}

impl Reservation {
    /// The rule was stored: leave the socket for the proxy.
    pub fn commit(mut self) {
        self.staged = false;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.staged {
            self.sockets.inner.lock().staged.remove(&self.addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Arc<ListenSockets> {
        ListenSockets::new(ListenMetrics::default())
    }

    #[test]
    fn traffic_counts_per_address_and_restarts_after_release() {
        let t = table();
        let a: SocketAddr = "127.0.0.1:18080".parse().expect("addr");
        assert_eq!(t.traffic_snapshot(a), None, "never served");
        let tr = t.traffic(a);
        tr.accepted();
        tr.accepted();
        tr.closed();
        tr.read(120);
        tr.written(4096);
        tr.written(4);
        assert_eq!(
            t.traffic_snapshot(a),
            Some(TrafficSnapshot {
                active_connections: 1,
                total_connections: 2,
                bytes_in: 120,
                bytes_out: 4100,
            })
        );
        // The proxy's handle and the API's view are the same counters.
        assert!(Arc::ptr_eq(&tr, &t.traffic(a)));
        tr.closed();
        tr.closed();
        assert_eq!(t.traffic_snapshot(a).map(|s| s.active_connections), Some(0));
        t.release(a);
        assert_eq!(t.traffic_snapshot(a), None, "released: counters dropped");
    }

    #[test]
    fn backoff_doubles_from_one_second_and_caps_at_thirty() {
        let secs: Vec<u64> = (1..=8).map(|a| backoff(a).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(backoff(u32::MAX), RETRY_MAX);
    }

    #[test]
    fn a_port_in_use_cannot_be_reserved() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("addr");
        let e = table().reserve(addr).err().expect("port in use");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    }

    #[test]
    fn a_committed_reservation_hands_its_socket_to_the_proxy() {
        let t = table();
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = probe.local_addr().expect("addr");
        drop(probe);
        t.reserve(addr).expect("free port").commit();
        // Staged: a second bind by anyone else fails.
        assert!(std::net::TcpListener::bind(addr).is_err());
        let l = t.acquire(addr).expect("the staged socket");
        assert_eq!(l.local_addr().expect("addr"), addr);
        assert_eq!(t.status(addr), ListenerStatus::Listening);
        // Served: reserving it again for another model pool needs no new socket.
        t.reserve(addr).expect("already served").commit();
    }

    #[test]
    fn an_uncommitted_reservation_closes_its_socket() {
        let t = table();
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = probe.local_addr().expect("addr");
        drop(probe);
        drop(t.reserve(addr).expect("free port"));
        std::net::TcpListener::bind(addr).expect("the port is free again");
    }

    #[test]
    fn a_failed_acquire_is_reported_until_it_succeeds() {
        let t = table();
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("addr");
        assert!(t.acquire(addr).is_err());
        assert!(
            matches!(t.status(addr), ListenerStatus::Unbound(ref e) if e.contains("in use")),
            "{:?}",
            t.status(addr)
        );
        // While the proxy retries, the address is its own: a rule for it (an update of the
        // restored rule) is reserved without a bind, so it can be stored.
        t.reserve(addr).expect("retrying: reserved").commit();
        drop(taken);
        t.acquire(addr).expect("free now");
        assert_eq!(t.status(addr), ListenerStatus::Listening);
    }
}
