//! VIP addresses across a killed daemon: loxi adopts the addresses it added before a SIGKILL
//! (removes them when no rule needs them, keeps them while a restored rule does) and never
//! removes an address added by hand. Runs in a network namespace of its own (root required).

use std::process::Command;
use std::time::{Duration, Instant};

use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::json;

/// A named network namespace (`<prefix><pid>`), deleted on drop.
struct Netns(String);

impl Netns {
    fn new_named(prefix: &str) -> Self {
        let name = format!("{prefix}{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        sh(&format!(
            "ip netns add {name} && ip -n {name} link set lo up"
        ));
        Self(name)
    }

    /// Moves the calling thread into the namespace: every socket it opens afterwards, and
    /// every process it spawns (the daemon), lives there.
    #[allow(unsafe_code, reason = "setns(2) through libc")]
    fn enter(&self) {
        use std::os::fd::AsRawFd as _;
        let f = std::fs::File::open(format!("/run/netns/{}", self.0)).expect("open netns");
        // SAFETY: setns on a valid namespace fd for the calling thread only.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }

    /// `ip -n <ns> addr show dev lo`.
    fn lo_addrs(&self) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.0, "addr", "show", "dev", "lo"])
            .output()
            .expect("ip addr");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn sh(c: &str) {
    let ok = Command::new("sh").args(["-c", c]).status().expect("sh");
    assert!(ok.success(), "{c}");
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// Waits (10 s at most) until `lo` in `ns` has (`present`) or lacks `ip`.
async fn wait_addr(ns: &Netns, d: &Daemon, ip: &str, present: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while ns.lo_addrs().contains(&format!("{ip}/")) != present {
        if Instant::now() > deadline {
            d.dump_log();
            panic!(
                "{ip} {} on lo: {}",
                if present {
                    "never appeared"
                } else {
                    "never left"
                },
                ns.lo_addrs()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn vips_of_a_killed_daemon_are_adopted_at_restart_and_hand_added_ones_stay() {
    assert!(
        is_root(),
        "this test needs root (a network namespace and VIP addresses)"
    );
    let ns = Netns::new_named("lf-vip");
    ns.enter();
    // One thread: the namespace is the calling thread's.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        sh(&format!("ip -n {} addr add 20.0.9.9/32 dev lo", ns.0));
        let mut d = Daemon::start(DaemonOpts {
            args: vec!["--vip-iface".into(), "lo".into()],
            ..Default::default()
        })
        .await;
        let port = free_port();
        let rule = |ip: &str| {
            json!({
                "serviceArguments": {"externalIP": ip, "port": port, "mode": 4, "sel": 0},
                "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 9}]
            })
        };
        let (status, body) = d.post_rule(&rule("20.0.9.1")).await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = d.post_rule(&rule("20.0.9.2")).await;
        assert_eq!(status, 200, "{body}");
        wait_addr(&ns, &d, "20.0.9.1", true).await;
        wait_addr(&ns, &d, "20.0.9.2", true).await;

        // SIGKILL: no clean-up runs, the addresses stay.
        d.kill();
        let after_kill = ns.lo_addrs();
        assert!(
            after_kill.contains("20.0.9.1/32") && after_kill.contains("20.0.9.2/32"),
            "{after_kill}"
        );

        // The restart restores both rules and adopts both addresses: kept while wanted.
        d.restart().await;
        wait_addr(&ns, &d, "20.0.9.1", true).await;
        let log = d.log_text();
        assert!(
            log.matches("VIP left on the interface by an earlier run adopted")
                .count()
                == 2,
            "{log}"
        );
        // Deleting a rule now removes its (adopted) address.
        let (status, body) = d.delete_rule("20.0.9.1", port, "tcp", None).await;
        assert_eq!(status, 200, "{body}");
        wait_addr(&ns, &d, "20.0.9.1", false).await;
        assert!(ns.lo_addrs().contains("20.0.9.2/32"), "{}", ns.lo_addrs());

        // Killed again, then restarted with no rules: the address it left is removed.
        d.kill();
        assert!(ns.lo_addrs().contains("20.0.9.2/32"), "{}", ns.lo_addrs());
        std::fs::remove_file(d.state_dir().join("rules.json")).expect("remove rules.json");
        d.restart().await;
        wait_addr(&ns, &d, "20.0.9.2", false).await;

        // The hand-added address was never touched.
        assert!(ns.lo_addrs().contains("20.0.9.9/32"), "{}", ns.lo_addrs());
        d.stop().await;
        assert!(ns.lo_addrs().contains("20.0.9.9/32"), "{}", ns.lo_addrs());
    });
}

#[test]
fn an_address_added_by_hand_where_a_killed_daemon_had_its_vip_is_not_adopted() {
    assert!(
        is_root(),
        "this test needs root (a network namespace and VIP addresses)"
    );
    let ns = Netns::new_named("lf-viph");
    ns.enter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut d = Daemon::start(DaemonOpts::default()).await;
        let port = free_port();
        let (status, body) = d
            .post_rule(&json!({
                "serviceArguments": {"externalIP": "20.0.8.1", "port": port, "mode": 4, "sel": 0},
                "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 9}]
            }))
            .await;
        assert_eq!(status, 200, "{body}");
        wait_addr(&ns, &d, "20.0.8.1", true).await;
        d.kill();
        // The operator replaces it by hand (no marker) while the daemon is down.
        sh(&format!(
            "ip -n {0} addr del 20.0.8.1/32 dev lo && ip -n {0} addr add 20.0.8.1/32 dev lo",
            ns.0
        ));
        std::fs::remove_file(d.state_dir().join("rules.json")).expect("remove rules.json");
        d.restart().await;
        // Give the L4 task its first reconcile, then check the address is still there.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(ns.lo_addrs().contains("20.0.8.1/32"), "{}", ns.lo_addrs());
        assert!(
            d.log_text()
                .contains("recorded VIP is on the interface without loxi's marker"),
            "{}",
            d.log_text()
        );
        d.stop().await;
        assert!(ns.lo_addrs().contains("20.0.8.1/32"), "{}", ns.lo_addrs());
    });
}

/// An IPv6 VIP on an interface that runs duplicate address detection (a veth with its peer up,
/// unlike `lo`) is usable as soon as the API has answered: added without DAD, it is never
/// `tentative`, and a client connects to the rule's listener at once (with DAD it was refused
/// for a second or more after the 200).
#[test]
fn an_ipv6_vip_on_a_veth_takes_connections_as_soon_as_the_rule_is_answered() {
    assert!(
        is_root(),
        "this test needs root (a network namespace and VIP addresses)"
    );
    let ns = Netns::new_named("lf-vip6");
    sh(&format!(
        "ip -n {0} link add v0 type veth peer name v1 && ip -n {0} link set v0 up \
         && ip -n {0} link set v1 up",
        ns.0
    ));
    ns.enter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut d = Daemon::start(DaemonOpts {
            args: vec!["--vip-iface".into(), "v0".into()],
            ..Default::default()
        })
        .await;
        let port = free_port();
        let (status, body) = d
            .post_rule(&json!({
                "serviceArguments": {"externalIP": "fd00:99::2", "port": port, "mode": 4, "sel": 0},
                "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 9}]
            }))
            .await;
        assert_eq!(status, 200, "{body}");
        let v0 = || {
            let out = Command::new("ip")
                .args(["-n", &ns.0, "-6", "addr", "show", "dev", "v0"])
                .output()
                .expect("ip addr");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !v0().contains("fd00:99::2/128") {
            assert!(Instant::now() < deadline, "VIP never added: {}", v0());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let shown = v0();
        let line = shown
            .lines()
            .find(|l| l.contains("fd00:99::2/128"))
            .expect("the VIP's line");
        assert!(!line.contains("tentative"), "{shown}");
        // Connect right away: the listener accepts on the VIP (its endpoint need not answer).
        let addr = std::net::SocketAddr::from((
            std::net::Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 2),
            port,
        ));
        let conn = tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr),
        )
        .await;
        assert!(
            matches!(conn, Ok(Ok(_))),
            "connect to {addr} right after the VIP appeared: {conn:?}; {}",
            v0()
        );
        d.stop().await;
    });
}
