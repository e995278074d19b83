//! Deferred reply entries of DNAT flows ([`crate::l4::reply`]): one conntrack insert at
//! creation, the reply entry at the first reply, and the loader's retirement that gives the
//! flows still waiting their reply entries before the endpoint's reply-VIP entry goes.
use std::time::{Duration, Instant};

use loxi_common::maps::{ctr, dir};

use super::*;
use crate::l4::reply::RETIRE_AFTER;

const VIP: &str = "20.0.0.1";
const VIP2: &str = "20.0.0.2";
const CLIENT: &str = "192.168.0.1";
const EP0: &str = "10.0.1.2";

/// (forward, reply) entries in conntrack.
fn dirs(lb: &Lb) -> (usize, usize) {
    let ct = lb.ct();
    let fwd = ct.iter().filter(|(_, v)| v.dir == dir::FWD).count();
    (fwd, ct.len() - fwd)
}

/// With VIP and VIP2 sharing one endpoint: (the VIP the loader listed for it, the other).
fn listed_and_other(lb: &Lb) -> (&'static str, &'static str) {
    let pairs = lb.dp.reply_vip_pairs();
    assert_eq!(pairs.len(), 1, "one entry per endpoint");
    let listed = std::net::Ipv4Addr::from(<[u8; 4]>::try_from(&pairs[0].1.addr[..4]).unwrap());
    if listed.to_string() == VIP {
        (VIP, VIP2)
    } else {
        (VIP2, VIP)
    }
}

#[test]
fn a_dnat_flow_inserts_its_reply_entry_at_its_first_reply() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    let f = Frame::udp(CLIENT, 5353, VIP, 53);
    assert_eq!(lb.run(&f).1, f.with(CLIENT, 5353, EP0, 8080).bytes());
    assert_eq!(
        dirs(&lb),
        (1, 0),
        "one insert for a flow that has not answered"
    );
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 1);
    let r = Frame::udp(EP0, 8080, CLIENT, 5353);
    for n in 1..=2u64 {
        let (act, out) = lb.run(&r);
        assert_eq!(act, XDP_PASS);
        assert_eq!(
            out,
            r.with(VIP, 53, CLIENT, 5353).bytes(),
            "reply {n} un-NATed"
        );
    }
    assert_eq!(dirs(&lb), (1, 1));
    // The second reply found the entry the first one inserted.
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
    assert_eq!(lb.ctr(ctr::NAT_REV), 2);
    let ct = lb.ct();
    let rev = ct.iter().find(|(_, v)| v.dir == dir::REV).unwrap().1;
    assert_eq!(rev.packets, 2);
    // The flow goes on as before: a later forward packet takes its entry.
    lb.run(&f);
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 1);
}

#[test]
fn only_the_listed_vip_defers_when_two_vips_share_an_endpoint() {
    let mut lb = Lb::new(&[
        &rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]),
    ]);
    let (listed, other) = listed_and_other(&lb);

    lb.run(&Frame::udp(CLIENT, 1000, listed, 53));
    assert_eq!(dirs(&lb), (1, 0));
    lb.run(&Frame::udp(CLIENT, 2000, other, 53));
    assert_eq!(
        dirs(&lb),
        (2, 1),
        "the other VIP's flow inserts both entries"
    );
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 1);
    // Each reply is un-NATed to its own flow's VIP.
    for (port, vip) in [(1000, listed), (2000, other)] {
        let r = Frame::udp(EP0, 8080, CLIENT, port);
        assert_eq!(lb.run(&r).1, r.with(vip, 53, CLIENT, port).bytes());
    }
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
}

#[test]
fn an_endpoint_packet_of_no_flow_passes_untouched_and_inserts_nothing() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    lb.run(&Frame::udp(CLIENT, 5353, VIP, 53));
    // Same endpoint, another client port: no forward entry behind it.
    let stray = Frame::udp(EP0, 8080, CLIENT, 5354);
    let (act, out) = lb.run(&stray);
    assert_eq!(act, XDP_PASS);
    assert_eq!(out, stray.bytes());
    assert_eq!(dirs(&lb), (1, 0));
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 0);
}

#[test]
fn full_nat_and_dsr_flows_insert_both_entries_at_creation() {
    for mode in [2u8, 3] {
        let mut lb = Lb::new(&[&rule(VIP, 53, "udp", mode, 0, &[(EP0, 1)])]);
        assert!(lb.dp.reply_vip_pairs().is_empty());
        lb.run(&Frame::udp(CLIENT, 5353, VIP, 53));
        assert_eq!(dirs(&lb), (1, 1), "mode {mode}");
        assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 0);
    }
}

