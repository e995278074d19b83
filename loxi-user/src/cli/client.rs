//! The tiny HTTP/1.1 client `loxicmd` uses (hyper-util's legacy client, plain HTTP).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Errors reaching the API (not HTTP error statuses, which are answers).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The request could not be built (bad host or path).
    #[error("bad request URL {url}: {source}")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: http::Error,
    },
    /// Connecting or sending failed.
    #[error("cannot reach the loxilb API at {url}: {source}")]
    Send {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// Reading the answer failed.
    #[error("reading the answer from {url}: {source}")]
    Read {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: hyper::Error,
    },
}

/// One request to `base` + `path`; returns `(status, body text)`.
pub async fn call(
    base: &str,
    method: http::Method,
    path: &str,
    body: Option<String>,
) -> Result<(u16, String), ClientError> {
    let url = format!("{base}{path}");
    let mut req = http::Request::builder().method(method).uri(&url);
    if body.is_some() {
        req = req.header(http::header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|source| ClientError::Url {
            url: url.clone(),
            source,
        })?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client
        .request(req)
        .await
        .map_err(|source| ClientError::Send {
            url: url.clone(),
            source,
        })?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|source| ClientError::Read { url, source })?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}
