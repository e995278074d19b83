//! Active probes from a rule's `monitor` / `probetype` fields.
//!
//! Probes run when `monitor` is true or `probetype` names a probe: `tcp` (connect), `http`
//! (`GET probereq` (default `/`), 2xx and, when `proberesp` is set, a body containing it).
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
                path: if a.probereq.is_empty() {
                    "/".into()
                } else {
                    a.probereq.clone()
                },
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

/// One probe of `authority`; true when it passed.
pub async fn probe_once(spec: &ProbeSpec, authority: &str) -> bool {
    let target = spec.target(authority);
    let fut = async {
        match &spec.kind {
            ProbeKind::Tcp => tokio::net::TcpStream::connect(&target).await.is_ok(),
            ProbeKind::Http { path, expect } => http_probe(&target, path, expect).await,
        }
    };
    tokio::time::timeout(spec.timeout, fut)
        .await
        .unwrap_or(false)
}

async fn http_probe(target: &str, path: &str, expect: &str) -> bool {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let Ok(uri) = format!("http://{target}{path}").parse::<http::Uri>() else {
        return false;
    };
    let Ok(resp) = client.get(uri).await else {
        return false;
    };
    if !resp.status().is_success() {
        return false;
    }
    if expect.is_empty() {
        return true;
    }
    match resp.into_body().collect().await {
        Ok(b) => String::from_utf8_lossy(&b.to_bytes()).contains(expect),
        Err(_) => false,
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
        for (t, ok) in targets.iter().zip(results) {
            apply(&spec, t, ok);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(PROBE_INTERVAL) => {}
        }
    }
}

/// Records one probe result: `retries` consecutive failures → down; a success → up.
pub fn apply(spec: &ProbeSpec, t: &Target, ok: bool) {
    let was_down = t.cell.probe_down.load(Ordering::Relaxed);
    if ok {
        t.cell.probe_failures.store(0, Ordering::Relaxed);
        t.cell.probe_down.store(false, Ordering::Relaxed);
    } else if t.cell.probe_failures.fetch_add(1, Ordering::Relaxed) + 1 >= spec.retries {
        t.cell.probe_down.store(true, Ordering::Relaxed);
    }
    let down = t.cell.probe_down.load(Ordering::Relaxed);
    if down != was_down {
        tracing::info!(endpoint = %t.authority, up = !down, "probe changed endpoint state");
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
        assert!(probe_once(&spec, &live).await);
        assert!(!probe_once(&spec, &dead).await);
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
        apply(&spec, &t, false);
        assert!(t.load.is_healthy(), "one failure is not enough");
        apply(&spec, &t, false);
        assert!(!t.load.is_healthy());
        apply(&spec, &t, true);
        assert!(t.load.is_healthy());
    }
}
