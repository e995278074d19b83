//! One packet-table case per behaviour: NAT rewrites with exact bytes, pass, drop, IPv6, VLAN.
use loxi_common::maps::ctr;

use super::*;

const VIP: &str = "20.0.0.1";
const CLIENT: &str = "192.168.0.1";
const EP0: &str = "10.0.1.2";

fn dnat_tcp() -> Lb {
    Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])])
}

#[test]
fn dnat_rewrites_destination_with_exact_bytes_and_checksums() {
    let mut lb = dnat_tcp();
    let f = Frame::tcp(CLIENT, 40000, VIP, 80);
    let (act, out) = lb.run(&f);
    // No route in the test namespace: the rewritten frame goes to the kernel.
    assert_eq!(act, XDP_PASS);
    assert_eq!(out, f.with(CLIENT, 40000, EP0, 8080).bytes());
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 1);
    assert_eq!(lb.ctr(ctr::NAT_FWD), 1);
}

#[test]
fn dnat_reply_is_unnatted_so_client_sees_vip() {
    let mut lb = dnat_tcp();
    lb.run(&Frame::tcp(CLIENT, 40000, VIP, 80));
    let mut reply = Frame::tcp(EP0, 8080, CLIENT, 40000);
    reply.tcp_flags = SYN | ACK;
    let (act, out) = lb.run(&reply);
    assert_eq!(act, XDP_PASS);
    assert_eq!(out, reply.with(VIP, 80, CLIENT, 40000).bytes());
    assert_eq!(lb.ctr(ctr::NAT_REV), 1);
}

#[test]
fn dnat_udp_both_directions_keep_valid_checksums() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    let f = Frame::udp(CLIENT, 5353, VIP, 53);
    assert_eq!(lb.run(&f).1, f.with(CLIENT, 5353, EP0, 8080).bytes());
    let r = Frame::udp(EP0, 8080, CLIENT, 5353);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5353).bytes());
}

#[test]
fn fullnat_rewrites_source_and_maps_replies_back() {
    fullnat_round_trips(Lb::run, XDP_PASS);
}

/// In modes 1, 2 and 5 a client's TCP segment leaves from the LB's address and a NAT port, and
/// the endpoint's reply is mapped back to the VIP, with exact bytes, through `run` (one of the
/// hooks: [`Lb::run`], [`Lb::run_tc`]), whose verdict for a frame without a route is `pass`.
pub(super) fn fullnat_round_trips(run: fn(&mut Lb, &Frame) -> (u32, Vec<u8>), pass: u32) {
    for mode in [1u8, 2, 5] {
        let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", mode, 0, &[(EP0, 1)])]);
        let f = Frame::tcp(CLIENT, 40000, VIP, 80);
        let (act, out) = run(&mut lb, &f);
        assert_eq!(act, pass, "mode {mode}");
        let nport = sport_v4(&out);
        assert!(
            (32768..60768).contains(&nport),
            "mode {mode}: NAT port {nport}"
        );
        assert_eq!(out, f.with(LB_V4, nport, EP0, 8080).bytes(), "mode {mode}");
        let mut reply = Frame::tcp(EP0, 8080, LB_V4, nport);
        reply.tcp_flags = SYN | ACK;
        assert_eq!(
            run(&mut lb, &reply).1,
            reply.with(VIP, 80, CLIENT, 40000).bytes(),
            "mode {mode}"
        );
    }
}

#[test]
fn fullnat_gives_clashing_client_ports_distinct_nat_ports() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 2, 0, &[(EP0, 1)])]);
    let a = sport_v4(&lb.run(&Frame::tcp("192.168.0.1", 40000, VIP, 80)).1);
    let b = sport_v4(&lb.run(&Frame::tcp("192.168.0.9", 40000, VIP, 80)).1);
    assert_ne!(a, b);
}

/// A DSR rule and a veth `lbv0` (peer `lbv1` without XDP) holding the route to EP0; returns
/// the LB, lbv0's ifindex and the frame the endpoint must get (MACs of the route, IP header
/// untouched).
fn dsr_towards_veth() -> (Lb, u32, Frame, Frame) {
    let lb = Lb::new(&[&rule(VIP, 80, "tcp", 3, 0, &[(EP0, 1)])]);
    let lbv0 = route_via_veth(None);
    let f = Frame::tcp(CLIENT, 40000, VIP, 80);
    let mut want = f.clone();
    want.dmac = [0x02, 0, 0, 0, 0x01, 0x02];
    want.smac = [0x02, 0, 0, 0, 0x01, 0x01];
    (lb, lbv0, f, want)
}

