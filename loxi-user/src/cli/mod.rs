//! `loxicmd`: LoxiLB's CLI verbs over loxi's REST API.
//!
//! `loxicmd create lb <VIP> --tcp=<port>:<targetPort> --endpoints=<ip:weight,...> --mode=..
//! --select=.. [...]`, `loxicmd get lb|lbs|loadbalancer [-o table|json|wide]`, `loxicmd delete lb
//! <VIP> --tcp=<port> [--host ..] [--model-name ..]` or `delete lb --name NAME`, `loxicmd get
//! ep`, `get conntrack|ct`, `get kvinventory --service-id N [--ep-idx M]`, `get kvparity
//! --service-id N`, `get metrics`, `create cert --cert-file F --key-file K [--chain-file C]
//! [--cert-id ID]`, `get cert [ID]`, `delete cert ID` (see [`cert`]); global `-s/--apiserver` (default 127.0.0.1), `-p/--port` (default 11111),
//! `--protocol http|https`, `--cacert FILE`, `--token TOKEN` (or env `LOXI_API_TOKEN`),
//! `--token-file FILE`, `-o/--output table|wide|json` (default `table`), `-t/--timeout SECONDS`
//! (default 10, at least 1); `save --lb|--all [-c DIR]` and `apply --lb FILE` (see [`dump`]).
//!
//! Output and exit codes are LoxiLB's loxicmd's: a create or delete prints the answer's
//! `result` (`Success`); a server error prints `Error: server returned <status>: <message>` on
//! stderr and exits 6 (400), 3 (401/403), 4 (404/409), 5 (429/503) or 7 (other); an
//! unreachable API exits 5, a usage error 2, a local file that cannot be read or written 1.
//! (LoxiLB's `delete lb` prints its errors on stdout and exits 0 whatever happened; loxi's exits
//! with the same taxonomy as the other verbs.) When stdout's reader goes away (`loxicmd get lb |
//! head -1`), loxicmd stops quietly with exit 141, the status a shell shows for Go's loxicmd or
//! coreutils killed by `SIGPIPE`.
pub mod args;
pub mod build;
pub mod cert;
pub mod client;
pub mod dump;
pub mod foreign;
pub mod table;

use std::time::Duration;

use http::Method;

use args::{Cli, CreateWhat, DeleteWhat, GetWhat, OutputFormat, Verb};

/// Exit code of a usage error (bad flag value).
pub const EXIT_USAGE: i32 = 2;
/// Exit code when the API cannot be reached (LoxiLB's "transport" class).
pub const EXIT_TRANSPORT: i32 = 5;
/// Exit code of a local I/O error: a file of `save`/`apply` or stdout cannot be written or read.
pub const EXIT_IO: i32 = 1;
/// Exit code when stdout's reader went away (`EPIPE`): 128 + `SIGPIPE`, what a shell reports
/// for Go's loxicmd or coreutils, which `SIGPIPE` kills in that case.
pub const EXIT_BROKEN_PIPE: i32 = 141;

/// LoxiLB loxicmd's `exitcode.FromHTTPStatus`: 400→6, 401/403→3, 404/409→4, 429/503→5,
/// other→7.
pub fn exit_code_of_status(status: u16) -> i32 {
    match status {
        400 => 6,
        401 | 403 => 3,
        404 | 409 => 4,
        429 | 503 => 5,
        _ => 7,
    }
}

/// A failed invocation: what to print on stderr and the exit code.
#[derive(Debug)]
pub struct Failure {
    /// The message (without the `Error: ` prefix); empty = print nothing (stdout's reader went
    /// away, see [`EXIT_BROKEN_PIPE`]).
    pub message: String,
    /// The process exit code.
    pub code: i32,
}

impl Failure {
    pub(crate) fn usage(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            code: EXIT_USAGE,
        }
    }
}

/// Runs one `loxicmd` invocation; returns the process exit code.
pub async fn run(cli: Cli) -> i32 {
    match run_inner(cli).await {
        Ok(()) => 0,
        Err(f) => {
            if !f.message.is_empty() {
                eprintln!("Error: {}", f.message);
            }
            f.code
        }
    }
}

