//! Reading Prometheus text exposition (the workers' `/metrics`, the gateway's metrics).

use std::collections::BTreeMap;

/// Sums every sample of each metric name (labels dropped): `name → Σ value`.
/// Comment lines and unparsable lines are skipped.
pub fn sum_by_name(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series).trim();
        if let Ok(v) = value.trim().parse::<f64>() {
            *out.entry(name.to_string()).or_insert(0.0) += v;
        }
    }
    out
}

/// Samples of `name` whose label set contains `label="value"`, summed per value of `label`.
pub fn by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let key = format!("{label}=\"");
    for line in text.lines().filter(|l| l.starts_with(name)) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if series.split('{').next() != Some(name) {
            continue;
        }
        let Some(start) = series.find(&key).map(|i| i + key.len()) else {
            continue;
        };
        let Some(len) = series[start..].find('"') else {
            continue;
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            *out.entry(series[start..start + len].to_string())
                .or_insert(0.0) += v;
        }
    }
    out
}

/// `GET url` and return the body text; errors as strings naming the URL.
pub async fn fetch(client: &super::client::HttpClient, url: &str) -> Result<String, String> {
    use http_body_util::BodyExt;
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let req = hyper::Request::get(uri)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .map_err(|e| format!("{url}: {e}"))?;
    let resp = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| format!("{url}: timed out"))?
        .map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{url}: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("{url}: status {status}"));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP vllm:prefix_cache_hits Hits.\n# TYPE vllm:prefix_cache_hits counter\n\
vllm:prefix_cache_hits_total{model_name=\"tiny\",engine=\"0\"} 96\n\
vllm:prefix_cache_hits_total{model_name=\"tiny\",engine=\"1\"} 4\n\
vllm:prefix_cache_queries_total{model_name=\"tiny\",engine=\"0\"} 250\n\
loxilb_pd_kv_tier15_hits_total{ep_idx=\"0\"} 3\n\
loxilb_pd_kv_tier15_hits_total{ep_idx=\"2\"} 5\n\
loxilb_pd_kv_tier15_hits_totalx{ep_idx=\"2\"} 7\n\
bad line\n";

    #[test]
    fn sums_samples_across_labels() {
        let m = sum_by_name(TEXT);
        assert_eq!(m["vllm:prefix_cache_hits_total"], 100.0);
        assert_eq!(m["vllm:prefix_cache_queries_total"], 250.0);
        assert_eq!(m["loxilb_pd_kv_tier15_hits_total"], 8.0);
        assert!(!m.contains_key("bad"));
    }

    #[test]
    fn splits_samples_by_one_label() {
        let m = by_label(TEXT, "loxilb_pd_kv_tier15_hits_total", "ep_idx");
        assert_eq!(m.len(), 2);
        assert_eq!((m["0"], m["2"]), (3.0, 5.0));
    }
}
