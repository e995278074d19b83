//! Deferred reply entries of DNAT flows ([`crate::l4::reply`]): one conntrack insert at
//! creation, the reply entry at the first reply, and the loader's retirement that gives the
//! flows still waiting their reply entries before the endpoint's reply-VIP entry goes.
use std::time::{Duration, Instant};

use loxi_common::maps::{ctr, dir};

use super::*;
use crate::l4::reply::{RETIRE_AFTER, RETRY_AFTER};

const VIP: &str = "20.0.0.1";
const VIP2: &str = "20.0.0.2";
const CLIENT: &str = "192.168.0.1";
const EP0: &str = "10.0.1.2";
const EP1: &str = "10.0.1.3";

/// (forward, reply) entries in conntrack.
fn dirs(lb: &Lb) -> (usize, usize) {
    let ct = lb.ct();
    let fwd = ct.iter().filter(|(_, v)| v.dir == dir::FWD).count();
    (fwd, ct.len() - fwd)
}

/// The conntrack key of the forward direction of `f` (as the program keys it).
fn key_of(lb: &Lb, saddr: &str, sport: u16) -> loxi_common::maps::CtKey {
    let ip: std::net::Ipv4Addr = saddr.parse().unwrap();
    lb.ct()
        .into_iter()
        .find(|(k, _)| k.saddr[..4] == ip.octets() && k.sport == sport.to_be())
        .unwrap_or_else(|| panic!("no entry from {saddr}:{sport}"))
        .0
}

/// A round-robin UDP service of two endpoints and one flow from `CLIENT`:5000 that its
/// endpoint has answered: the data path, the flow's forward frame, its endpoint and the reply.
fn answered_flow_of_two_endpoints() -> (Lb, Frame, String, Frame) {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1), (EP1, 1)])]);
    let f = Frame::udp(CLIENT, 5000, VIP, 53);
    let first = dst_of(&lb.run(&f).1).to_string();
    let r = Frame::udp(&first, 8080, CLIENT, 5000);
    lb.run(&r);
    (lb, f, first, r)
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
fn an_endpoint_two_vips_share_defers_for_neither() {
    let mut lb = Lb::new(&[
        &rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]),
    ]);
    assert!(lb.dp.reply_vip_pairs().is_empty());
    lb.run(&Frame::udp(CLIENT, 1000, VIP, 53));
    lb.run(&Frame::udp(CLIENT, 2000, VIP2, 53));
    assert_eq!(dirs(&lb), (2, 2), "both flows insert both entries");
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 0);
    // Each reply is un-NATed to its own flow's VIP.
    for (port, vip) in [(1000, VIP), (2000, VIP2)] {
        let r = Frame::udp(EP0, 8080, CLIENT, port);
        assert_eq!(lb.run(&r).1, r.with(vip, 53, CLIENT, port).bytes());
    }
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 0);
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
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1), (EP1, 1)])]);
    let f = Frame::udp(CLIENT, 5353, VIP, 53);
    let out = lb.run(&f).1;
    let chosen = dst_of(&out).to_string();
    assert_eq!(dirs(&lb), (1, 0));
    // The flow's endpoint leaves the rule; the flow keeps it (conntrack).
    let rest = if chosen == EP0 { EP1 } else { EP0 };
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
fn an_endpoint_a_second_vip_gains_stops_deferring_at_once_and_its_waiting_flows_get_replies() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    assert_eq!(lb.dp.reply_vip_pairs().len(), 1);
    lb.run(&Frame::udp(CLIENT, 1000, VIP, 53));
    assert_eq!(dirs(&lb), (1, 0));
    // VIP2 gains the endpoint: the pair is retired in the same apply (no grace), after the
    // waiting flow got its reply entry from the loader.
    lb.set_rules(&[
        &rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]),
    ]);
    assert!(lb.dp.reply_vip_pairs().is_empty());
    assert_eq!(dirs(&lb), (1, 1));
    let r = Frame::udp(EP0, 8080, CLIENT, 1000);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 1000).bytes());
    assert_eq!(
        lb.ctr(ctr::CT_REPLY_ADDED),
        0,
        "the loader's entry answered"
    );
    // A VIP2 flow from another client port; VIP2 then loses the endpoint again: VIP's pair
    // waits while that flow lives, as for any other VIP's live flow.
    lb.run(&Frame::udp(CLIENT, 2000, VIP2, 53));
    lb.set_rules(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    assert!(lb.dp.reply_vip_pairs().is_empty());
}

