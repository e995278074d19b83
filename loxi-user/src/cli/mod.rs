//! `loxicmd`: LoxiLB's CLI verbs over loxi's REST API.
//!
//! `loxicmd create lb <VIP> --tcp=<port>:<targetPort> --endpoints=<ip:weight,...> --mode=..
//! --select=.. [...]`, `loxicmd get lb|lbs|loadbalancer [-o json|wide]`, `loxicmd delete lb
//! <VIP> --tcp=<port> [--host ..] [--model-name ..]` or `delete lb --name NAME`, `loxicmd get
//! ep`, `get conntrack|ct`, `get kvinventory --service-id N [--ep-idx M]`, `get kvparity
//! --service-id N`; global `-s/--apiserver` (default 127.0.0.1), `-p/--port` (default 11111),
//! `--protocol http|https`, `--cacert FILE`, `--token TOKEN` (or env `LOXI_API_TOKEN`),
//! `--token-file FILE`, `-o/--output`, `-t/--timeout SECONDS` (default 10); `save --lb|--all
//! [-c DIR]` and `apply --lb FILE` (see [`dump`]).
//!
//! Output and exit codes are LoxiLB's loxicmd's: a create or delete prints the answer's
//! `result` (`Success`); a server error prints `Error: server returned <status>: <message>` on
//! stderr and exits 6 (400), 3 (401/403), 4 (404/409), 5 (429/503) or 7 (other); an
//! unreachable API exits 5, a usage error 2. (LoxiLB's `delete lb` prints its errors on stdout
//! and exits 0 whatever happened; loxi's exits with the same taxonomy as the other verbs.)
pub mod args;
pub mod build;
pub mod client;
pub mod dump;
pub mod table;

use std::time::Duration;

use http::Method;

use args::{Cli, CreateWhat, DeleteWhat, GetWhat, OutputFormat, Verb};

/// Exit code of a usage error (bad flag value).
pub const EXIT_USAGE: i32 = 2;
/// Exit code when the API cannot be reached (LoxiLB's "transport" class).
pub const EXIT_TRANSPORT: i32 = 5;

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
    /// The message (without the `Error: ` prefix).
    pub message: String,
    /// The process exit code.
    pub code: i32,
}

impl Failure {
    fn usage(message: impl std::fmt::Display) -> Self {
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
            eprintln!("Error: {}", f.message);
            f.code
        }
    }
}

async fn run_inner(cli: Cli) -> Result<(), Failure> {
    let base = target(&cli).map_err(Failure::usage)?;
    let api = Api {
        base,
        timeout: Duration::from_secs(cli.timeout.max(1)),
    };
    let output = cli.output;
    match cli.command {
        Verb::Create {
            what: CreateWhat::Lb(c),
        } => create(&api, &c).await,
        Verb::Get { what: GetWhat::Lb } => {
            let answer = api.get_json("/netlox/v1/config/loadbalancer/all").await?;
            print!("{}", table::render(&answer, output));
            if output == Some(OutputFormat::Json) {
                println!();
            }
            Ok(())
        }
        Verb::Get {
            what: GetWhat::Endpoint,
        } => {
            let answer = api.get_json("/netlox/v1/config/endpoint/all").await?;
            print_or_json(&answer, output, table::render_endpoints);
            Ok(())
        }
        Verb::Get {
            what: GetWhat::Conntrack,
        } => {
            let answer = api.get_json("/netlox/v1/config/conntrack/all").await?;
            print_or_json(&answer, output, table::render_conntrack);
            Ok(())
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
                print_or_json(&answer, output, table::render_kvinventory);
            } else {
                print_pretty(&answer);
            }
            Ok(())
        }
        Verb::Get {
            what: GetWhat::Kvparity { service_id },
        } => {
            let answer = api
                .get_json(&format!(
                    "/netlox/v1/config/ai/kv/parity?service_id={service_id}"
                ))
                .await?;
            print_pretty(&answer);
            Ok(())
        }
        Verb::Delete {
            what: DeleteWhat::Lb(d),
        } => delete(&api, &d).await,
        Verb::Save(a) => dump::save(&api, &a).await,
        Verb::Apply(a) => dump::apply(&api, &a).await,
    }
}

fn print_pretty(v: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

fn print_or_json(
    v: &serde_json::Value,
    output: Option<OutputFormat>,
    table: impl Fn(&serde_json::Value) -> String,
) {
    if output == Some(OutputFormat::Json) {
        print_pretty(v);
    } else {
        print!("{}", table(v));
    }
}

/// The API target of the global flags: `--apiserver`, `--port`, `--protocol`, `--cacert`,
/// `--token` / `--token-file`.
fn target(cli: &Cli) -> Result<client::Target, String> {
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

/// The API and the per-call time limit.
struct Api {
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
    async fn call(
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
            .map_err(|e| Failure {
                message: e.to_string(),
                code: EXIT_TRANSPORT,
            })?;
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            Err(Failure {
                message: format!("server returned {status}: {}", error_message(&text)),
                code: exit_code_of_status(status),
            })
        }
    }

    async fn get_json(&self, path: &str) -> Result<serde_json::Value, Failure> {
        let text = self.call(Method::GET, path, None).await?;
        serde_json::from_str(&text).map_err(|e| Failure {
            message: format!("unexpected answer ({e}): {text}"),
            code: 7,
        })
    }
}

/// Prints the `result` of a create/delete answer (`Success`), as LoxiLB's loxicmd.
fn print_result(text: &str) {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or(serde_json::Value::Null);
    match v["result"].as_str() {
        Some(r) => println!("{r}"),
        None => println!("{}", text.trim()),
    }
}

async fn create(api: &Api, c: &args::CreateLb) -> Result<(), Failure> {
    let bodies = build::create_bodies(c).map_err(Failure::usage)?;
    for body in bodies {
        let text = api
            .call(
                Method::POST,
                "/netlox/v1/config/loadbalancer",
                Some(body.to_string()),
            )
            .await?;
        print_result(&text);
    }
    Ok(())
}

async fn delete(api: &Api, d: &args::DeleteLb) -> Result<(), Failure> {
    for path in build::delete_paths(d).map_err(Failure::usage)? {
        let text = api.call(Method::DELETE, &path, None).await?;
        print_result(&text);
    }
    Ok(())
}
