//! Active probes from a rule's `monitor` / `probetype` fields.
//!
//! Probes run when `monitor` is true or `probetype` names a probe: `tcp` (connect), `http`
//! (`GET <probereq>`, 2xx and, when `proberesp` is set, a body containing it). `probereq` is
//! the request path, as LoxiLB's prober reads it (`http://<ep>:<port>/<probereq>`): empty is
//! `/`, and a path without its leading `/` (`health`) gets one ([`probe_path`]); the API
//! refuses anything else (`rules::validate`).
//! `https`, `udp` and `ping` are accepted by the API but need TLS or raw sockets; loxi probes
//! them with a TCP connect and logs that once. `none` disables probing. `probeport` (0 = the
//! endpoint's port), `probeTimeout` (seconds, 0 → 2) and `probeRetries` (consecutive failures
//! before down, 0 → 2) apply. One success marks an endpoint up again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio_util::sync::CancellationToken;

use super::HealthCell;
use crate::routing::EndpointLoad;
use crate::rules::ServiceArgs;

/// Time between probe rounds.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// What to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeKind {
    /// TCP connect.
    Tcp,
    /// HTTP GET `path`, 2xx, body contains `expect` when non-empty.
    Http {
        /// Request path.
        path: String,
        /// Required body substring ("" = any).
        expect: String,
    },
}

/// A rule's probe settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Probe kind.
    pub kind: ProbeKind,
    /// Port override (0 = endpoint port).
    pub port: u16,
    /// Per-probe timeout.
    pub timeout: Duration,
    /// Consecutive failures before an endpoint is down.
    pub retries: u32,
}

impl ProbeSpec {
    /// The probe a rule asks for, or `None`.
    pub fn from_args(a: &ServiceArgs) -> Option<Self> {
        let t = a.active_probe()?;
        let kind = match t.as_str() {
            "http" => ProbeKind::Http {
                path: probe_path(&a.probereq),
                expect: a.proberesp.clone(),
            },
            "" | "tcp" => ProbeKind::Tcp,
            other => {
                tracing::warn!(
                    probetype = other,
                    "probe type needs TLS or raw sockets; probing with a TCP connect"
                );
                ProbeKind::Tcp
            }
        };
        Some(Self {
            kind,
            port: a.probeport,
            timeout: Duration::from_secs(u64::from(if a.probe_timeout == 0 {
                2
            } else {
                a.probe_timeout
            })),
            retries: if a.probe_retries == 0 {
                2
            } else {
                a.probe_retries
            },
        })
    }

    /// `authority` with the probe port applied.
    fn target(&self, authority: &str) -> String {
        if self.port == 0 {
            return authority.to_string();
        }
        let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
        format!("{host}:{}", self.port)
    }
}

/// The request path of an http probe from `probereq`: `/` when empty, else `probereq` with a
/// leading `/` added when it has none (LoxiLB sends `http://<ep>:<port>/<probereq>`).
pub fn probe_path(probereq: &str) -> String {
    if probereq.starts_with('/') {
        probereq.to_string()
    } else {
        format!("/{probereq}")
    }
}

/// One probe of `authority`: `Ok` when it passed, else why it failed (the connect error, the
/// status code, the missing `proberesp`, the timeout), for the log line of a state change.
pub async fn probe_once(spec: &ProbeSpec, authority: &str) -> Result<(), String> {
    let target = spec.target(authority);
    let fut = async {
        match &spec.kind {
            ProbeKind::Tcp => tokio::net::TcpStream::connect(&target)
                .await
                .map(drop)
                .map_err(|e| format!("TCP connect to {target}: {e}")),
            ProbeKind::Http { path, expect } => http_probe(&target, path, expect).await,
        }
    };
    tokio::time::timeout(spec.timeout, fut)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "no answer from {target} within the probe timeout ({} s)",
                spec.timeout.as_secs()
            ))
        })
}

async fn http_probe(target: &str, path: &str, expect: &str) -> Result<(), String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri = format!("http://{target}{path}")
        .parse::<http::Uri>()
        .map_err(|e| format!("http://{target}{path} is not a URI: {e}"))?;
    let resp = client.get(uri).await.map_err(|e| {
        // hyper-util's error says only "client error (Connect)"; the reason is in its sources.
        let mut why = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            why.push_str(&format!(": {c}"));
            cause = c.source();
        }
        format!("GET http://{target}{path}: {why}")
    })?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!(
            "GET http://{target}{path} answered {status}, not 2xx"
        ));
    }
    if expect.is_empty() {
        return Ok(());
    }
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("GET http://{target}{path}: reading the body: {e}"))?
        .to_bytes();
    if String::from_utf8_lossy(&body).contains(expect) {
        Ok(())
    } else {
        Err(format!(
            "GET http://{target}{path} answered {status} without {expect:?} (proberesp) in the body"
        ))
    }
}

/// One probed endpoint.
pub struct Target {
    /// `ip:port`.
    pub authority: String,
    /// Its health inputs.
    pub cell: Arc<HealthCell>,
    /// Its load record (health is published here).
    pub load: Arc<EndpointLoad>,
}

/// Probes every target each [`PROBE_INTERVAL`] until `cancel`.
pub async fn run(spec: ProbeSpec, targets: Vec<Target>, cancel: CancellationToken) {
    loop {
        let round =
            futures::future::join_all(targets.iter().map(|t| probe_once(&spec, &t.authority)));
        let results = tokio::select! {
            _ = cancel.cancelled() => return,
            r = round => r,
        };
        for (t, result) in targets.iter().zip(results) {
            apply(&spec, t, &result);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(PROBE_INTERVAL) => {}
        }
    }
}