#[test]
fn dsr_redirects_into_an_egress_that_takes_xdp_frames() {
    let (mut lb, lbv0, f, want) = dsr_towards_veth();
    lb.dp
        .set_xdp_egress(&std::collections::BTreeSet::from([lbv0]))
        .unwrap();
    let (act, out) = lb.run(&f);
    assert_eq!(act, XDP_REDIRECT);
    assert_eq!(
        out,
        want.bytes(),
        "IP header untouched, MACs of the route to the endpoint"
    );
    assert_eq!(lb.ctr(ctr::DSR), 1);
    assert_eq!(lb.ctr(ctr::REDIRECT), 1);
    assert_eq!(lb.ctr(ctr::EGRESS_TC), 0);
}

/// Frames to an egress in the device map go out through `bpf_redirect_map`; a flow whose cached
/// egress has left the map since (its peer lost its XDP program) is still redirected, by
/// ifindex, until its next hop is looked up again.
#[test]
fn a_cached_egress_that_left_the_device_map_is_still_redirected() {
    let (mut lb, lbv0, f, want) = dsr_towards_veth();
    lb.dp
        .set_xdp_egress(&std::collections::BTreeSet::from([lbv0]))
        .unwrap();
    let (act, out) = lb.run(&f);
    assert_eq!((act, out), (XDP_REDIRECT, want.bytes()));
    lb.dp
        .set_xdp_egress(&std::collections::BTreeSet::new())
        .unwrap();
    let (act, out) = lb.run(&f);
    assert_eq!(
        (act, out),
        (XDP_REDIRECT, want.bytes()),
        "the flow's cached next hop (xdp_ok) still redirects"
    );
    assert_eq!(lb.ctr(ctr::REDIRECT), 2);
    assert_eq!(lb.ctr(ctr::EGRESS_TC), 0);
}

/// New flows to an endpoint take its cached next hop (younger than `NH_TTL_NS`) instead of a
/// FIB lookup each, and the forward entry is inserted with it (its next packets need no
/// lookup); past the TTL a new flow looks the route up again.
#[test]
fn new_flows_share_the_endpoints_next_hop_until_it_ages_out() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    let lbv0 = route_via_veth(None);
    lb.dp
        .set_xdp_egress(&std::collections::BTreeSet::from([lbv0]))
        .unwrap();
    let dmac = |out: &[u8]| <[u8; 6]>::try_from(&out[..6]).unwrap();
    let (first, second) = ([0x02, 0, 0, 0, 0x01, 0x02], [0x02, 0, 0, 0, 0x01, 0x03]);
    let (act, out) = lb.run(&Frame::tcp(CLIENT, 40000, VIP, 80));
    assert_eq!(act, XDP_REDIRECT);
    assert_eq!(dmac(&out), first);
    let ct = crate::l4::ConntrackHandle::default();
    ct.publish(lb.dp.conntrack_map_id().unwrap());
    let dump = ct.read(16).unwrap().unwrap();
    let fwd = dump
        .entries
        .iter()
        .find(|(_, v)| v.dir == loxi_common::maps::dir::FWD)
        .expect("forward entry")
        .1;
    assert_ne!(fwd.nh_ns, 0, "forward entry inserted with its next hop");
    assert_eq!((fwd.nh_ifindex, fwd.nh_dmac), (lbv0, first));
    sh("ip neigh replace 10.0.1.2 lladdr 02:00:00:00:01:03 dev lbv0 nud permanent");
    let (act, out) = lb.run(&Frame::tcp(CLIENT, 40001, VIP, 80));
    assert_eq!(act, XDP_REDIRECT);
    assert_eq!(
        dmac(&out),
        first,
        "the endpoint's cached lookup, still fresh"
    );
    std::thread::sleep(std::time::Duration::from_nanos(
        loxi_common::maps::NH_TTL_NS + 200_000_000,
    ));
    let (act, out) = lb.run(&Frame::tcp(CLIENT, 40002, VIP, 80));
    assert_eq!(act, XDP_REDIRECT);
    assert_eq!(dmac(&out), second, "looked up again after NH_TTL_NS");
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 3);
    assert_eq!(lb.ctr(ctr::REDIRECT), 3);
}

#[test]
fn dsr_into_a_plain_veth_is_handed_to_tc() {
    let (mut lb, lbv0, f, want) = dsr_towards_veth();
    let (act, out) = lb.run(&f);
    // XDP_PASS with the rewritten frame: the TC program redirects it to the egress (a veth
    // with a plain peer drops XDP frames). Where the kernel lets XDP programs write metadata,
    // 8 bytes of it in front name the egress; elsewhere the frame alone goes up, and its MACs
    // (the next hop's) are how the TC program knows it (xtask netns-test runs that path).
    assert_eq!(act, XDP_PASS);
    let frame = if lb.dp.hands_off_with_metadata() {
        let mut meta = loxi_common::maps::egress::META_MAGIC.to_ne_bytes().to_vec();
        meta.extend_from_slice(&lbv0.to_ne_bytes());
        assert_eq!(out[..8], meta[..], "hand-off metadata");
        &out[8..]
    } else {
        &out[..]
    };
    assert_eq!(
        frame,
        &want.bytes()[..],
        "frame rewritten as for a redirect"
    );
    assert_eq!(lb.ctr(ctr::EGRESS_TC), 1);
    assert_eq!(lb.ctr(ctr::REDIRECT), 0);
}

