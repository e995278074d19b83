//! The data path in TC ingress (`loxi_tc_full`, `--tc-iface`) on the packet tables: the same
//! rewrites with exact bytes as XDP (checksums recomputed from scratch by the test frame
//! builder must match the program's incremental ones), TC verdicts, one conntrack shared with
//! the XDP program, and `bpf_redirect` towards a routed endpoint.
use loxi_common::maps::ctr;

use super::*;

/// `TC_ACT_OK`: the kernel takes the frame.
const TC_ACT_OK: u32 = 0;
/// `TC_ACT_SHOT`: dropped.
const TC_ACT_SHOT: u32 = 2;
/// `TC_ACT_REDIRECT`: `bpf_redirect` took it.
const TC_ACT_REDIRECT: u32 = 7;

const VIP: &str = "20.0.0.1";
const VIP6: &str = "2001:db8::1";
const CLIENT: &str = "192.168.0.1";
const CLIENT6: &str = "2001:db8:1::9";
const EP0: &str = "10.0.1.2";
const EP6: &str = "fd00:1::2";

#[test]
fn tc_dnat_rewrites_both_directions_with_exact_bytes_v4_and_v6_tcp_and_udp() {
    for (vip, client, ep) in [(VIP, CLIENT, EP0), (VIP6, CLIENT6, EP6)] {
        for proto in ["tcp", "udp"] {
            let mut lb = Lb::new(&[&rule(vip, 80, proto, 0, 0, &[(ep, 1)])]);
            let (f, mut r) = if proto == "tcp" {
                (
                    Frame::tcp(client, 40000, vip, 80),
                    Frame::tcp(ep, 8080, client, 40000),
                )
            } else {
                (
                    Frame::udp(client, 40000, vip, 80),
                    Frame::udp(ep, 8080, client, 40000),
                )
            };
            let (act, out) = lb.run_tc(&f);
            // No route in the test namespace: the rewritten frame goes to the kernel.
            assert_eq!(act, TC_ACT_OK, "{vip} {proto}");
            assert_eq!(
                out,
                f.with(client, 40000, ep, 8080).bytes(),
                "{vip} {proto}"
            );
            if proto == "tcp" {
                r.tcp_flags = SYN | ACK;
            }
            let (act, out) = lb.run_tc(&r);
            assert_eq!(act, TC_ACT_OK, "{vip} {proto} reply");
            assert_eq!(
                out,
                r.with(vip, 80, client, 40000).bytes(),
                "{vip} {proto} reply"
            );
            assert_eq!(lb.ctr(ctr::NEW_FLOW), 1, "{vip} {proto}");
            assert_eq!(lb.ctr(ctr::NAT_FWD), 1, "{vip} {proto}");
            assert_eq!(lb.ctr(ctr::NAT_REV), 1, "{vip} {proto}");
        }
    }
}

