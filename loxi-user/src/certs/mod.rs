//! TLS certificates of the fullproxy (`security: 1`): LoxiLB's cert API's certificates, checked
//! ([`parse`]), stored and persisted ([`store`]), and their expiry metric.
//!
//! A listener whose rules have `security: 1` serves, for the SNI name of a handshake that
//! equals one of its rules' `host`, the certificate whose hostnames cover that name; for no
//! SNI or any other name, the certificate with id [`store::DEFAULT_ID`]; with neither the
//! handshake is refused. The proxy's resolver reads [`store::CertStore::snapshot`] per
//! handshake.

pub mod parse;
pub mod stage;
pub mod store;
#[cfg(test)]
pub(crate) mod testutil;

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

pub use parse::{CertError, CertPem, Certificate};
pub use store::{CertSnapshot, CertStore, CertStoreError};

/// Metric name: each certificate's end of validity (Unix seconds).
pub const EXPIRY_METRIC: &str = "loxilb_tls_cert_expiry_timestamp_seconds";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Labels {
    cert_id: String,
}

/// `loxilb_tls_cert_expiry_timestamp_seconds{cert_id}`, read from the store at scrape time.
pub struct ExpiryCollector(Arc<CertStore>);

impl std::fmt::Debug for ExpiryCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpiryCollector")
    }
}

impl ExpiryCollector {
    /// Registers the gauge family of `store` in `registry`.
    pub fn register(registry: &mut Registry, store: Arc<CertStore>) {
        registry.register_collector(Box::new(Self(store)));
    }
}

impl Collector for ExpiryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snap = self.0.snapshot();
        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            EXPIRY_METRIC,
            "End of validity of each TLS certificate of the cert API (Unix seconds)",
            None,
            gauge.metric_type(),
        )?;
        for (id, cert) in &snap.certs {
            let labels = Labels {
                cert_id: id.clone(),
            };
            ConstGauge::new(cert.not_after).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
