//! LoxiLB's `loxicmd` flags for features loxi does not implement (capacity admission, mTLS,
//! HSTS, PROXY protocol, firewall marks, ...), so that scripts written for LoxiLB's loxicmd
//! parse: each flag is accepted at its zero value (what LoxiLB's loxicmd sends when the flag is
//! left out, so the rule is the same) and refused otherwise, as a usage error (exit 2) naming
//! the flag and saying "loxi does not implement" it — never accepted and dropped.
//!
//! Source of the flag names and zero values: `loxilb-io/loxicmd-inference-gateway`
//! `cmd/create/create_loadbalancer.go` and `cmd/delete/delete_loadbalancer.go` (042ef9a /
//! 083203e).

use std::marker::PhantomData;

use clap::{Arg, ArgMatches, Args, Command, FromArgMatches};

/// One flag: its name, the values that mean "off" (compared case-insensitively; the first is
/// shown in messages), whether it is a bare switch (`--icmp` = `--icmp=true`), and the feature.
#[derive(Debug)]
pub struct ForeignFlag {
    /// The long flag, without `--`.
    pub flag: &'static str,
    /// Accepted values.
    pub zero: &'static [&'static str],
    /// A switch: given bare, its value is `true`.
    pub switch: bool,
    /// What the flag asks for, for the refusal.
    pub what: &'static str,
}

const fn num(flag: &'static str, what: &'static str) -> ForeignFlag {
    ForeignFlag {
        flag,
        zero: &["0"],
        switch: false,
        what,
    }
}

const fn switch(flag: &'static str, what: &'static str) -> ForeignFlag {
    ForeignFlag {
        flag,
        zero: &["false"],
        switch: true,
        what,
    }
}

const fn text(
    flag: &'static str,
    zero: &'static [&'static str],
    what: &'static str,
) -> ForeignFlag {
    ForeignFlag {
        flag,
        zero,
        switch: false,
        what,
    }
}

const FC: &str = "the capacity admission gate (fc-*)";
const MTLS: &str = "mTLS";
const HSTS: &str = "HSTS headers";

/// A table of flags, one per command.
pub trait FlagTable {
    /// The flags.
    const FLAGS: &'static [ForeignFlag];
}

/// `create lb`'s.
#[derive(Debug, Clone, Copy)]
pub struct CreateTable;

impl FlagTable for CreateTable {
    const FLAGS: &'static [ForeignFlag] = &[
        switch("icmp", "ICMP echo rules"),
        num("mark", "firewall marks"),
        text("secips", &[""], "SCTP multihoming (secondary IPs)"),
        text("sources", &[""], "allowed-source lists"),
        switch(
            "attachEP",
            "attaching endpoints to an existing rule (post the whole rule)",
        ),
        switch(
            "detachEP",
            "detaching endpoints from a rule (post the whole rule)",
        ),
        switch("ppv2en", "PROXY protocol v2 towards the endpoints"),
        switch("egress", "egress rules"),
        num("connection-limit", "per-rule connection limits"),
        text("path-prefix", &[""], "path routing"),
        text("path-match-mode", &["", "disabled"], "path routing"),
        text("trace-type", &[""], "deep-inspection traces"),
        text("sockmap-mode", &["", "off"], "sockmap acceleration"),
        text("api-key-auth", &["", "disabled"], "data-plane API keys"),
        num("max-stream-duration", "a per-rule SSE stream cap"),
        num("backend-keepalive-interval", "backend keep-alive probes"),
        switch(
            "cb-enable",
            "a per-rule circuit-breaker switch (loxi's breaker is always on)",
        ),
        num("fc-max-queue-depth", FC),
        num("fc-max-queue-wait-ms", FC),
        text("fc-mode", &["", "off"], FC),
        num("fc-max-outstanding", FC),
        num("fc-ep-max-inflight", FC),
        num("fc-prefill-max-inflight", FC),
        num("fc-decode-max-inflight", FC),
        num("fc-telemetry-stale-ms", FC),
        text("fc-adaptive", &["", "off"], FC),
        num("fc-warmup-ms", FC),
        num("fc-ttft-target-ms", FC),
        text("fc-expose-headers", &["", "off"], FC),
        num("fc-tenant-max-share-pct", FC),
        num("hsts-max-age", HSTS),
        switch("hsts-include-subdomains", HSTS),
        switch("hsts-preload", HSTS),
        text("mtls-client-cert-mode", &["", "disabled"], MTLS),
        text("mtls-client-ca-path", &[""], MTLS),
        switch("mtls-require-client-cn", MTLS),
        text("mtls-client-cn-pattern", &[""], MTLS),
        text("mtls-client-crl-path", &[""], MTLS),
        switch(
            "mtls-backend-verify-server",
            "mTLS (loxi verifies a --security=e2ehttps backend by default: --backend-ca-file, --backend-tls-server-name)",
        ),
        text(
            "mtls-backend-ca-path",
            &[""],
            "mTLS (a --security=e2ehttps backend's CA bundle is --backend-ca-file)",
        ),
        text("mtls-backend-cert-path", &[""], MTLS),
        text("mtls-backend-key-path", &[""], MTLS),
    ];
}