/// A socket buffer a NIC delivered with `CHECKSUM_COMPLETE` (its receive checksum over the
/// whole packet in `skb->csum`) leaves every rewrite with `skb->csum` still summing the frame,
/// for IPv4 and IPv6, TCP and UDP, DNAT (mode 0) and full NAT (mode 2), both directions. The
/// kernel checks it (`BPF_F_TEST_SKB_CHECKSUM_COMPLETE` fails the run with `EBADMSG` when it
/// does not); a wrong one would make the receiving stack verify the packet again in software
/// with a "hw csum failure" warning. IPv6 is the case `bpf_l4_csum_replace` gets wrong unless
/// told (its `BPF_F_IPV6`, Linux 6.16+): the address change it follows in `skb->csum` is
/// already in the header, which IPv6 does not checksum.
#[test]
fn tc_rewrites_keep_a_complete_receive_checksum_right() {
    /// The TCP/UDP source port of an Ethernet frame.
    fn sport(frame: &[u8], v6: bool) -> u16 {
        let at = 14 + if v6 { 40 } else { 20 };
        u16::from_be_bytes([frame[at], frame[at + 1]])
    }
    for (vip, client, ep, lb_addr) in [(VIP, CLIENT, EP0, LB_V4), (VIP6, CLIENT6, EP6, LB_V6)] {
        let v6 = vip.contains(':');
        for proto in ["tcp", "udp"] {
            for mode in [0u8, 2] {
                let case = format!("{vip} {proto} mode {mode}");
                let mut lb = Lb::new(&[&rule(vip, 80, proto, mode, 0, &[(ep, 1)])]);
                let f = if proto == "tcp" {
                    Frame::tcp(client, 40000, vip, 80)
                } else {
                    Frame::udp(client, 40000, vip, 80)
                };
                let (act, out) = lb
                    .run_tc_checksum_complete(&f)
                    .unwrap_or_else(|e| panic!("{case}: forward: {e}"));
                assert_eq!(act, TC_ACT_OK, "{case}");
                let (src, nport) = if mode == 0 {
                    (client, 40000)
                } else {
                    (lb_addr, sport(&out, v6))
                };
                assert_eq!(out, f.with(src, nport, ep, 8080).bytes(), "{case}");
                let mut r = if proto == "tcp" {
                    Frame::tcp(ep, 8080, src, nport)
                } else {
                    Frame::udp(ep, 8080, src, nport)
                };
                if proto == "tcp" {
                    r.tcp_flags = SYN | ACK;
                }
                let (act, out) = lb
                    .run_tc_checksum_complete(&r)
                    .unwrap_or_else(|e| panic!("{case}: reply: {e}"));
                assert_eq!(act, TC_ACT_OK, "{case} reply");
                assert_eq!(out, r.with(vip, 80, client, 40000).bytes(), "{case} reply");
            }
        }
    }
}

#[test]
fn tc_fullnat_rewrites_source_and_maps_replies_back() {
    super::tables::fullnat_round_trips(Lb::run_tc, TC_ACT_OK);
}

/// Both hooks share every map: a flow the XDP program opened (on an `--xdp-iface`) is
/// un-NATed by the TC program when its reply arrives on a `--tc-iface`, and the other way
/// round.
#[test]
fn tc_and_xdp_share_conntrack() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "udp", 0, 0, &[(EP0, 1)])]);
    let f = Frame::udp(CLIENT, 40000, VIP, 80);
    assert_eq!(lb.run(&f).1, f.with(CLIENT, 40000, EP0, 8080).bytes());
    let r = Frame::udp(EP0, 8080, CLIENT, 40000);
    assert_eq!(
        lb.run_tc(&r),
        (TC_ACT_OK, r.with(VIP, 80, CLIENT, 40000).bytes())
    );
    let g = Frame::udp(CLIENT, 40001, VIP, 80);
    assert_eq!(lb.run_tc(&g).1, g.with(CLIENT, 40001, EP0, 8080).bytes());
    let s = Frame::udp(EP0, 8080, CLIENT, 40001);
    assert_eq!(
        lb.run(&s),
        (XDP_PASS, s.with(VIP, 80, CLIENT, 40001).bytes())
    );
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 2);
}

/// A second loader (another loxilb) cannot put its TC data path on an interface that already
/// carries one: TCX would run both and only the first one's rules would serve. Its error names
/// the interface and the program already there; the first one's detach frees the interface.
#[test]
fn a_second_loader_is_refused_an_interface_that_carries_the_tc_data_path() {
    let mut lb = Lb::new(&[]);
    let lbv0 = route_via_veth(None);
    lb.dp.attach_tc("lbv0", lbv0).expect("first attach");
    let mut other = crate::l4::Datapath::load().expect("second load");
    let e = other.attach_tc("lbv0", lbv0).expect_err("second attach");
    assert!(
        e.to_string()
            .starts_with("interface \"lbv0\" already carries loxi's TC data path (program id "),
        "{e}"
    );
    lb.dp.detach_all().expect("detach");
    assert_eq!(
        other
            .attach_tc("lbv0", lbv0)
            .expect("attach after the first detached"),
        crate::l4::AttachMode::Tc
    );
}