async fn run_inner(cli: Cli) -> Result<(), Failure> {
    let base = target(&cli).map_err(Failure::usage)?;
    let api = Api {
        base,
        timeout: Duration::from_secs(cli.timeout),
    };
    let output = cli.output;
    match cli.command {
        Verb::Create {
            what: CreateWhat::Lb(c),
        } => create(&api, &c).await,
        Verb::Create {
            what: CreateWhat::Cert(c),
        } => cert::create(&api, &c).await,
        Verb::Get {
            what: GetWhat::Cert { cert_id },
        } => cert::get(&api, cert_id.as_deref(), output).await,
        Verb::Get {
            what: GetWhat::Metrics,
        } => cert::metrics(&api, output).await,
        Verb::Delete {
            what: DeleteWhat::Cert { cert_id },
        } => cert::delete(&api, &cert_id).await,
        Verb::Get {
            what: GetWhat::Lb { serv_name },
        } => {
            let mut answer = api.get_json("/netlox/v1/config/loadbalancer/all").await?;
            // An empty `--servName=` filters nothing, as LoxiLB's loxicmd (which compares only
            // a non-empty name).
            if let Some(name) = serv_name.filter(|n| !n.is_empty())
                && let Some(rules) = answer.get_mut("lbAttr").and_then(|v| v.as_array_mut())
            {
                rules.retain(|r| r["serviceArguments"]["name"].as_str() == Some(name.as_str()));
            }
            let mut text = table::render(&answer, output);
            if output == OutputFormat::Json {
                text.push('\n');
            }
            out(&text)
        }
        Verb::Get {
            what: GetWhat::Endpoint,
        } => {
            let answer = api.get_json("/netlox/v1/config/endpoint/all").await?;
            print_or_json(&answer, output, table::render_endpoints)
        }
        Verb::Get {
            what: GetWhat::Conntrack,
        } => {
            let answer = api.get_json("/netlox/v1/config/conntrack/all").await?;
            print_or_json(&answer, output, table::render_conntrack)
        }
        Verb::Get {
            what: GetWhat::Kvinventory { service_id, ep_idx },
        } => {
            let ep = ep_idx.map(|i| format!("ep_idx={i}&")).unwrap_or_default();
            let answer = api
                .get_json(&format!(
                    "/netlox/v1/config/ai/kv/inventory?{ep}service_id={service_id}"
                ))
                .await?;
            if ep_idx.is_some() {
                print_or_json(&answer, output, table::render_kvinventory)
            } else {
                print_or_json(&answer, output, table::render_kvinventory_endpoints)
            }
        }
        Verb::Get {
            what: GetWhat::Kvparity { service_id },
        } => {
            let answer = api
                .get_json(&format!(
                    "/netlox/v1/config/ai/kv/parity?service_id={service_id}"
                ))
                .await?;
            print_or_json(&answer, output, table::render_kvparity)
        }
        Verb::Delete {
            what: DeleteWhat::Lb(d),
        } => delete(&api, &d).await,
        Verb::Save(a) => dump::save(&api, &a).await,
        Verb::Apply(a) => dump::apply(&api, &a).await,
    }
}

/// Writes `text` to stdout (every stdout write of loxicmd goes through here). A reader that went
/// away (`EPIPE`: `loxicmd get lb | head -1`) is a quiet [`EXIT_BROKEN_PIPE`]; another write
/// error is an [`EXIT_IO`] failure. (`print!` panics on both.)
pub(crate) fn out(text: &str) -> Result<(), Failure> {
    write_out(&mut std::io::stdout().lock(), text)
}

/// [`out`] on any writer.
fn write_out(w: &mut impl std::io::Write, text: &str) -> Result<(), Failure> {
    match w.write_all(text.as_bytes()).and_then(|()| w.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Failure {
            message: String::new(),
            code: EXIT_BROKEN_PIPE,
        }),
        Err(e) => Err(Failure {
            message: format!("cannot write to stdout: {e}"),
            code: EXIT_IO,
        }),
    }
}

pub(crate) fn print_pretty(v: &serde_json::Value) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    out(&format!("{text}\n"))
}

fn print_or_json(
    v: &serde_json::Value,
    output: OutputFormat,
    table: impl Fn(&serde_json::Value) -> String,
) -> Result<(), Failure> {
    if output == OutputFormat::Json {
        print_pretty(v)
    } else {
        out(&table(v))
    }
}

