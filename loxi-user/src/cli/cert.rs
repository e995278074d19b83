//! `loxicmd create|get|delete cert` and `loxicmd get metrics`: LoxiLB's loxicmd verbs over the
//! cert API (`/netlox/v1/config/cert`) and `/netlox/v1/config/metrics`
//! (`loxicmd-inference-gateway` `cmd/create/create_cert.go`, `cmd/get/get_cert.go`,
//! `cmd/delete/delete_cert.go`, `cmd/get/get_metrics.go`).
//!
//! `create cert --cert-file F --key-file K [--chain-file C] [--cert-id ID] [--usage server]`
//! uploads the PEM files (`201`: prints `Certificate '<id>' created.` with the id the server
//! answered, minted when `--cert-id` is absent); `get cert <ID>` prints LoxiLB's two-column
//! table (`Cert ID`, `Hostnames`, the SAN IP addresses listed after the DNS names as
//! `IP:<address>`; `-o json`: the answer); `get cert` without an id lists every
//! certificate (a loxi extension: LoxiLB's CLI requires the id, its API has no list);
//! `delete cert <ID>` prints `Certificate '<id>' deleted.`; `get metrics` prints
//! `prometheus metrics: enabled|disabled` (`-o json`: the answer). `--usage ca|client` (a CA
//! bundle or a client certificate for backend TLS) is refused: loxi verifies backends against
//! `backend_ca_file` and does not present client certificates (see the README's TLS section).

use std::path::{Path, PathBuf};

use http::Method;
use serde_json::{Value, json};

use super::args::{CreateCert, OutputFormat};
use super::{Api, EXIT_IO, Failure, out, print_pretty, table};

/// LoxiLB's `CERT_TITLE`.
const CERT_TITLE: [&str; 2] = ["Cert ID", "Hostnames"];

/// The upload body of `create cert`, or the usage error LoxiLB's loxicmd gives (exit 2) for
/// flags that cannot make one. `read` reads a PEM file (`EXIT_IO` when it cannot).
pub fn create_body(
    c: &CreateCert,
    read: impl Fn(&Path) -> Result<String, Failure>,
) -> Result<Value, Failure> {
    let Some(cert_file) = &c.cert_file else {
        return Err(Failure::usage("--cert-file is required"));
    };
    match c.usage.as_deref().unwrap_or("server") {
        "" | "server" => {}
        u @ ("ca" | "client") => {
            return Err(Failure::usage(format!(
                "--usage {u}: not implemented in loxi (backend TLS verifies against a rule's \
                 backend_ca_file and presents no client certificate); only server \
                 certificates are uploaded"
            )));
        }
        _ => return Err(Failure::usage("--usage must be one of server|ca|client")),
    }
    let Some(key_file) = &c.key_file else {
        return Err(Failure::usage("--cert-file and --key-file are required"));
    };
    let mut body = json!({
        "certPem": read(cert_file)?,
        "keyPem": read(key_file)?,
    });
    if let Some(chain) = &c.chain_file {
        body["chainPem"] = json!(read(chain)?);
    }
    if let Some(id) = &c.cert_id {
        body["certId"] = json!(id);
    }
    Ok(body)
}

/// Reads a PEM file named by `flag`; a failure is an [`EXIT_IO`] error naming the flag, and so
/// is a DER file (with the openssl command that writes it as PEM,
/// [`crate::certs::parse::der_file_reason`]) or one that is not text.
fn read_pem(flag: &'static str) -> impl Fn(&Path) -> Result<String, Failure> {
    use crate::certs::parse::{PemFile, der_file_reason};
    move |p: &Path| {
        let fail = |why: String| Failure {
            message: format!("{flag} {}: {why}", p.display()),
            code: EXIT_IO,
        };
        let bytes = std::fs::read(p).map_err(|e| Failure {
            message: format!("reading {flag} {}: {e}", p.display()),
            code: EXIT_IO,
        })?;
        let kind = if flag == "--key-file" {
            PemFile::PrivateKey
        } else {
            PemFile::Certificate
        };
        if let Some(reason) = der_file_reason(&bytes, kind) {
            return Err(fail(reason));
        }
        String::from_utf8(bytes).map_err(|e| {
            fail(format!(
                "not PEM text (byte {} is not UTF-8); give the PEM file (-----BEGIN ...)",
                e.utf8_error().valid_up_to()
            ))
        })
    }
}