/// Traffic to no service goes to the kernel untouched; a frame cut inside its TCP header is
/// dropped, as in XDP.
#[test]
fn tc_passes_other_traffic_and_drops_truncated_frames() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    let other = Frame::tcp(CLIENT, 40000, "20.0.0.9", 80);
    assert_eq!(lb.run_tc(&other), (TC_ACT_OK, other.bytes()));
    assert_eq!(lb.ctr(ctr::PASS), 1);
    let mut cut = Frame::tcp(CLIENT, 40000, VIP, 80).bytes();
    cut.truncate(14 + 20 + 10);
    assert_eq!(lb.run_tc_bytes(&cut).0, TC_ACT_SHOT);
    assert_eq!(lb.ctr(ctr::DROP_TRUNCATED), 1);
}

/// With a route and a neighbour for the endpoint, the rewritten socket buffer gets the route's
/// MACs and is redirected (`bpf_redirect` to the egress, counted as a redirect); the flow's
/// next packet takes the cached next hop.
#[test]
fn tc_redirects_a_routed_flow_with_the_next_hops_macs() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    route_via_veth(None);
    let f = Frame::tcp(CLIENT, 40000, VIP, 80);
    let mut want = f.with(CLIENT, 40000, EP0, 8080);
    want.dmac = [0x02, 0, 0, 0, 0x01, 0x02];
    want.smac = [0x02, 0, 0, 0, 0x01, 0x01];
    for n in 1..=2 {
        let (act, out) = lb.run_tc(&f);
        assert_eq!((act, out), (TC_ACT_REDIRECT, want.bytes()), "packet {n}");
        assert_eq!(lb.ctr(ctr::REDIRECT), n);
    }
    assert_eq!(lb.ctr(ctr::FIB_PASS), 0);
    assert_eq!(lb.ctr(ctr::EGRESS_TC), 0);
    assert_eq!(
        lb.ctr(ctr::REDIRECT_PEER),
        0,
        "the peer is in this namespace"
    );
}

/// An egress veth whose peer is in another namespace (a container's), listed by the loader,
/// gets the socket buffer with `bpf_redirect_peer`: counted, still `TC_ACT_REDIRECT` with the
/// route's MACs. Unlisted again, the next lookup (a new flow) uses `bpf_redirect`.
#[test]
fn tc_redirects_into_a_peer_in_another_namespace() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    let ns = format!("lxtcpeer{}", std::process::id());
    let lbv0 = route_via_veth(Some(&ns));
    lb.dp
        .set_peer_egress(&std::collections::BTreeSet::from([lbv0]))
        .unwrap();
    let f = Frame::tcp(CLIENT, 40000, VIP, 80);
    let mut want = f.with(CLIENT, 40000, EP0, 8080);
    want.dmac = [0x02, 0, 0, 0, 0x01, 0x02];
    want.smac = [0x02, 0, 0, 0, 0x01, 0x01];
    let got = lb.run_tc(&f);
    lb.dp
        .set_peer_egress(&std::collections::BTreeSet::new())
        .unwrap();
    let g = Frame::tcp(CLIENT, 40001, VIP, 80);
    let mut want_g = g.with(CLIENT, 40001, EP0, 8080);
    want_g.dmac = want.dmac;
    want_g.smac = want.smac;
    // Past the endpoint row's cached lookup (`NH_TTL_NS`), the new flow looks the route up.
    std::thread::sleep(std::time::Duration::from_nanos(
        loxi_common::maps::NH_TTL_NS + 200_000_000,
    ));
    let got_g = lb.run_tc(&g);
    sh(&format!("ip netns del {ns}"));
    assert_eq!(got, (TC_ACT_REDIRECT, want.bytes()));
    assert_eq!(got_g, (TC_ACT_REDIRECT, want_g.bytes()));
    assert_eq!(lb.ctr(ctr::REDIRECT_PEER), 1);
    assert_eq!(lb.ctr(ctr::REDIRECT), 2);
}