/// The API target of the global flags: `--apiserver`, `--port`, `--protocol`, `--cacert`,
/// `--token` / `--token-file`.
fn target(cli: &Cli) -> Result<client::Target, String> {
    check_apiserver(&cli.apiserver)?;
    let mut t = client::Target::http(&cli.apiserver, cli.port);
    if cli.protocol == args::Protocol::Https {
        t.tls = Some(client::tls_config(cli.cacert.as_deref()).map_err(|e| e.to_string())?);
    } else if cli.cacert.is_some() {
        return Err("--cacert needs --protocol https".into());
    }
    t.token = match (&cli.token, &cli.token_file) {
        (_, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| format!("--token-file {}: {e}", file.display()))?;
            let token = text.lines().map(str::trim).find(|l| !l.is_empty());
            Some(
                token
                    .ok_or_else(|| format!("--token-file {} holds no token", file.display()))?
                    .to_string(),
            )
        }
        (Some(t), None) => Some(t.trim().to_string()),
        (None, None) => None,
    };
    Ok(t)
}

/// Refuses an `--apiserver` that is not a bare host: a URL (`http://host:port`) or a
/// `host:port` / `[v6]:port`. LoxiLB's loxicmd takes the address alone too (it builds
/// `<protocol>://<apiserver>:<port>`); the port goes in `--port`, the scheme in `--protocol`.
/// An unbracketed IPv6 literal (`::1`) is a host.
pub fn check_apiserver(s: &str) -> Result<(), String> {
    if let Some((scheme, rest)) = s.split_once("://") {
        let authority = rest.split('/').next().unwrap_or_default();
        let flags = match split_port(authority) {
            Some((host, port)) => format!("--apiserver {host} --port {port}"),
            None => format!("--apiserver {}", authority.trim_matches(['[', ']'])),
        };
        return Err(format!(
            "--apiserver {s:?} is a URL; give the address alone, the port with --port and the \
             scheme with --protocol ({flags} --protocol {scheme})"
        ));
    }
    match split_port(s) {
        Some((host, port)) => Err(format!(
            "--apiserver {s:?} carries a port; give the address alone and the port with --port \
             (--apiserver {host} --port {port})"
        )),
        None => Ok(()),
    }
}

/// `host:port` or `[v6]:port` split in two (brackets dropped); `None` without a port. A bare
/// IPv6 literal (`::1`, `fe80::1%eth0`: more than one colon) has no port.
fn split_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return Some((host, after.strip_prefix(':')?));
    }
    if s.matches(':').count() == 1 {
        return s.split_once(':');
    }
    None
}

/// The API and the per-call time limit.
pub(crate) struct Api {
    base: client::Target,
    timeout: Duration,
}

/// The message LoxiLB's loxicmd shows for an error body: the first non-empty string among
/// `error`, `message`, `msg`, `result`, `Error`, `Message`, else the trimmed body.
pub fn error_message(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    ["error", "message", "msg", "result", "Error", "Message"]
        .iter()
        .find_map(|k| v[*k].as_str().filter(|s| !s.is_empty()))
        .map_or_else(|| body.trim().to_string(), str::to_string)
}

impl Api {
    /// One call; a non-2xx answer is a [`Failure`] with LoxiLB's message and exit code.
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<String>,
    ) -> Result<String, Failure> {
        let call = client::call(&self.base, method, path, body);
        let (status, text) = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| Failure {
                message: format!(
                    "no answer from the loxilb API at {} within {:?}",
                    self.base.base_url(),
                    self.timeout
                ),
                code: EXIT_TRANSPORT,
            })?
            .map_err(|e| {
                let mut message = e.to_string();
                // What hyper says when a plain-HTTP request meets a TLS server's answer.
                if self.base.tls.is_none() && message.contains("invalid HTTP version") {
                    message.push_str(&format!(
                        " (the loxilb API at {} may be serving HTTPS: add --protocol https)",
                        self.base.base_url()
                    ));
                }
                // What rustls says when a TLS handshake meets a plain-HTTP answer (its first
                // byte, `H`, is no TLS record type).
                if self.base.tls.is_some() && message.contains("InvalidContentType") {
                    message.push_str(&format!(
                        " (the loxilb API at {} seems to speak plain HTTP: drop --protocol https)",
                        self.base.authority()
                    ));
                }
                Failure {
                    message,
                    code: EXIT_TRANSPORT,
                }
            })?;
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            let mut message = format!("server returned {status}: {}", error_message(&text));
            // The HTTPS API's answer to a plain-HTTP request (`api::tls::plain_http_answer`).
            if self.base.tls.is_none() && text.starts_with(crate::api::tls::PLAIN_HTTP_ANSWER_START)
            {
                message.push_str(" (add --protocol https)");
            }
            Err(Failure {
                message,
                code: exit_code_of_status(status),
            })
        }
    }

    pub(crate) async fn get_json(&self, path: &str) -> Result<serde_json::Value, Failure> {
        let text = self.call(Method::GET, path, None).await?;
        serde_json::from_str(&text).map_err(|e| Failure {
            message: format!("unexpected answer ({e}): {text}"),
            code: 7,
        })
    }
}