/// Records one probe result: `retries` consecutive failures → down (logged with the last
/// failure's reason); a success → up.
pub fn apply(spec: &ProbeSpec, t: &Target, result: &Result<(), String>) {
    let was_down = t.cell.probe_down.load(Ordering::Relaxed);
    if result.is_ok() {
        t.cell.probe_failures.store(0, Ordering::Relaxed);
        t.cell.probe_down.store(false, Ordering::Relaxed);
    } else if t.cell.probe_failures.fetch_add(1, Ordering::Relaxed) + 1 >= spec.retries {
        t.cell.probe_down.store(true, Ordering::Relaxed);
    }
    let down = t.cell.probe_down.load(Ordering::Relaxed);
    match result {
        Err(why) if down && !was_down => tracing::warn!(
            endpoint = %t.authority,
            failures = spec.retries,
            reason = %why,
            "probe marked endpoint down"
        ),
        Err(why) => tracing::debug!(endpoint = %t.authority, reason = %why, "probe failed"),
        Ok(()) if was_down => tracing::info!(endpoint = %t.authority, "probe marked endpoint up"),
        Ok(()) => {}
    }
    t.cell.publish(&t.load);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: serde_json::Value) -> ServiceArgs {
        let mut v = serde_json::json!({"externalIP": "10.0.0.1", "port": 80, "mode": 4});
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        serde_json::from_value(v).expect("args")
    }

    #[test]
    fn spec_from_rule_fields() {
        assert_eq!(ProbeSpec::from_args(&args(serde_json::json!({}))), None);
        assert_eq!(
            ProbeSpec::from_args(&args(
                serde_json::json!({"monitor": true, "probetype": "none"})
            )),
            None
        );
        let s = ProbeSpec::from_args(&args(serde_json::json!({"monitor": true}))).expect("tcp");
        assert_eq!(
            (s.kind, s.retries, s.timeout),
            (ProbeKind::Tcp, 2, Duration::from_secs(2))
        );
        let s = ProbeSpec::from_args(&args(serde_json::json!({
            "probetype": "http", "probereq": "/health", "proberesp": "OK", "probeport": 9, "probeRetries": 4
        })))
        .expect("http");
        assert_eq!(
            s.kind,
            ProbeKind::Http {
                path: "/health".into(),
                expect: "OK".into()
            }
        );
        assert_eq!((s.port, s.retries), (9, 4));
        assert_eq!(s.target("127.0.0.1:8000"), "127.0.0.1:9");
    }

    #[tokio::test]
    async fn tcp_probe_sees_listening_and_dead_ports() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let live = l.local_addr().expect("addr").to_string();
        let dead = {
            let d = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            d.local_addr().expect("addr").to_string()
        };
        let spec = ProbeSpec {
            kind: ProbeKind::Tcp,
            port: 0,
            timeout: Duration::from_secs(1),
            retries: 2,
        };
        assert_eq!(probe_once(&spec, &live).await, Ok(()));
        let why = probe_once(&spec, &dead).await.expect_err("dead port");
        assert!(
            why.starts_with(&format!("TCP connect to {dead}: ")) && why.contains("refused"),
            "{why}"
        );
    }

    #[test]
    fn retries_failures_mark_down_and_one_success_up() {
        let spec = ProbeSpec {
            kind: ProbeKind::Tcp,
            port: 0,
            timeout: Duration::from_secs(1),
            retries: 2,
        };
        let t = Target {
            authority: "x:1".into(),
            cell: HealthCell::new(),
            load: EndpointLoad::new(),
        };
        let failed = Err("refused".to_string());
        apply(&spec, &t, &failed);
        assert!(t.load.is_healthy(), "one failure is not enough");
        apply(&spec, &t, &failed);
        assert!(!t.load.is_healthy());
        apply(&spec, &t, &Ok(()));
        assert!(t.load.is_healthy());
    }

    /// A one-connection-at-a-time HTTP/1.1 server on loopback: 200 `OK` for `GET /health`,
    /// 404 for any other request line.
    async fn health_server() -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let mut buf = vec![0u8; 4096];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let answer = if head.starts_with("GET /health HTTP/1.1\r\n") {
                    "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nOK"
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                };
                let _ = c.write_all(answer.as_bytes()).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn http_probe_sends_get_probereq_and_says_why_it_failed() {
        let addr = health_server().await;
        let http = |probereq: &str, proberesp: &str| {
            ProbeSpec::from_args(&args(serde_json::json!({
                "probetype": "http", "probereq": probereq, "proberesp": proberesp
            })))
            .expect("http probe")
        };
        // `/health` as given, and LoxiLB's spelling without the leading slash.
        assert_eq!(probe_once(&http("/health", "OK"), &addr).await, Ok(()));
        assert_eq!(probe_once(&http("health", ""), &addr).await, Ok(()));
        assert_eq!(
            probe_once(&http("/nope", ""), &addr).await,
            Err(format!(
                "GET http://{addr}/nope answered 404 Not Found, not 2xx"
            ))
        );
        assert_eq!(
            probe_once(&http("/health", "READY"), &addr).await,
            Err(format!(
                "GET http://{addr}/health answered 200 OK without \"READY\" (proberesp) in the body"
            ))
        );
        let dead = {
            let d = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            d.local_addr().expect("addr").to_string()
        };
        let why = probe_once(&http("/health", ""), &dead)
            .await
            .expect_err("dead port");
        assert!(
            why.starts_with(&format!("GET http://{dead}/health: ")) && why.contains("refused"),
            "{why}"
        );
    }
}