/// VIP's rule alone, with two UDP flows to EP0 whose reply entries are deferred; and the rules
/// of VIP and of VIP2 (which shares EP0, so applying both retires EP0's reply-VIP entry).
fn two_deferred_flows_before_vip2_shares_the_endpoint() -> (Lb, String, String) {
    let one = rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]);
    let two = rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]);
    let mut lb = Lb::new(&[&one]);
    lb.run(&Frame::udp(CLIENT, 1000, VIP, 53));
    lb.run(&Frame::udp(CLIENT, 1001, VIP, 53));
    assert_eq!(dirs(&lb), (2, 0));
    (lb, one, two)
}

/// A retirement walk cut off by its bound proves no absence: the entry stays (the deferred
/// flows' replies keep finding their VIP through it) until a whole walk retires it.
#[test]
fn a_retirement_whose_walk_is_cut_off_keeps_the_entry_until_a_whole_walk() {
    let (mut lb, one, two) = two_deferred_flows_before_vip2_shares_the_endpoint();
    // VIP2 gains the endpoint while a walk reads one entry of the two.
    lb.dp.set_walk_bound(1);
    lb.set_rules(&[&one, &two]);
    assert_eq!(
        lb.dp.reply_vip_pairs().len(),
        1,
        "kept after a cut-off walk"
    );
    let r = Frame::udp(EP0, 8080, CLIENT, 1001);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 1001).bytes());
    // The next apply walks the whole map: retired, and the other flow got its reply entry.
    lb.dp.set_walk_bound(usize::MAX);
    lb.set_rules(&[&one, &two]);
    assert!(lb.dp.reply_vip_pairs().is_empty());
    assert_eq!(dirs(&lb), (2, 2));
    let r = Frame::udp(EP0, 8080, CLIENT, 1000);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 1000).bytes());
}

/// The second walk of a retirement (after the delete) cut off: the entry is put back in the
/// kernel map (new flows of the VIP keep deferring their reply entries) until a whole walk.
/// The first walk itself adds reply entries, so a bound just above the map's size before it
/// cuts the second one off.
#[test]
fn a_retirement_whose_second_walk_is_cut_off_puts_the_entry_back() {
    let (mut lb, one, two) = two_deferred_flows_before_vip2_shares_the_endpoint();
    // The first walk reads both entries (whole) and adds their two reply entries; the second
    // reads three of the four.
    lb.dp.set_walk_bound(3);
    lb.set_rules(&[&one, &two]);
    assert_eq!(dirs(&lb), (2, 2), "the first walk's reply entries stay");
    assert_eq!(lb.dp.reply_vip_pairs().len(), 1, "kept for the next try");
    // Back in the kernel map: a new flow of the VIP still defers its reply entry.
    lb.run(&Frame::udp(CLIENT, 1002, VIP, 53));
    assert_eq!(dirs(&lb), (3, 2), "the new flow's reply entry is deferred");
    // Its reply finds the VIP through the entry, and the flow's reply entry is added then.
    let r = Frame::udp(EP0, 8080, CLIENT, 1002);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 1002).bytes());
    assert_eq!(dirs(&lb), (3, 3));
    // A whole walk retires it.
    lb.dp.set_walk_bound(usize::MAX);
    lb.set_rules(&[&one, &two]);
    assert!(lb.dp.reply_vip_pairs().is_empty());
    lb.run(&Frame::udp(CLIENT, 1003, VIP, 53));
    assert_eq!(
        dirs(&lb),
        (4, 4),
        "no longer deferred: both entries at creation"
    );
}