/// Prints the `result` of a create/delete answer (`Success`), as LoxiLB's loxicmd.
fn print_result(text: &str) -> Result<(), Failure> {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or(serde_json::Value::Null);
    match v["result"].as_str() {
        Some(r) => out(&format!("{r}\n")),
        None => out(&format!("{}\n", text.trim())),
    }
}

/// Posts one rule per service port (`--tcp=80 --udp=53` is two rules, as LoxiLB's loxicmd
/// posts them). The API has no transaction over several rules: when one is refused after
/// others were stored, the error names the refused port and the ones this command stored,
/// which stay (a rule posted again unchanged is left as it was, so none is rolled back).
async fn create(api: &Api, c: &args::CreateLb) -> Result<(), Failure> {
    let bodies = build::create_bodies(c).map_err(Failure::usage)?;
    let mut stored: Vec<String> = Vec::new();
    for body in bodies {
        let svc = &body["serviceArguments"];
        let port = format!(
            "{} {}",
            svc["protocol"].as_str().unwrap_or("?"),
            svc["port"]
        );
        let posted = api
            .call(
                Method::POST,
                "/netlox/v1/config/loadbalancer",
                Some(body.to_string()),
            )
            .await;
        match posted {
            Ok(text) => {
                print_result(&text)?;
                stored.push(port);
            }
            Err(mut f) if !stored.is_empty() => {
                f.message = format!(
                    "{} (the rule for {port}); this command already stored {} and kept it",
                    f.message,
                    stored.join(", ")
                );
                return Err(f);
            }
            Err(f) => return Err(f),
        }
    }
    Ok(())
}

async fn delete(api: &Api, d: &args::DeleteLb) -> Result<(), Failure> {
    for path in build::delete_paths(d).map_err(Failure::usage)? {
        let text = api.call(Method::DELETE, &path, None).await?;
        print_result(&text)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose every write fails with `kind`.
    struct Failing(std::io::ErrorKind);

    impl std::io::Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn stdout_writes_stop_quietly_on_a_closed_reader_and_report_other_errors() {
        let mut buf = Vec::new();
        assert!(write_out(&mut buf, "Success\n").is_ok());
        assert_eq!(buf, b"Success\n");
        let f = write_out(&mut Failing(std::io::ErrorKind::BrokenPipe), "x")
            .expect_err("EPIPE is a failure");
        assert_eq!((f.message.as_str(), f.code), ("", EXIT_BROKEN_PIPE));
        let f = write_out(&mut Failing(std::io::ErrorKind::StorageFull), "x")
            .expect_err("ENOSPC is a failure");
        assert_eq!(f.code, EXIT_IO);
        assert!(
            f.message.starts_with("cannot write to stdout: "),
            "{}",
            f.message
        );
    }

    #[test]
    fn apiserver_with_a_port_or_a_scheme_is_refused_naming_the_flags_to_use() {
        for ok in [
            "127.0.0.1",
            "loxilb.example",
            "::1",
            "[::1]",
            "fe80::1%eth0",
        ] {
            assert_eq!(check_apiserver(ok), Ok(()), "{ok}");
        }
        assert_eq!(
            check_apiserver("127.0.0.1:11111"),
            Err(
                "--apiserver \"127.0.0.1:11111\" carries a port; give the address alone and \
                 the port with --port (--apiserver 127.0.0.1 --port 11111)"
                    .into()
            )
        );
        assert_eq!(
            check_apiserver("[::1]:8091"),
            Err(
                "--apiserver \"[::1]:8091\" carries a port; give the address alone and the \
                 port with --port (--apiserver ::1 --port 8091)"
                    .into()
            )
        );
        assert_eq!(
            check_apiserver("https://lb.example:8091/netlox"),
            Err(
                "--apiserver \"https://lb.example:8091/netlox\" is a URL; give the address \
                 alone, the port with --port and the scheme with --protocol (--apiserver \
                 lb.example --port 8091 --protocol https)"
                    .into()
            )
        );
        assert_eq!(
            check_apiserver("http://[::1]"),
            Err(
                "--apiserver \"http://[::1]\" is a URL; give the address alone, the port with \
                 --port and the scheme with --protocol (--apiserver ::1 --protocol http)"
                    .into()
            )
        );
    }
}
