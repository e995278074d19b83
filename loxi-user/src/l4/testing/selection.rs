//! In-kernel selection over many synthetic flows, conntrack stickiness, RST/FIN handling and
//! live rule updates.
use std::{collections::BTreeMap, net::IpAddr};

use loxi_common::{maps::ctr, sel};

use super::*;

const VIP: &str = "20.0.0.1";
const EPS: [&str; 3] = ["10.0.1.2", "10.0.1.3", "10.0.1.4"];

/// Sends `n` new flows (distinct client ports, or distinct clients if `vary_client`) and
/// counts the chosen endpoints.
fn spread(lb: &mut Lb, n: u16, vary_client: bool) -> BTreeMap<IpAddr, u32> {
    let mut m = BTreeMap::new();
    for i in 0..n {
        let f = if vary_client {
            Frame::tcp(
                &format!("192.168.{}.{}", i / 200, 1 + i % 200),
                40000,
                VIP,
                80,
            )
        } else {
            Frame::tcp("192.168.0.1", 20000 + i, VIP, 80)
        };
        let (_, out) = lb.run(&f);
        *m.entry(dst_of(&out)).or_insert(0) += 1;
    }
    m
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn rr_spreads_new_flows_evenly() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::RR,
        &[(EPS[0], 1), (EPS[1], 1), (EPS[2], 1)],
    )]);
    let m = spread(&mut lb, 300, false);
    assert_eq!(
        m.values().copied().collect::<Vec<_>>(),
        vec![100, 100, 100],
        "{m:?}"
    );
}

#[test]
fn wrr_follows_weights() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::WRR,
        &[(EPS[0], 1), (EPS[1], 3)],
    )]);
    let m = spread(&mut lb, 400, false);
    assert_eq!(m.get(&ip(EPS[0])), Some(&100), "{m:?}");
    assert_eq!(m.get(&ip(EPS[1])), Some(&300), "{m:?}");
}

#[test]
fn hash_is_a_pure_function_of_the_tuple_and_spreads() {
    let r = rule(VIP, 80, "tcp", 0, sel::HASH, &[(EPS[0], 1), (EPS[1], 1)]);
    let mut a = Lb::new(&[&r]);
    let mut b = Lb::new(&[&r]);
    let mut counts = BTreeMap::new();
    for i in 0..300u16 {
        let f = Frame::tcp("192.168.0.1", 30000 + i * 7, VIP, 80);
        let da = dst_of(&a.run(&f).1);
        // A second, independent data path (fresh conntrack, other cursor) picks the same.
        assert_eq!(da, dst_of(&b.run(&f).1), "tuple {i}");
        *counts.entry(da).or_insert(0u32) += 1;
    }
    assert!(counts.values().all(|c| *c >= 100), "{counts:?}");
}

#[test]
fn persist_pins_a_client_address_and_spreads_clients() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::PERSIST,
        &[(EPS[0], 1), (EPS[1], 1), (EPS[2], 1)],
    )]);
    let same = spread(&mut lb, 50, false);
    assert_eq!(
        same.len(),
        1,
        "one client, many ports → one endpoint: {same:?}"
    );
    let clients = spread(&mut lb, 300, true);
    assert_eq!(clients.len(), 3, "{clients:?}");
    assert!(clients.values().all(|c| *c >= 60), "{clients:?}");
}

#[test]
fn lc_sends_new_flows_to_the_endpoint_with_fewest_connections() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::LC,
        &[(EPS[0], 1), (EPS[1], 1)],
    )]);
    let a = Frame::tcp("192.168.0.1", 1001, VIP, 80);
    let b = Frame::tcp("192.168.0.1", 1002, VIP, 80);
    let ea = dst_of(&lb.run(&a).1);
    let eb = dst_of(&lb.run(&b).1);
    assert_ne!(ea, eb, "one connection each");
    let mut rst = a.clone();
    rst.tcp_flags = RST;
    lb.run(&rst);
    for p in [1003, 1004] {
        // ea is at 0 connections, eb at 1: the next flow goes to ea; then they tie again.
        let e = dst_of(&lb.run(&Frame::tcp("192.168.0.1", p, VIP, 80)).1);
        if p == 1003 {
            assert_eq!(e, ea);
        }
    }
}