#[test]
fn retiring_an_endpoint_gives_its_waiting_flows_their_reply_entries_first() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1), ("10.0.1.3", 1)])]);
    let f = Frame::udp(CLIENT, 5353, VIP, 53);
    let out = lb.run(&f).1;
    let chosen = dst_of(&out).to_string();
    assert_eq!(dirs(&lb), (1, 0));
    // The flow's endpoint leaves the rule; the flow keeps it (conntrack).
    let rest = if chosen == EP0 { "10.0.1.3" } else { EP0 };
    lb.set_rules(&[&rule(VIP, 53, "udp", 0, 0, &[(rest, 1)])]);
    let now = Instant::now();
    let p = lb.current().clone();
    lb.dp.sync_reply_vips(&p, now).unwrap();
    assert_eq!(lb.dp.reply_vip_pairs().len(), 2, "kept through the grace");
    lb.dp
        .sync_reply_vips(&p, now + RETIRE_AFTER + Duration::from_millis(1))
        .unwrap();
    assert_eq!(
        lb.dp.reply_vip_pairs().len(),
        1,
        "the left endpoint's entry retired"
    );
    assert_eq!(
        dirs(&lb),
        (1, 1),
        "the waiting flow got its reply entry from the loader"
    );
    let r = Frame::udp(&chosen, 8080, CLIENT, 5353);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5353).bytes());
    assert_eq!(
        lb.ctr(ctr::CT_REPLY_ADDED),
        0,
        "the reply hit the loader's entry"
    );
}

#[test]
fn a_first_reply_that_resets_closes_the_flow_like_a_conntrack_hit() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    lb.run(&Frame::tcp(CLIENT, 40000, VIP, 80));
    assert_eq!(dirs(&lb), (1, 0));
    let mut rst = Frame::tcp(EP0, 8080, CLIENT, 40000);
    rst.tcp_flags = RST | ACK;
    let (act, out) = lb.run(&rst);
    assert_eq!(act, XDP_PASS);
    assert_eq!(
        out,
        rst.with(VIP, 80, CLIENT, 40000).bytes(),
        "the RST still reaches the client"
    );
    assert_eq!(lb.ctr(ctr::CT_RST), 1);
    assert_eq!(dirs(&lb), (0, 0), "both entries removed");
}

#[test]
fn a_first_reply_with_fin_shortens_both_entries_timeouts() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    lb.run(&Frame::tcp(CLIENT, 40000, VIP, 80));
    let mut fin = Frame::tcp(EP0, 8080, CLIENT, 40000);
    fin.tcp_flags = FIN | ACK;
    lb.run(&fin);
    let ct = lb.ct();
    assert_eq!(ct.len(), 2);
    for (_, v) in &ct {
        assert_eq!(
            v.timeout_s,
            loxi_common::maps::FIN_TIMEOUT_S,
            "dir {}",
            v.dir
        );
    }
    assert_eq!(lb.ctr(ctr::CT_FIN), 1);
}

#[test]
fn a_deferred_flow_replaces_a_leftover_reply_entry_of_the_same_client_port() {
    let mut lb = Lb::new(&[
        &rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]),
    ]);
    let (listed, other) = listed_and_other(&lb);
    // The same client port first talks to the VIP that inserts both entries, then to the
    // deferring one (a resolver with a fixed source port): the newest flow owns the reply key.
    lb.run(&Frame::udp(CLIENT, 5000, other, 53));
    assert_eq!(dirs(&lb), (1, 1));
    lb.run(&Frame::udp(CLIENT, 5000, listed, 53));
    assert_eq!(dirs(&lb), (2, 0), "the leftover reply entry was removed");
    let r = Frame::udp(EP0, 8080, CLIENT, 5000);
    assert_eq!(lb.run(&r).1, r.with(listed, 53, CLIENT, 5000).bytes());
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
}

#[test]
fn an_endpoint_without_a_target_port_defers_under_the_service_port() {
    let mut lb = Lb::new(&[&format!(
        r#"{{"serviceArguments":{{"externalIP":"{VIP}","port":53,"protocol":"udp","mode":0,"sel":0}},"endpoints":[{{"endpointIP":"{EP0}","targetPort":0,"weight":1}}]}}"#
    )]);
    let f = Frame::udp(CLIENT, 5353, VIP, 53);
    assert_eq!(lb.run(&f).1, f.with(CLIENT, 5353, EP0, 53).bytes());
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 1);
    let r = Frame::udp(EP0, 53, CLIENT, 5353);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5353).bytes());
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
}

#[test]
fn a_client_fin_before_the_first_reply_leaves_the_reply_direction_open() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)])]);
    lb.run(&Frame::tcp(CLIENT, 40000, VIP, 80));
    let mut fin = Frame::tcp(CLIENT, 40000, VIP, 80);
    fin.tcp_flags = FIN | ACK;
    lb.run(&fin);
    lb.run(&Frame::tcp(EP0, 8080, CLIENT, 40000));
    let ct = lb.ct();
    let rev = ct.iter().find(|(_, v)| v.dir == dir::REV).unwrap().1;
    // The forward FIN shortened the flow's timeout; the reply direction has sent no FIN yet,
    // so the server's FIN still counts.
    assert_eq!(
        (rev.state, rev.timeout_s),
        (0, loxi_common::maps::FIN_TIMEOUT_S)
    );
    let mut sfin = Frame::tcp(EP0, 8080, CLIENT, 40000);
    sfin.tcp_flags = FIN | ACK;
    lb.run(&sfin);
    assert_eq!(lb.ctr(ctr::CT_FIN), 2);
}