#[test]
fn the_newest_flow_of_a_client_port_owns_the_reply_key_of_a_shared_endpoint() {
    let mut lb = Lb::new(&[
        &rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]),
    ]);
    // The same client port talks to one VIP, then to the other (a resolver with a fixed
    // source port): the second flow's reply entry replaces the first's.
    lb.run(&Frame::udp(CLIENT, 5000, VIP2, 53));
    lb.run(&Frame::udp(CLIENT, 5000, VIP, 53));
    assert_eq!(dirs(&lb), (2, 1));
    let r = Frame::udp(EP0, 8080, CLIENT, 5000);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5000).bytes());
}

#[test]
fn a_reset_of_one_flow_leaves_the_reply_entry_a_newer_flow_took() {
    let mut lb = Lb::new(&[
        &rule(VIP, 80, "tcp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 80, "tcp", 0, 0, &[(EP0, 1)]),
    ]);
    lb.run(&Frame::tcp(CLIENT, 5000, VIP2, 80));
    lb.run(&Frame::tcp(CLIENT, 5000, VIP, 80));
    assert_eq!(dirs(&lb), (2, 1), "the newer flow took the reply key");
    let mut rst = Frame::tcp(CLIENT, 5000, VIP2, 80);
    rst.tcp_flags = RST | ACK;
    lb.run(&rst);
    assert_eq!(lb.ctr(ctr::CT_RST), 1);
    assert_eq!(
        dirs(&lb),
        (1, 1),
        "only the reset flow's forward entry went"
    );
    let r = Frame::tcp(EP0, 8080, CLIENT, 5000);
    assert_eq!(lb.run(&r).1, r.with(VIP, 80, CLIENT, 5000).bytes());
}

#[test]
fn the_pair_waits_while_a_flow_of_another_vip_to_the_endpoint_lives() {
    let mut lb = Lb::new(&[
        &rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)]),
        &rule(VIP2, 53, "udp", 0, 0, &[(EP0, 1)]),
    ]);
    lb.run(&Frame::udp(CLIENT, 5000, VIP2, 53));
    // VIP2's rule goes; its flow lives on in conntrack (established flows keep their
    // endpoint), so VIP's flows to the endpoint do not defer yet.
    lb.set_rules(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    assert!(lb.dp.reply_vip_pairs().is_empty(), "waits for VIP2's flow");
    let p = lb.current().clone();
    lb.dp
        .sync_reply_vips(&p, Instant::now() + RETRY_AFTER)
        .unwrap();
    assert!(lb.dp.reply_vip_pairs().is_empty(), "still live");
    // VIP2's flow goes idle past its timeout (both entries stay in the map until a packet or
    // the LRU finds them): the pair is listed at the first sync after the retry delay.
    let fk = key_of(&lb, CLIENT, 5000);
    let rk = key_of(&lb, EP0, 8080);
    lb.age_out(&fk);
    lb.age_out(&rk);
    let later = Instant::now() + 2 * RETRY_AFTER;
    lb.dp.sync_reply_vips(&p, later).unwrap();
    assert_eq!(lb.dp.reply_vip_pairs().len(), 1);
    // The same client port now talks to VIP: its flow defers, and its first reply, which
    // finds VIP2's stale reply entry, is answered from VIP (the stale flow closed, VIP's reply
    // entry inserted from its forward entry).
    lb.run(&Frame::udp(CLIENT, 5000, VIP, 53));
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 1);
    let r = Frame::udp(EP0, 8080, CLIENT, 5000);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5000).bytes());
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
    assert_eq!(dirs(&lb), (1, 1));
    let ct = lb.ct();
    let rev = ct.iter().find(|(_, v)| v.dir == dir::REV).unwrap().1;
    assert_eq!(rev.packets, 1, "a fresh entry, not VIP2's");
}

