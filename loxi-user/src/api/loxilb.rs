//! LoxiLB's informational routes that its clients and probes call: `/version`,
//! `/config/endpoint/all`, `/config/conntrack/all`, `/config/metrics`.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use serde_json::json;

use super::ApiState;
use super::error::{ApiError, json_response};

/// `GET /version` (LoxiLB's readiness probe; answered without a token, as LoxiLB's
/// `security: []`): `{"version", "buildInfo", "product"}` (`VersionGetEntry`). `product` is
/// LoxiLB's API-flavour marker: `loxilb-inference-gateway`, the API loxi implements.
pub async fn version() -> Response {
    let v = env!("CARGO_PKG_VERSION");
    json_response(
        StatusCode::OK,
        &json!({
            "version": format!("loxi {v}"),
            "buildInfo": format!("loxi {v} (rust)"),
            "product": "loxilb-inference-gateway",
        }),
    )
}

/// `GET /config/metrics`: `{"prometheus": true}` (`MetricsConfig`; loxi always exports its
/// metrics at `/netlox/v1/metrics`).
pub async fn metrics_config() -> Response {
    json_response(StatusCode::OK, &json!({ "prometheus": true }))
}

/// One entry of `GET /config/endpoint/all` (LoxiLB's `EndPointGetEntry`, the keys loxicmd's
/// `get ep` reads).
#[derive(Debug, Serialize)]
pub struct EndpointEntry {
    /// The endpoint's IP.
    #[serde(rename = "hostName")]
    pub host_name: String,
    /// `<ip>_<probe type>_<probe port>` (LoxiLB names host probes the same way).
    pub name: String,
    /// Probe failures before the endpoint is down (the rule's `probeRetries`; 0 = default).
    #[serde(rename = "inactiveReTries")]
    pub inactive_retries: u32,
    /// `none` (no active probe; passive health only), `tcp`, `http`, ...
    #[serde(rename = "probeType")]
    pub probe_type: String,
    /// Probe request (HTTP path).
    #[serde(rename = "probeReq")]
    pub probe_req: String,
    /// Expected probe response.
    #[serde(rename = "probeResp")]
    pub probe_resp: String,
    /// Probe timeout in seconds (the rule's `probeTimeout`; 0 = default).
    #[serde(rename = "probeDuration")]
    pub probe_duration: u32,
    /// Probed port.
    #[serde(rename = "probePort")]
    pub probe_port: u16,
    /// `ok` when every rule using this endpoint sees it healthy, `nok` otherwise.
    #[serde(rename = "currState")]
    pub curr_state: String,
}

/// `GET /config/endpoint/all`: `{"Attr":[...]}`, one entry per endpoint host and probe
/// (endpoints shared by several rules are listed once), from the live health board. LoxiLB
/// also reports probe delays (`minDelay`/`avgDelay`/`maxDelay`); loxi does not measure them and
/// leaves the keys out.
pub async fn endpoints(State(st): State<ApiState>) -> Response {
    let snap = st.store.snapshot();
    let mut by_name: BTreeMap<String, EndpointEntry> = BTreeMap::new();
    for r in snap.rules.values() {
        let s = &r.rule.service;
        for (i, ep) in r.rule.endpoints.iter().enumerate() {
            let probe_type = if s.probetype.is_empty() {
                "none".to_string()
            } else {
                s.probetype.clone()
            };
            let port = if s.probeport != 0 {
                s.probeport
            } else {
                ep.target_port
            };
            let name = format!("{}_{probe_type}_{port}", ep.endpoint_ip);
            let up = st.health.healthy(r, i).unwrap_or(true);
            let e = by_name
                .entry(name.clone())
                .or_insert_with(|| EndpointEntry {
                    host_name: ep.endpoint_ip.clone(),
                    name,
                    inactive_retries: s.probe_retries,
                    probe_type,
                    probe_req: s.probereq.clone(),
                    probe_resp: s.proberesp.clone(),
                    probe_duration: s.probe_timeout,
                    probe_port: port,
                    curr_state: "ok".into(),
                });
            if !up {
                e.curr_state = "nok".into();
            }
        }
    }
    let attr: Vec<EndpointEntry> = by_name.into_values().collect();
    json_response(StatusCode::OK, &json!({ "Attr": attr }))
}

/// `GET /config/conntrack/all`: `{"ctAttr":[]}` on a daemon without the L4 data path (there is
/// no conntrack table: the fullproxy terminates connections). With `--xdp-iface` the table
/// lives in the XDP conntrack map, which the API cannot read yet: 501, saying so.
pub async fn conntrack(State(st): State<ApiState>) -> Result<Response, ApiError> {
    if st.l4_datapath {
        return Err(ApiError::with_status(
            StatusCode::NOT_IMPLEMENTED,
            "listing the XDP conntrack map over the API is not implemented in loxi yet; the \
             per-endpoint packet and byte counters are the loxilb_l4_endpoint_* metrics",
        ));
    }
    Ok(json_response(StatusCode::OK, &json!({ "ctAttr": [] })))
}