/// `delete lb`'s. (`--bgp` is a real flag there: loxi has no BGP route to withdraw, so any
/// value deletes the rule, as the server's `bgp` query parameter does.)
#[derive(Debug, Clone, Copy)]
pub struct DeleteTable;

impl FlagTable for DeleteTable {
    const FLAGS: &'static [ForeignFlag] = &[
        switch("icmp", "ICMP echo rules"),
        num("mark", "firewall marks"),
        text("path-prefix", &[""], "path routing"),
        text("path-match-mode", &["", "disabled"], "path routing"),
    ];
}

/// The flags of table `T` given on the command line, with their values.
#[derive(Debug, Clone)]
pub struct Foreign<T> {
    /// `(flag, value)` in table order.
    pub given: Vec<(&'static ForeignFlag, String)>,
    table: PhantomData<T>,
}

impl<T: FlagTable> Foreign<T> {
    /// `Err((flag, message))` for the first flag given a value other than its zero.
    pub fn check(&self) -> Result<(), (String, String)> {
        for (f, value) in &self.given {
            if !f.zero.iter().any(|z| z.eq_ignore_ascii_case(value.trim())) {
                let zero = match f.zero[0] {
                    "" => "empty".to_string(),
                    z => z.to_string(),
                };
                return Err((
                    format!("--{}", f.flag),
                    format!(
                        "{value:?}: loxi does not implement {} (LoxiLB's flag is accepted \
                         only at its default, {zero})",
                        f.what
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl<T: FlagTable> FromArgMatches for Foreign<T> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let given = T::FLAGS
            .iter()
            .filter_map(|f| m.get_one::<String>(f.flag).map(|v| (f, v.clone())))
            .collect();
        Ok(Self {
            given,
            table: PhantomData,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl<T: FlagTable> Args for Foreign<T> {
    fn augment_args(cmd: Command) -> Command {
        T::FLAGS.iter().fold(cmd, |cmd, f| {
            let arg = Arg::new(f.flag)
                .long(f.flag)
                .help(format!("LoxiLB's; loxi does not implement {}", f.what))
                .help_heading("LoxiLB flags accepted only at their default");
            cmd.arg(if f.switch {
                arg.num_args(0..=1).default_missing_value("true")
            } else {
                arg
            })
        })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Create {
        #[command(flatten)]
        foreign: Foreign<CreateTable>,
    }

    fn parse(args: &[&str]) -> Result<(), (String, String)> {
        let mut argv = vec!["x"];
        argv.extend_from_slice(args);
        Create::try_parse_from(argv)
            .expect("parses")
            .foreign
            .check()
    }

    #[test]
    fn loxilbs_flags_parse_and_only_their_defaults_pass() {
        parse(&[]).expect("none given");
        parse(&[
            "--mark=0",
            "--ppv2en=false",
            "--egress=false",
            "--path-match-mode=disabled",
            "--connection-limit=0",
            "--max-stream-duration=0",
            "--api-key-auth=Disabled",
            "--fc-mode=off",
            "--secips=",
        ])
        .expect("defaults");
        let (flag, msg) = parse(&["--mark=10"]).expect_err("a mark");
        assert_eq!(flag, "--mark");
        assert!(
            msg.contains("loxi does not implement firewall marks"),
            "{msg}"
        );
        // A bare switch means true.
        let (flag, _) = parse(&["--cb-enable"]).expect_err("bare switch");
        assert_eq!(flag, "--cb-enable");
        let (flag, _) = parse(&["--mtls-client-cert-mode=required"]).expect_err("mtls");
        assert_eq!(flag, "--mtls-client-cert-mode");
        let (flag, msg) = parse(&["--attachEP"]).expect_err("attach");
        assert_eq!(flag, "--attachEP");
        assert!(msg.contains("post the whole rule"), "{msg}");
    }

    #[test]
    fn no_flag_of_a_table_is_one_loxicmd_already_has() {
        // A duplicate long flag would make clap panic at start; each table is checked
        // against the commands it joins (cli/args.rs) by building them.
        use clap::CommandFactory as _;
        crate::cli::args::Cli::command().debug_assert();
        for t in [CreateTable::FLAGS, DeleteTable::FLAGS] {
            let mut seen = std::collections::HashSet::new();
            assert!(t.iter().all(|f| seen.insert(f.flag)));
        }
    }
}
