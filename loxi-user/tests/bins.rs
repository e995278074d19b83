//! The two binaries start and describe their interface. Also makes `cargo test --workspace`
//! build `loxilb` and `loxicmd` into `target/<profile>/`, where the `loxi-tests` harness runs
//! them.

use std::process::Command;

#[test]
fn loxilb_help_lists_every_daemon_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_loxilb"))
        .arg("--help")
        .output()
        .expect("run loxilb");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--api-addr",
        "--state-dir",
        "--tokenizer-dir",
        "--log",
        "--shutdown-grace-secs",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
}

#[test]
fn loxicmd_without_a_server_exits_5_naming_the_address() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    // Nothing listens on `port` once the listener above is dropped.
    let out = Command::new(env!("CARGO_BIN_EXE_loxicmd"))
        .args(["--port", &port.to_string(), "get", "lb"])
        .output()
        .expect("run loxicmd");
    // LoxiLB loxicmd's transport class (`cli::EXIT_TRANSPORT`).
    assert_eq!(out.status.code(), Some(5));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
}
