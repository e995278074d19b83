//! Neighbour entries for the L4 endpoints. The XDP program forwards with `bpf_fib_lookup`, which
//! needs the endpoint's (or next hop's) MAC in the kernel's neighbour table; without one it
//! passes the frame to the kernel (`fib_pass`). For DNAT the kernel then forwards it and learns
//! the neighbour, but a full-NAT or one-arm frame carries one of this host's own addresses as
//! its source (the kernel drops it as a martian) and a DSR frame is still addressed to the VIP
//! (the kernel delivers it locally): no neighbour is ever learned, and every connection to such
//! an endpoint times out until something else on the host talks to it.
//!
//! So each endpoint on a connected subnet of this namespace that has no usable entry gets a
//! *managed* one (`NTF_EXT_MANAGED`, Linux 5.16+, as `ip neigh add ADDR dev DEV managed`): the
//! kernel resolves it at once and keeps it resolved. The check (an address and a neighbour
//! dump) runs at a stats tick ([`super::run`]) only when [`due`] says so: the plan changed,
//! `fib_pass` rose, an `--xdp-iface` came back, or [`BACKSTOP`] has passed since the last run.
//! Endpoints behind a gateway are reached through the gateway's entry, which the host's own
//! traffic keeps. Entries loxi added stay after it stops (the kernel's, like any other).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use futures::TryStreamExt as _;
use rtnetlink::Handle;
use rtnetlink::packet_route::{
    address::{AddressAttribute, AddressMessage},
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
};
use rtnetlink::packet_utils::nla::DefaultNla;

use super::Plan;

/// `NDA_FLAGS_EXT`, the attribute of a neighbour's extended flags.
const NDA_FLAGS_EXT: u16 = 15;
/// `NTF_EXT_MANAGED`: the kernel keeps the entry resolved.
const NTF_EXT_MANAGED: u32 = 1;

/// The longest time between two runs of [`keep_resolved`] when nothing asks for one (an entry
/// deleted from outside, an address added to an interface: events loxi does not watch).
pub const BACKSTOP: Duration = Duration::from_secs(30);

/// What happened since [`keep_resolved`] last ran, the inputs of [`due`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trigger {
    /// The plan (rules, endpoints) changed since the last successful run, or none succeeded.
    pub plan_changed: bool,
    /// How much the `fib_pass` counter rose over the last stats tick: the XDP program passed
    /// frames to the kernel for want of a route or neighbour.
    pub fib_pass_delta: u64,
    /// `keep_attached` attached an `--xdp-iface` again (a link came back, maybe recreated
    /// without the entries of its predecessor).
    pub link_up: bool,
    /// Time since the last run (`None`: it never ran).
    pub elapsed: Option<Duration>,
}

/// Whether [`keep_resolved`] runs at this stats tick: on any of [`Trigger`]'s events, else
/// once [`BACKSTOP`] has passed since the last run.
pub fn due(t: &Trigger) -> bool {
    t.plan_changed || t.fib_pass_delta > 0 || t.link_up || t.elapsed.is_none_or(|e| e >= BACKSTOP)
}

/// The state [`due`] needs between stats ticks: the plan generation of the last successful
/// run and the time of the last run (a failed run is retried at the next tick while the plan
/// it was for is still pending).
#[derive(Debug, Default)]
pub struct Schedule {
    /// Plan generation the last successful run was for.
    done: Option<u64>,
    /// When the last run (successful or not) was.
    last: Option<Instant>,
}

impl Schedule {
    /// Whether to run now for plan generation `generation`, given the `fib_pass` rise and
    /// whether a link came back this tick.
    pub fn due(&self, generation: u64, fib_pass_delta: u64, link_up: bool, now: Instant) -> bool {
        due(&Trigger {
            plan_changed: self.done != Some(generation),
            fib_pass_delta,
            link_up,
            elapsed: self.last.map(|t| now.saturating_duration_since(t)),
        })
    }

    /// Records a run at `now` for plan generation `generation` (`ok`: it succeeded).
    pub fn ran(&mut self, generation: u64, ok: bool, now: Instant) {
        self.last = Some(now);
        if ok {
            self.done = Some(generation);
        }
    }
}

/// The endpoint addresses of `plan`'s services.
pub fn endpoint_addrs(plan: &Plan) -> BTreeSet<IpAddr> {
    plan.services
        .values()
        .flat_map(|s| {
            let v4 = s.key.family == loxi_common::maps::family::V4;
            s.endpoints.iter().map(move |e| ip_of(&e.addr, v4))
        })
        .collect()
}

fn ip_of(b: &[u8; 16], v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*b))
    }
}