#[test]
fn a_reply_entry_left_by_an_evicted_forward_entry_serves_the_tuple_s_next_flow() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    let f = Frame::udp(CLIENT, 5000, VIP, 53);
    let r = Frame::udp(EP0, 8080, CLIENT, 5000);
    lb.run(&f);
    lb.run(&r);
    assert_eq!(dirs(&lb), (1, 1));
    // The LRU evicts the forward entry alone; the same tuple's next packet is a new flow,
    // which defers without looking under its reply key.
    let fk = key_of(&lb, CLIENT, 5000);
    let rk = key_of(&lb, EP0, 8080);
    lb.evict(&fk);
    lb.run(&f);
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 2);
    assert_eq!(lb.ctr(ctr::CT_REPLY_DEFERRED), 2);
    // The entry left behind rewrites its replies as the new flow's own would.
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5000).bytes());
    assert_eq!(lb.ctr(ctr::CT_REPLY_ADDED), 1);
    // Idle past its timeout while the new flow's forward entry is live, it is refreshed, not
    // closed with the new flow's forward entry.
    lb.age_out(&rk);
    assert_eq!(lb.run(&r).1, r.with(VIP, 53, CLIENT, 5000).bytes());
    assert_eq!(lb.ctr(ctr::CT_EXPIRED), 0, "refreshed, not replaced");
    assert_eq!(dirs(&lb), (1, 1), "both directions live");
    lb.run(&f);
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 2, "the forward entry was kept");
}

#[test]
fn a_stale_reply_entry_is_closed_without_the_forward_entry_of_a_newer_flow_it_does_not_answer() {
    // A reply entry outlives its flow's evicted forward entry; the tuple's next flow goes to
    // the other endpoint. When the old entry is found idle past its timeout, it is closed
    // alone: the forward entry under its opposite key is the newer flow's, not its own.
    let (mut lb, f, first, r) = answered_flow_of_two_endpoints();
    assert_eq!(dirs(&lb), (1, 1));
    lb.evict(&key_of(&lb, CLIENT, 5000));
    let second = dst_of(&lb.run(&f).1).to_string();
    assert_ne!(
        second, first,
        "round robin: the next flow goes to the other endpoint"
    );
    let rk = key_of(&lb, &first, 8080);
    lb.age_out(&rk);
    let (act, out) = lb.run(&r);
    assert_eq!(
        (act, out),
        (XDP_PASS, r.bytes()),
        "the stale entry's reply passes as it is"
    );
    assert_eq!(lb.ctr(ctr::CT_EXPIRED), 1);
    assert_eq!(dirs(&lb), (1, 0), "the newer flow's forward entry stays");
    assert_eq!(dst_of(&lb.run(&f).1).to_string(), second);
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 2, "the newer flow kept its entry");
}

#[test]
fn a_quiet_forward_direction_of_a_flow_whose_replies_go_on_keeps_its_endpoint() {
    // A stream the endpoint pushes: the client's direction idles past the timeout while
    // replies keep coming, then the client speaks again. As in the kernel's conntrack, the
    // flow is alive: its next packet goes to the same endpoint, not to a new selection.
    let (mut lb, f, first, r) = answered_flow_of_two_endpoints();
    let fk = key_of(&lb, CLIENT, 5000);
    lb.age_out(&fk);
    lb.run(&r);
    assert_eq!(dst_of(&lb.run(&f).1).to_string(), first);
    assert_eq!(lb.ctr(ctr::NEW_FLOW), 1);
    assert_eq!(lb.ctr(ctr::CT_EXPIRED), 0);
    assert_eq!(dirs(&lb), (1, 1));
}

#[test]
fn a_reply_direction_idle_past_its_timeout_is_closed_with_an_idle_forward_entry() {
    let mut lb = Lb::new(&[&rule(VIP, 53, "udp", 0, 0, &[(EP0, 1)])]);
    let r = Frame::udp(EP0, 8080, CLIENT, 5000);
    lb.run(&Frame::udp(CLIENT, 5000, VIP, 53));
    lb.run(&r);
    let fk = key_of(&lb, CLIENT, 5000);
    let rk = key_of(&lb, EP0, 8080);
    lb.age_out(&fk);
    lb.age_out(&rk);
    let (act, out) = lb.run(&r);
    assert_eq!(
        (act, out),
        (XDP_PASS, r.bytes()),
        "a reply of no live flow passes"
    );
    assert_eq!(lb.ctr(ctr::CT_EXPIRED), 1);
    assert_eq!(lb.stored(), 0, "both entries removed");
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