#[test]
fn traffic_matching_no_service_passes_untouched() {
    let mut lb = dnat_tcp();
    for f in [
        Frame::tcp(CLIENT, 40000, VIP, 81),
        Frame::udp(CLIENT, 40000, VIP, 80),
        Frame::tcp(CLIENT, 40000, "20.0.0.2", 80),
    ] {
        let (act, out) = lb.run(&f);
        assert_eq!((act, out), (XDP_PASS, f.bytes()));
    }
    let mut arp = vec![0xff; 6];
    arp.extend_from_slice(&MAC_CLIENT);
    arp.extend_from_slice(&[0x08, 0x06]);
    arp.extend_from_slice(&[0u8; 28]);
    assert_eq!(lb.dp.test_run(&arp).unwrap(), (XDP_PASS, arp.clone()));
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 0);
}

#[test]
fn mode4_fullproxy_services_pass_to_the_kernel() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 4, 0, &[(EP0, 1)])]);
    let f = Frame::tcp(CLIENT, 40000, VIP, 80);
    assert_eq!(lb.run(&f), (XDP_PASS, f.bytes()));
}

#[test]
fn truncated_frames_are_dropped_safely() {
    let mut lb = dnat_tcp();
    let full = Frame::tcp(CLIENT, 40000, VIP, 80).bytes();
    let mut vlan = Frame::tcp(CLIENT, 40000, VIP, 80);
    vlan.vlan = Some(7);
    let v6 = Frame::tcp("2001:db8::9", 40000, "2001:db8::1", 80).bytes();
    let cases: Vec<Vec<u8>> = vec![
        full[..14].to_vec(),         // Ethernet only, IPv4 ethertype
        full[..30].to_vec(),         // IPv4 header cut
        full[..40].to_vec(),         // TCP header cut
        vlan.bytes()[..16].to_vec(), // VLAN tag cut
        v6[..50].to_vec(),           // IPv6 header cut
    ];
    for c in &cases {
        let (act, _) = lb.dp.test_run(c).unwrap();
        assert_eq!(act, XDP_DROP, "{} bytes", c.len());
    }
    assert_eq!(lb.ctr(ctr::DROP_TRUNCATED), cases.len() as u64);
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 0);
}

#[test]
fn ipv6_dnat_rewrites_addresses_and_checksum() {
    let mut lb = Lb::new(&[&rule("2001:db8::1", 80, "tcp", 0, 0, &[("fd00::2", 1)])]);
    let f = Frame::tcp("2001:db8::9", 40000, "2001:db8::1", 80);
    assert_eq!(
        lb.run(&f).1,
        f.with("2001:db8::9", 40000, "fd00::2", 8080).bytes()
    );
    let u = Frame::udp("2001:db8::9", 40000, "2001:db8::1", 80);
    assert_eq!(lb.run(&u).1, u.bytes(), "udp has no service");
    let r = Frame::tcp("fd00::2", 8080, "2001:db8::9", 40000);
    assert_eq!(
        lb.run(&r).1,
        r.with("2001:db8::1", 80, "2001:db8::9", 40000).bytes()
    );
    // The reply entry was deferred to that reply (IPv6 keys in `LOXI_REPLY_VIP`).
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 1);
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
}

#[test]
fn vlan_tagged_frames_are_natted_and_keep_their_tag() {
    let mut lb = dnat_tcp();
    let mut f = Frame::tcp(CLIENT, 40000, VIP, 80);
    f.vlan = Some(100);
    let (act, out) = lb.run(&f);
    assert_eq!(act, XDP_PASS);
    assert_eq!(out, f.with(CLIENT, 40000, EP0, 8080).bytes());
}

#[test]
fn ipv6_fullnat_rewrites_source_and_maps_replies_back() {
    let mut lb = Lb::new(&[&rule("2001:db8::1", 80, "udp", 2, 0, &[("fd00::2", 1)])]);
    let f = Frame::udp("2001:db8::9", 40000, "2001:db8::1", 80);
    let (_, out) = lb.run(&f);
    let nport = u16::from_be_bytes([out[54], out[55]]);
    assert_eq!(out, f.with(LB_V6, nport, "fd00::2", 8080).bytes());
    let r = Frame::udp("fd00::2", 8080, LB_V6, nport);
    assert_eq!(
        lb.run(&r).1,
        r.with("2001:db8::1", 80, "2001:db8::9", 40000).bytes()
    );
}