#[test]
fn established_flows_stick_to_their_endpoint() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::RR,
        &[(EPS[0], 1), (EPS[1], 1), (EPS[2], 1)],
    )]);
    let f = Frame::tcp("192.168.0.1", 40000, VIP, 80);
    let first = dst_of(&lb.run(&f).1);
    let mut ack = f.clone();
    ack.tcp_flags = ACK;
    for _ in 0..20 {
        assert_eq!(dst_of(&lb.run(&ack).1), first);
    }
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 1);
}

#[test]
fn rst_ends_the_flow_and_fin_keeps_it_until_timeout() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::RR,
        &[(EPS[0], 1), (EPS[1], 1)],
    )]);
    let f = Frame::tcp("192.168.0.1", 40000, VIP, 80);
    lb.run(&f);
    let mut fin = f.clone();
    fin.tcp_flags = FIN | ACK;
    lb.run(&fin);
    lb.run(&fin);
    assert_eq!(
        (lb.ctr(ctr::CT_FIN), lb.ctr(ctr::NEW_FLOW)),
        (1, 1),
        "FIN counted once, flow kept"
    );
    let mut rst = f.clone();
    rst.tcp_flags = RST;
    lb.run(&rst);
    assert_eq!(lb.ctr(ctr::CT_RST), 1);
    lb.run(&f);
    assert_eq!(
        lb.ctr(ctr::NEW_FLOW),
        2,
        "after RST the same tuple is a new flow"
    );
}

#[test]
fn removed_endpoint_gets_no_new_flows_but_keeps_its_established_ones() {
    let mut lb = Lb::new(&[&rule(
        VIP,
        80,
        "tcp",
        0,
        sel::RR,
        &[(EPS[0], 1), (EPS[1], 1)],
    )]);
    let old: Vec<Frame> = (0..4)
        .map(|i| Frame::tcp("192.168.0.1", 41000 + i, VIP, 80))
        .collect();
    let before: Vec<IpAddr> = old.iter().map(|f| dst_of(&lb.run(f).1)).collect();
    assert!(before.contains(&ip(EPS[0])) && before.contains(&ip(EPS[1])));
    lb.set_rules(&[&rule(VIP, 80, "tcp", 0, sel::RR, &[(EPS[1], 1)])]);
    for (f, want) in old.iter().zip(&before) {
        let mut ack = f.clone();
        ack.tcp_flags = ACK;
        assert_eq!(
            dst_of(&lb.run(&ack).1),
            *want,
            "established flow keeps its endpoint"
        );
    }
    let m = spread(&mut lb, 20, false);
    assert_eq!(m.get(&ip(EPS[1])), Some(&20), "{m:?}");
}

#[test]
fn deleting_the_rule_stops_new_flows() {
    let mut lb = Lb::new(&[&rule(VIP, 80, "tcp", 0, sel::RR, &[(EPS[0], 1)])]);
    lb.set_rules(&[]);
    let f = Frame::tcp("192.168.0.1", 40000, VIP, 80);
    assert_eq!(lb.run(&f), (XDP_PASS, f.bytes()));
}

#[test]
fn idle_flows_expire_after_the_rules_inactive_timeout() {
    let r = rule(VIP, 80, "udp", 0, sel::RR, &[(EPS[0], 1), (EPS[1], 1)])
        .replace(r#""sel":0"#, r#""sel":0,"inactiveTimeOut":1"#);
    let mut lb = Lb::new(&[&r]);
    let f = Frame::udp("192.168.0.1", 40000, VIP, 80);
    lb.run(&f);
    lb.run(&f);
    assert_eq!((lb.ctr(ctr::NEW_FLOW), lb.ctr(ctr::CT_EXPIRED)), (1, 0));
    // Kernel time cannot be paused: wait out the 1 s timeout for real.
    std::thread::sleep(std::time::Duration::from_millis(1300));
    lb.run(&f);
    assert_eq!((lb.ctr(ctr::NEW_FLOW), lb.ctr(ctr::CT_EXPIRED)), (2, 1));
}
