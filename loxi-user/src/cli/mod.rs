//! `loxicmd`: LoxiLB's CLI verbs over loxi's REST API.
//!
//! `loxicmd create lb <VIP> --tcp=<port>:<targetPort> --endpoints=<ip:weight,...> --mode=..
//! --select=.. [...]`, `loxicmd get lb [-o json|wide]`, `loxicmd delete lb <VIP> --tcp=<port>
//! [--host ..] [--model-name ..]`; global `--apiserver` (default 127.0.0.1) and `--port`
//! (default 11111). A server error is printed verbatim to stderr and the exit code is 1.
pub mod args;
pub mod build;
pub mod client;
pub mod table;

use http::Method;

use args::{Cli, CreateWhat, DeleteWhat, GetWhat, Verb};

/// Runs one `loxicmd` invocation; returns the process exit code (0 ok, 1 error).
pub async fn run(cli: Cli) -> i32 {
    let base = base_url(&cli.apiserver, cli.port);
    let result = match cli.command {
        Verb::Create {
            what: CreateWhat::Lb(c),
        } => create(&base, &c).await,
        Verb::Get {
            what: GetWhat::Lb { output },
        } => get(&base, output).await,
        Verb::Delete {
            what: DeleteWhat::Lb(d),
        } => delete(&base, &d).await,
    };
    match result {
        Ok(()) => 0,
        Err(msg) => {
            eprintln!("{msg}");
            1
        }
    }
}

fn base_url(server: &str, port: u16) -> String {
    if server.contains(':') && !server.starts_with('[') {
        format!("http://[{server}]:{port}")
    } else {
        format!("http://{server}:{port}")
    }
}

/// A non-2xx answer is returned verbatim as the error.
async fn call(
    base: &str,
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

async fn create(base: &str, c: &args::CreateLb) -> Result<(), String> {
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

async fn get(base: &str, output: Option<args::OutputFormat>) -> Result<(), String> {
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

async fn delete(base: &str, d: &args::DeleteLb) -> Result<(), String> {
    for path in build::delete_paths(d).map_err(|e| e.to_string())? {
        call(base, Method::DELETE, &path, None).await?;
    }
    Ok(())
}
