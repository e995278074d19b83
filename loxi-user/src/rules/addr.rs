//! What a rule's addresses may be. A VIP is the one address clients connect to and an endpoint
//! the one host requests are sent to, so neither may be a multicast address (IPv4 224.0.0.0/4,
//! IPv6 ff00::/8) or the IPv4 broadcast address 255.255.255.255: no TCP connection reaches or
//! leaves one, and the L4 data path would copy flows to a group. An endpoint may not be the
//! unspecified address either (`0.0.0.0`, `::`: nobody to send to); a VIP may, in mode 4
//! only, where it means "listen on every address" (`validate::check_l4` refuses it elsewhere).
//! An IPv4-mapped IPv6 spelling (`::ffff:224.0.0.1`) is judged as its IPv4 address.

use std::fmt::Display;
use std::net::IpAddr;

/// `ip:port` as a socket address is written: an IPv6 address in brackets (`[::1]:8000`), as
/// URLs and `SocketAddr` write it, so the port cannot be read as part of the address.
pub fn host_port(ip: &str, port: impl Display) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// Whether two IP literals name the same host: an IPv4-mapped IPv6 spelling
/// (`::ffff:127.0.0.1`) is its IPv4 address, as a dual-stack socket connects to it. Literals
/// that do not parse are compared as text.
pub fn same_host(a: &str, b: &str) -> bool {
    match (a.parse::<IpAddr>(), b.parse::<IpAddr>()) {
        (Ok(x), Ok(y)) => x.to_canonical() == y.to_canonical(),
        _ => a == b,
    }
}

/// What `ip` is when it names no single host (multicast or broadcast), else `None`.
pub fn not_one_host(ip: IpAddr) -> Option<&'static str> {
    match ip.to_canonical() {
        IpAddr::V4(a) if a.is_broadcast() => Some("the broadcast address"),
        a if a.is_multicast() => Some("a multicast address"),
        _ => None,
    }
}

/// Whether `ip` is the unspecified address (`0.0.0.0`, `::`, `::ffff:0.0.0.0`).
pub fn is_unspecified(ip: IpAddr) -> bool {
    ip.to_canonical().is_unspecified()
}

/// Why `ip` cannot be an endpoint's address, or `None` when it can.
pub fn endpoint_fault(ip: IpAddr) -> Option<&'static str> {
    if is_unspecified(ip) {
        return Some("the unspecified address");
    }
    not_one_host(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("IP literal")
    }

    #[test]
    fn multicast_broadcast_and_unspecified_addresses_are_told_apart() {
        for (a, want) in [
            ("224.0.0.1", Some("a multicast address")),
            ("239.255.255.250", Some("a multicast address")),
            ("ff02::1", Some("a multicast address")),
            ("ff0e::1:3", Some("a multicast address")),
            ("::ffff:224.0.0.251", Some("a multicast address")),
            ("255.255.255.255", Some("the broadcast address")),
            ("::ffff:255.255.255.255", Some("the broadcast address")),
            ("0.0.0.0", Some("the unspecified address")),
            ("::", Some("the unspecified address")),
            ("::ffff:0.0.0.0", Some("the unspecified address")),
            ("10.0.0.1", None),
            ("223.255.255.255", None),
            ("240.0.0.1", None),
            ("127.0.0.1", None),
            ("fe80::1", None),
            ("fd00::2", None),
            ("::1", None),
        ] {
            assert_eq!(endpoint_fault(ip(a)), want, "{a}");
        }
        assert_eq!(
            not_one_host(ip("0.0.0.0")),
            None,
            "a mode-4 VIP may be 0.0.0.0"
        );
    }

    #[test]
    fn socket_addresses_bracket_ipv6_and_mapped_addresses_are_their_ipv4_host() {
        assert_eq!(host_port("10.0.0.2", 8000), "10.0.0.2:8000");
        assert_eq!(host_port("fd00::2", "5557"), "[fd00::2]:5557");
        assert!(same_host("::ffff:127.0.0.1", "127.0.0.1"));
        assert!(same_host("127.0.0.1", "::ffff:127.0.0.1"));
        assert!(same_host("fd00::2", "fd00::2"));
        assert!(!same_host("::1", "127.0.0.1"));
        assert!(!same_host("10.0.0.2", "10.0.0.3"));
    }
}