/// Adds a managed neighbour entry for every address of `endpoints` that lies on a connected
/// subnet of this namespace (an interface address's prefix) and has no usable entry there
/// (none, or one that is incomplete or failed and not managed). Returns the `(ifindex,
/// address)` pairs it added. Errors: the address or neighbour dump failing (nothing added);
/// one add failing is logged and the others go on.
pub async fn keep_resolved(
    handle: &Handle,
    endpoints: &BTreeSet<IpAddr>,
) -> Result<Vec<(u32, IpAddr)>, rtnetlink::Error> {
    if endpoints.is_empty() {
        return Ok(Vec::new());
    }
    let prefixes: Vec<(u32, IpAddr, u8)> = dump(handle.address().get().execute(), prefix).await?;
    let usable: BTreeSet<(u32, IpAddr)> =
        dump(handle.neighbours().get().execute(), usable_entry).await?;
    let mut added = Vec::new();
    for &ep in endpoints {
        let Some(ifindex) = connected_on(&prefixes, ep) else {
            continue;
        };
        if usable.contains(&(ifindex, ep)) {
            continue;
        }
        let mut req = handle
            .neighbours()
            .add(ifindex, ep)
            .state(NeighbourState::None)
            .replace();
        req.message_mut()
            .attributes
            .push(NeighbourAttribute::Other(DefaultNla::new(
                NDA_FLAGS_EXT,
                NTF_EXT_MANAGED.to_ne_bytes().to_vec(),
            )));
        match req.execute().await {
            Ok(()) => added.push((ifindex, ep)),
            Err(e) => tracing::warn!(endpoint = %ep, ifindex, error = %e,
                "adding a managed neighbour entry for an L4 endpoint failed; flows to it that the kernel cannot forward wait for the host to learn its address"),
        }
    }
    Ok(added)
}

/// The values `keep` picks out of the messages of an rtnetlink dump.
async fn dump<M, T, C: Default + Extend<T>>(
    messages: impl futures::TryStream<Ok = M, Error = rtnetlink::Error>,
    keep: impl Fn(M) -> Option<T>,
) -> Result<C, rtnetlink::Error> {
    messages
        .try_filter_map(|m| std::future::ready(Ok(keep(m))))
        .try_collect()
        .await
}

/// An interface address as `(ifindex, address, prefix length)`.
fn prefix(m: AddressMessage) -> Option<(u32, IpAddr, u8)> {
    let addr = m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    })?;
    Some((m.header.index, addr, m.header.prefix_len))
}

/// A neighbour entry as `(ifindex, address)` if it is usable: managed, or neither resolving
/// nor failed.
fn usable_entry(m: NeighbourMessage) -> Option<(u32, IpAddr)> {
    let dst = m.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })?;
    let managed = m.attributes.iter().any(|a| match a {
        NeighbourAttribute::Other(nla) => is_managed(nla),
        _ => false,
    });
    let resolving_or_failed = matches!(
        m.header.state,
        NeighbourState::Incomplete | NeighbourState::Failed | NeighbourState::None
    );
    (managed || !resolving_or_failed).then_some((m.header.ifindex, dst))
}

/// Whether `nla` is `NDA_FLAGS_EXT` with `NTF_EXT_MANAGED` set.
fn is_managed(nla: &DefaultNla) -> bool {
    use rtnetlink::packet_utils::nla::Nla as _;
    if nla.kind() != NDA_FLAGS_EXT || nla.value_len() != 4 {
        return false;
    }
    let mut v = [0u8; 4];
    nla.emit_value(&mut v);
    u32::from_ne_bytes(v) & NTF_EXT_MANAGED != 0
}

/// The interface whose address prefix holds `ip` (the longest such prefix), if any; an
/// address of this namespace's own is not a neighbour.
fn connected_on(prefixes: &[(u32, IpAddr, u8)], ip: IpAddr) -> Option<u32> {
    if prefixes.iter().any(|(_, a, _)| *a == ip) {
        return None;
    }
    prefixes
        .iter()
        .filter(|(_, a, len)| same_prefix(*a, ip, *len))
        .max_by_key(|(_, _, len)| *len)
        .map(|(i, _, _)| *i)
}

