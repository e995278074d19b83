//! `loxicmd`: LoxiLB's CLI verbs over loxi's REST API.
//!
//! `loxicmd create lb <VIP> --tcp=<port>:<targetPort> --endpoints=<ip:weight,...> --mode=..
//! --select=.. [...]`, `loxicmd get lb [-o json|wide]`, `loxicmd delete lb <VIP> --tcp=<port>
//! [--host ..] [--model-name ..]`, `loxicmd get kvinventory --service-id N [--ep-idx M]`,
//! `loxicmd get kvparity --service-id N`; global `--apiserver` (default 127.0.0.1), `--port`
//! (default 11111), `--protocol http|https`, `--cacert FILE`, `--token TOKEN` (or env
//! `LOXI_API_TOKEN`) and `--token-file FILE`. A server error is printed verbatim to stderr and
//! the exit code is 1.
pub mod args;
pub mod build;
pub mod client;
pub mod table;

use http::Method;

use args::{Cli, CreateWhat, DeleteWhat, GetWhat, Verb};

/// Runs one `loxicmd` invocation; returns the process exit code (0 ok, 1 error).
pub async fn run(cli: Cli) -> i32 {
    let base = match target(&cli) {
        Ok(t) => t,
        Err(msg) => {
            eprintln!("{msg}");
            return 1;
        }
    };
    let base = &base;
    let result = match cli.command {
        Verb::Create {
            what: CreateWhat::Lb(c),
        } => create(base, &c).await,
        Verb::Get {
            what: GetWhat::Lb { output },
        } => get(base, output).await,
        Verb::Get {
            what: GetWhat::Kvinventory { service_id, ep_idx },
        } => {
            let ep = ep_idx.map(|i| format!("&ep_idx={i}")).unwrap_or_default();
            get_json(
                base,
                &format!("/netlox/v1/config/ai/kv/inventory?service_id={service_id}{ep}"),
            )
            .await
        }
        Verb::Get {
            what: GetWhat::Kvparity { service_id },
        } => {
            get_json(
                base,
                &format!("/netlox/v1/config/ai/kv/parity?service_id={service_id}"),
            )
            .await
        }
        Verb::Delete {
            what: DeleteWhat::Lb(d),
        } => delete(base, &d).await,
    };
    match result {
        Ok(()) => 0,
        Err(msg) => {
            eprintln!("{msg}");
            1
        }
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

/// A non-2xx answer is returned verbatim as the error.
async fn call(
    base: &client::Target,
    method: Method,
    path: &str,
    body: Option<String>,
) -> Result<String, String> {
    let (status, text) = client::call(base, method, path, body)
        .await
        .map_err(|e| e.to_string())?;
    if (200..300).contains(&status) {
        Ok(text)
    } else {
        Err(text)
    }
}

async fn create(base: &client::Target, c: &args::CreateLb) -> Result<(), String> {
    let bodies = build::create_bodies(c).map_err(|e| e.to_string())?;
    for body in bodies {
        call(
            base,
            Method::POST,
            "/netlox/v1/config/loadbalancer",
            Some(body.to_string()),
        )
        .await?;
    }
    Ok(())
}

async fn get(base: &client::Target, output: Option<args::OutputFormat>) -> Result<(), String> {
    let text = call(
        base,
        Method::GET,
        "/netlox/v1/config/loadbalancer/all",
        None,
    )
    .await?;
    let answer: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("unexpected answer ({e}): {text}"))?;
    print!("{}", table::render(&answer, output));
    if output == Some(args::OutputFormat::Json) {
        println!();
    }
    Ok(())
}

/// Prints a JSON answer pretty.
async fn get_json(base: &client::Target, path: &str) -> Result<(), String> {
    let text = call(base, Method::GET, path, None).await?;
    let answer: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("unexpected answer ({e}): {text}"))?;
    println!("{}", serde_json::to_string_pretty(&answer).unwrap_or(text));
    Ok(())
}

async fn delete(base: &client::Target, d: &args::DeleteLb) -> Result<(), String> {
    for path in build::delete_paths(d).map_err(|e| e.to_string())? {
        call(base, Method::DELETE, &path, None).await?;
    }
    Ok(())
}
