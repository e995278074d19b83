//! `loxilb_proxy_endpoint_healthy{service,ep_idx}`: 1 while an endpoint is in selection, 0 while
//! the passive circuit breaker or a failing active probe holds it out. Read from the
//! [`HealthBoard`] at scrape time, so it is always the flag selection uses (a loxi extension;
//! LoxiLB reports the state only in `GET .../all`).

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::board::HealthBoard;

/// Metric name (without suffix).
pub const ENDPOINT_HEALTHY: &str = "loxilb_proxy_endpoint_healthy";

/// `service`, `ep_idx`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Labels {
    service: String,
    ep_idx: String,
}

/// The collector over a board.
pub struct HealthCollector(Arc<HealthBoard>);

impl std::fmt::Debug for HealthCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HealthCollector")
    }
}

impl HealthCollector {
    /// Registers the gauge family of `board` in `registry`.
    pub fn register(registry: &mut Registry, board: Arc<HealthBoard>) {
        registry.register_collector(Box::new(Self(board)));
    }
}

impl Collector for HealthCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = self.0.snapshot();
        let mut ids: Vec<&u32> = snapshot.keys().collect();
        ids.sort();
        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            ENDPOINT_HEALTHY,
            "1 while the endpoint is in selection, 0 while the circuit breaker or a probe holds it out",
            None,
            gauge.metric_type(),
        )?;
        for id in ids {
            for (ep, load) in snapshot[id].iter().enumerate() {
                let labels = Labels {
                    service: id.to_string(),
                    ep_idx: ep.to_string(),
                };
                ConstGauge::new(i64::from(load.is_healthy()))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::EndpointLoad;
    use std::sync::atomic::Ordering;

    #[test]
    fn gauge_follows_the_board_flags_at_scrape_time() {
        let board = HealthBoard::new();
        let mut reg = Registry::default();
        HealthCollector::register(&mut reg, board.clone());
        let loads = vec![EndpointLoad::new(), EndpointLoad::new()];
        board.publish(3, loads.clone());
        loads[1].healthy.store(false, Ordering::Relaxed);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("encode");
        assert!(
            out.contains("loxilb_proxy_endpoint_healthy{service=\"3\",ep_idx=\"0\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains("loxilb_proxy_endpoint_healthy{service=\"3\",ep_idx=\"1\"} 0\n"),
            "{out}"
        );
        board.withdraw(3);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("encode");
        assert!(!out.contains("loxilb_proxy_endpoint_healthy{"), "{out}");
    }
}