/// Whether `a` and `b` share their first `len` bits (false across families).
fn same_prefix(a: IpAddr, b: IpAddr, len: u8) -> bool {
    let (a, b, bits): (u128, u128, u32) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a).into(), u32::from(b).into(), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let len = u32::from(len).min(bits);
    if len == 0 {
        return true;
    }
    let shift = bits - len;
    (a >> shift) == (b >> shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_resolved_runs_on_each_trigger_and_else_only_after_the_backstop() {
        let quiet = Trigger {
            plan_changed: false,
            fib_pass_delta: 0,
            link_up: false,
            elapsed: Some(Duration::from_secs(1)),
        };
        assert!(!due(&quiet), "nothing happened, 1 s after the last run");
        assert!(due(&Trigger {
            plan_changed: true,
            ..quiet
        }));
        assert!(due(&Trigger {
            fib_pass_delta: 1,
            ..quiet
        }));
        assert!(due(&Trigger {
            link_up: true,
            ..quiet
        }));
        assert!(
            due(&Trigger {
                elapsed: None,
                ..quiet
            }),
            "never ran"
        );
        assert!(!due(&Trigger {
            elapsed: Some(BACKSTOP - Duration::from_millis(1)),
            ..quiet
        }));
        assert!(due(&Trigger {
            elapsed: Some(BACKSTOP),
            ..quiet
        }));
    }

    #[test]
    fn the_schedule_retries_a_failed_run_until_its_plan_is_done() {
        let t0 = Instant::now();
        let s1 = t0 + Duration::from_secs(1);
        let mut s = Schedule::default();
        assert!(s.due(0, 0, false, t0), "first tick");
        s.ran(0, true, t0);
        assert!(!s.due(0, 0, false, s1));
        assert!(s.due(1, 0, false, s1), "a new plan");
        s.ran(1, false, s1);
        let s2 = t0 + Duration::from_secs(2);
        assert!(s.due(1, 0, false, s2), "the failed run is retried");
        s.ran(1, true, s2);
        assert!(!s.due(1, 0, false, t0 + Duration::from_secs(3)));
        assert!(
            s.due(1, 3, false, t0 + Duration::from_secs(3)),
            "fib_pass rose"
        );
        assert!(
            s.due(1, 0, true, t0 + Duration::from_secs(3)),
            "a link came back"
        );
        assert!(!s.due(1, 0, false, s2 + BACKSTOP - Duration::from_millis(1)));
        assert!(s.due(1, 0, false, s2 + BACKSTOP));
    }

    #[test]
    fn the_longest_connected_prefix_names_the_interface_and_own_addresses_are_not_neighbours() {
        let p: Vec<(u32, IpAddr, u8)> = vec![
            (2, "10.0.0.1".parse().expect("ip"), 8),
            (3, "10.1.2.1".parse().expect("ip"), 24),
            (4, "fd00::1".parse().expect("ip"), 64),
            (1, "127.0.0.1".parse().expect("ip"), 8),
        ];
        let on = |s: &str| connected_on(&p, s.parse().expect("ip"));
        assert_eq!(on("10.1.2.7"), Some(3));
        assert_eq!(on("10.9.9.9"), Some(2));
        assert_eq!(on("fd00::42"), Some(4));
        assert_eq!(on("192.0.2.1"), None, "behind a gateway");
        assert_eq!(on("10.1.2.1"), None, "this host's own address");
        assert_eq!(on("fd01::1"), None);
    }

    #[test]
    fn a_neighbour_entry_is_usable_when_managed_or_neither_resolving_nor_failed() {
        let entry = |state: NeighbourState, managed: bool, dst: Option<&str>| {
            let mut m = NeighbourMessage::default();
            m.header.ifindex = 3;
            m.header.state = state;
            if let Some(d) = dst {
                let ip: Ipv4Addr = d.parse().expect("ip");
                m.attributes
                    .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
            }
            if managed {
                m.attributes.push(NeighbourAttribute::Other(DefaultNla::new(
                    NDA_FLAGS_EXT,
                    NTF_EXT_MANAGED.to_ne_bytes().to_vec(),
                )));
            }
            usable_entry(m)
        };
        let ip: IpAddr = "10.100.1.2".parse().expect("ip");
        assert_eq!(
            entry(NeighbourState::Reachable, false, Some("10.100.1.2")),
            Some((3, ip))
        );
        assert_eq!(
            entry(NeighbourState::Stale, false, Some("10.100.1.2")),
            Some((3, ip))
        );
        assert_eq!(
            entry(NeighbourState::Incomplete, false, Some("10.100.1.2")),
            None
        );
        assert_eq!(
            entry(NeighbourState::Failed, false, Some("10.100.1.2")),
            None
        );
        assert_eq!(
            entry(NeighbourState::Failed, true, Some("10.100.1.2")),
            Some((3, ip)),
            "managed: the kernel keeps resolving it"
        );
        assert_eq!(entry(NeighbourState::Reachable, false, None), None);
    }

    #[test]
    fn managed_is_read_from_the_extended_flags() {
        assert!(is_managed(&DefaultNla::new(
            NDA_FLAGS_EXT,
            1u32.to_ne_bytes().to_vec()
        )));
        assert!(!is_managed(&DefaultNla::new(
            NDA_FLAGS_EXT,
            0u32.to_ne_bytes().to_vec()
        )));
        assert!(!is_managed(&DefaultNla::new(
            14,
            1u32.to_ne_bytes().to_vec()
        )));
    }
}