/// `create cert`.
pub(crate) async fn create(api: &Api, c: &CreateCert) -> Result<(), Failure> {
    let files: [(&'static str, &Option<PathBuf>); 3] = [
        ("--cert-file", &c.cert_file),
        ("--key-file", &c.key_file),
        ("--chain-file", &c.chain_file),
    ];
    let read = |p: &Path| {
        let flag = files
            .iter()
            .find(|(_, f)| f.as_deref() == Some(p))
            .map_or("a file", |(flag, _)| *flag);
        read_pem(flag)(p)
    };
    let body = create_body(c, read)?;
    let text = api
        .call(
            Method::POST,
            "/netlox/v1/config/cert",
            Some(body.to_string()),
        )
        .await?;
    let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let id = answer["certId"]
        .as_str()
        .filter(|s| !s.is_empty())
        .or(c.cert_id.as_deref());
    if let Some(w) = answer["warning"].as_str() {
        eprintln!("Warning: {w}");
    }
    match id {
        Some(id) => out(&format!("Certificate '{id}' created.\n")),
        None => out("Certificate created.\n"),
    }
}

/// `get cert [ID]`: one certificate (LoxiLB's table), or every one without an id or with the id
/// `all` (the API's list path; no certificate can have that id).
pub(crate) async fn get(api: &Api, id: Option<&str>, output: OutputFormat) -> Result<(), Failure> {
    let (answer, rows) = match id.filter(|i| *i != "all") {
        Some(id) => {
            let path = format!("/netlox/v1/config/cert/{}", super::build::path_segment(id));
            let answer = api.get_json(&path).await?;
            let rows = vec![row(&answer)];
            (answer, rows)
        }
        None => {
            let answer = api.get_json("/netlox/v1/config/cert/all").await?;
            let rows = answer["certAttr"]
                .as_array()
                .into_iter()
                .flatten()
                .map(row)
                .collect();
            (answer, rows)
        }
    };
    if output == OutputFormat::Json {
        return print_pretty(&answer);
    }
    out(&table::layout(&CERT_TITLE, &rows))
}

/// One table row: the id and the hostnames joined by `,` (LoxiLB's `strings.Join`), then the
/// SAN IP addresses (`ipAddresses`, a loxi extension) as `IP:<address>`, openssl's notation,
/// which tells them from a DNS name spelled like an address. A certificate without IP
/// addresses gets LoxiLB's row.
fn row(c: &Value) -> Vec<String> {
    let strings = |key: &str| -> Vec<String> {
        c[key]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect()
    };
    let hosts: Vec<String> = strings("hostnames")
        .into_iter()
        .chain(strings("ipAddresses").iter().map(|ip| format!("IP:{ip}")))
        .collect();
    vec![
        c["certId"].as_str().unwrap_or_default().to_string(),
        hosts.join(","),
    ]
}

/// `delete cert ID`.
pub(crate) async fn delete(api: &Api, id: &str) -> Result<(), Failure> {
    let path = format!("/netlox/v1/config/cert/{}", super::build::path_segment(id));
    api.call(Method::DELETE, &path, None).await?;
    out(&format!("Certificate '{id}' deleted.\n"))
}

/// `get metrics`: whether the Prometheus endpoint is on (`GET /config/metrics`).
pub(crate) async fn metrics(api: &Api, output: OutputFormat) -> Result<(), Failure> {
    let answer = api.get_json("/netlox/v1/config/metrics").await?;
    if output == OutputFormat::Json {
        return print_pretty(&answer);
    }
    let on = answer["prometheus"].as_bool().unwrap_or(false);
    out(&format!(
        "prometheus metrics: {}\n",
        if on { "enabled" } else { "disabled" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cc(args: &[&str]) -> CreateCert {
        use clap::Parser;
        let cli = super::super::args::Cli::try_parse_from(
            ["loxicmd", "create", "cert"].iter().chain(args),
        )
        .expect("parse");
        match cli.command {
            super::super::args::Verb::Create {
                what: super::super::args::CreateWhat::Cert(c),
            } => c,
            other => panic!("not create cert: {other:?}"),
        }
    }

    /// A DER certificate or key given to `create cert` is refused naming the flag, the file,
    /// and the openssl command that writes it as PEM (it was read as text and failed as
    /// "stream did not contain valid UTF-8"); the PEM files are read as they are.
    #[test]
    fn a_der_file_is_refused_naming_the_flag_and_the_openssl_command() {
        let dir = tempfile::tempdir().expect("tmp");
        let pem = crate::certs::testutil::self_signed(&["a.example"], None);
        let (cert_der, key_der) = crate::certs::testutil::der_files(&pem);
        let (c, k) = (dir.path().join("c.der"), dir.path().join("k.der"));
        std::fs::write(&c, cert_der).expect("write");
        std::fs::write(&k, key_der).expect("write");
        for (flag, file, command) in [
            ("--cert-file", &c, "openssl x509 -inform DER"),
            ("--chain-file", &c, "openssl x509 -inform DER"),
            ("--key-file", &k, "openssl pkey -inform DER"),
        ] {
            let e = read_pem(flag)(file).expect_err("DER");
            assert_eq!(e.code, EXIT_IO);
            assert_eq!(
                e.message,
                format!(
                    "{flag} {}: the file looks DER-encoded (binary), not PEM: `{command} -in FILE \
                     -out FILE.pem` writes it as PEM; give that file instead",
                    file.display()
                )
            );
        }
        let p = dir.path().join("c.pem");
        std::fs::write(&p, &pem.cert_pem).expect("write");
        assert_eq!(read_pem("--cert-file")(&p).expect("PEM"), pem.cert_pem);
        std::fs::write(&p, [0xffu8, 0xfe, b'a']).expect("write");
        assert_eq!(
            read_pem("--cert-file")(&p).expect_err("binary").message,
            format!(
                "--cert-file {}: not PEM text (byte 0 is not UTF-8); give the PEM file \
                 (-----BEGIN ...)",
                p.display()
            )
        );
    }

    fn fake(p: &Path) -> Result<String, Failure> {
        Ok(format!("PEM of {}", p.display()))
    }

    #[test]
    fn the_upload_carries_the_files_and_the_id_as_loxilb_s_cert_api_takes_them() {
        let b = create_body(
            &cc(&[
                "--cert-file=a.crt",
                "--key-file=a.key",
                "--chain-file=c.pem",
                "--cert-id=web",
            ]),
            fake,
        )
        .expect("body");
        assert_eq!(
            b,
            json!({"certPem": "PEM of a.crt", "keyPem": "PEM of a.key",
                   "chainPem": "PEM of c.pem", "certId": "web"})
        );
        let b = create_body(
            &cc(&["--cert-file=a.crt", "--key-file=a.key", "--usage=server"]),
            fake,
        )
        .expect("body");
        assert_eq!(
            b,
            json!({"certPem": "PEM of a.crt", "keyPem": "PEM of a.key"})
        );
    }

    #[test]
    fn missing_files_and_backend_usages_are_usage_errors() {
        for (args, msg) in [
            (&["--key-file=a.key"][..], "--cert-file is required"),
            (
                &["--cert-file=a.crt"][..],
                "--cert-file and --key-file are required",
            ),
            (
                &["--cert-file=a.crt", "--usage=ca"][..],
                "--usage ca: not implemented in loxi",
            ),
            (
                &["--cert-file=a.crt", "--key-file=k", "--usage=client"][..],
                "--usage client: not implemented in loxi",
            ),
            (
                &["--cert-file=a.crt", "--usage=peer"][..],
                "--usage must be one of server|ca|client",
            ),
        ] {
            let e = create_body(&cc(args), fake).expect_err("refused");
            assert_eq!(e.code, super::super::EXIT_USAGE, "{args:?}");
            assert!(e.message.starts_with(msg), "{args:?}: {}", e.message);
        }
    }

    #[test]
    fn the_cert_table_is_loxilb_s() {
        let rows = vec![row(
            &json!({"certId": "web", "hostnames": ["a.example", "b.example"]}),
        )];
        assert_eq!(
            table::layout(&CERT_TITLE, &rows),
            "| CERT ID |      HOSTNAMES      |\n|---------|---------------------|\n| web     | a.example,b.example |\n"
        );
    }

    /// A certificate's SAN IP addresses (the answer's `ipAddresses`) are listed after its DNS
    /// names as `IP:<address>` (they were dropped); one without keeps LoxiLB's row.
    #[test]
    fn the_cert_table_lists_ip_addresses_after_the_dns_names() {
        let rows = vec![
            row(&json!({"certId": "vip", "hostnames": ["lb.example"],
                        "ipAddresses": ["10.0.0.5", "fd00::5"]})),
            row(&json!({"certId": "bare", "ipAddresses": ["10.0.0.6"]})),
            row(&json!({"certId": "web", "hostnames": ["10.0.0.7"]})),
        ];
        assert_eq!(
            rows,
            [
                ["vip", "lb.example,IP:10.0.0.5,IP:fd00::5"],
                ["bare", "IP:10.0.0.6"],
                ["web", "10.0.0.7"],
            ]
        );
    }
}
