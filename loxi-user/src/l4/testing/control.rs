//! Control-plane side of the L4 layer: plan tables, metrics export, netlink VIPs.
use std::{collections::BTreeSet, net::IpAddr, process::Command};

use loxi_common::maps::{EndpointValue, ctr};
use prometheus_client::{encoding::text::encode, registry::Registry};

use super::*;
use crate::{
    l4::{
        L4Metrics,
        metrics::CounterFold,
        plan::{active_table, wrr_table},
    },
    netlink::{NetlinkError, VipManager},
};

fn ep(weight: u16, active: u8) -> EndpointValue {
    EndpointValue {
        weight,
        active,
        ..Default::default()
    }
}

#[test]
fn wrr_table_repeats_active_rows_by_weight_and_scales_past_its_size() {
    let (t, n) = wrr_table(&[ep(1, 1), ep(3, 1), ep(5, 0)]);
    assert_eq!((n, &t[..4]), (4, &[0u8, 1, 1, 1][..]));
    let (t, n) = wrr_table(&[ep(100, 1), ep(300, 1)]);
    assert_eq!(n, 64);
    assert_eq!(t.iter().filter(|r| **r == 0).count(), 16);
    let (a, n) = active_table(&[ep(1, 0), ep(1, 1), ep(1, 1)]);
    assert_eq!((n, &a[..2]), (2, &[1u8, 2][..]));
}

#[test]
fn slots_stay_stable_on_update_and_are_reused_after_delete() {
    let mut lb = Lb::new(&[
        &rule("20.0.0.1", 80, "tcp", 0, 0, &[("10.0.1.2", 1)]),
        &rule("20.0.0.2", 80, "tcp", 0, 0, &[("10.0.1.3", 1)]),
    ]);
    let before = lb.plan_slots();
    lb.set_rules(&[
        &rule(
            "20.0.0.1",
            80,
            "tcp",
            0,
            0,
            &[("10.0.1.2", 1), ("10.0.1.4", 1)],
        ),
        &rule("20.0.0.2", 80, "tcp", 0, 0, &[("10.0.1.3", 1)]),
    ]);
    assert_eq!(lb.plan_slots(), before, "updated rule keeps its slot");
    lb.set_rules(&[
        &rule("20.0.0.1", 80, "tcp", 0, 0, &[("10.0.1.2", 1)]),
        &rule("20.0.0.3", 80, "tcp", 0, 0, &[("10.0.1.3", 1)]),
    ]);
    let after = lb.plan_slots();
    assert_eq!(after[0], before[0]);
    assert_eq!(
        after[1].1, before[1].1,
        "the deleted rule's slot is reused in the same snapshot"
    );
    assert_ne!(after[1].0, before[1].0);
    // The reused slot holds the new rule's endpoint (not wiped by the old rule's removal).
    let f = Frame::tcp("192.168.0.1", 40000, "20.0.0.3", 80);
    assert_eq!(
        lb.run(&f).1,
        f.with("192.168.0.1", 40000, "10.0.1.3", 8080).bytes()
    );
}

#[test]
fn counters_are_exported_as_prometheus_deltas() {
    let mut lb = Lb::new(&[&rule("20.0.0.1", 80, "tcp", 0, 0, &[("10.0.1.2", 1)])]);
    let mut reg = Registry::default();
    let m = L4Metrics::register(&mut reg);
    let mut fold = CounterFold::default();
    for p in 0..3 {
        lb.run(&Frame::tcp("192.168.0.1", 40000 + p, "20.0.0.1", 80));
    }
    fold.fold(&lb.dp, lb.current(), &m).unwrap();
    lb.run(&Frame::tcp("192.168.0.1", 40009, "20.0.0.1", 80));
    fold.fold(&lb.dp, lb.current(), &m).unwrap();
    let mut text = String::new();
    encode(&mut text, &reg).unwrap();
    assert!(
        text.contains(r#"loxilb_l4_events_total{event="new_flow"} 4"#),
        "{text}"
    );
    let id = lb.current().services.values().next().unwrap().rule_id;
    assert!(
        text.contains(&format!(
            r#"loxilb_l4_endpoint_packets_total{{service="{id}",endpoint="0"}} 4"#
        )),
        "{text}"
    );
    assert_eq!(lb.ctr(ctr::NAT_FWD), 4);
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("m.txt");
    std::fs::write(&f, &text).unwrap();
    // promtool parses the exposition; its only complaint may be the OpenMetrics naming
    // (HELP on the family name, samples with `_total`), reported as "no help text".
    let out = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&f).unwrap())
        .output()
        .expect("promtool installed (scripts/setup.sh)");
    let report =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        report
            .lines()
            .all(|l| l.trim().is_empty() || l.ends_with("no help text")),
        "promtool: {report}"
    );
}

fn lo_has(ip: &str) -> bool {
    let out = Command::new("ip")
        .args(["addr", "show", "dev", "lo"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).contains(&format!("{ip}/"))
}

#[test]
fn vips_are_added_once_and_only_loxis_own_are_removed() {
    fresh_netns();
    sh("ip link set lo up && ip addr add 20.0.0.9/32 dev lo");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(matches!(
            VipManager::new("nope0", None).await,
            Err(NetlinkError::NoInterface(_))
        ));
        let mut v = VipManager::new("lo", None).await.unwrap();
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let want: BTreeSet<IpAddr> = [
            ip("20.0.0.1"),
            ip("20.0.0.9"),
            ip("2001:db8::1"),
            ip("0.0.0.0"),
            ip("::"),
        ]
        .into();
        v.sync(&want).await.unwrap();
        v.sync(&want).await.unwrap(); // no duplicate, no EEXIST
        assert!(lo_has("20.0.0.1") && lo_has("2001:db8::1"));
        assert_eq!(
            v.added(),
            &BTreeSet::from([ip("20.0.0.1"), ip("2001:db8::1")]),
            "20.0.0.9 was already there; the wildcards need no VIP (the kernel takes \
             0.0.0.0/32 and never lists it, so it was added again at every sync)"
        );
        v.release_all().await.unwrap();
        assert!(!lo_has("20.0.0.1"));
        assert!(lo_has("20.0.0.9"), "an address loxi did not add stays");
    });
}
