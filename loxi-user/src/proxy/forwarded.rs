//! `X-Forwarded-For` / `X-Forwarded-Proto` on requests to the backends.
//!
//! As reverse proxies do (nginx's `$proxy_add_x_forwarded_for`): a client-supplied
//! `X-Forwarded-For` is kept, all its values joined in order, and the client's address is
//! appended, so the last entry is always the one loxi saw. `X-Forwarded-Proto` is set to the
//! scheme of the client's connection (`https` when the listener terminated TLS, else `http`),
//! replacing any value the client sent. Applied after hop-by-hop stripping, so a client cannot drop these headers by
//! naming them in `Connection`.
//!
//! `X-Loxi-Hop`: every forwarded request carries this process's random 64-bit id (16 hex
//! digits) appended to the ids already there (`a, b`: a chain of loxi gateways). A request that
//! arrives with this process's own id went round a loop (a rule forwarding to a listener of
//! this gateway, directly, through a wildcard or another rule) and is answered 508
//! `loop_detected` at once ([`is_loop`]) instead of being forwarded again until the gateway
//! runs out of connections and memory.

use std::net::{IpAddr, SocketAddr};

use http::header::Entry;
use http::{HeaderMap, HeaderName, HeaderValue};

/// `x-forwarded-for`.
pub const X_FORWARDED_FOR: &str = "x-forwarded-for";
/// `x-forwarded-proto`.
pub const X_FORWARDED_PROTO: &str = "x-forwarded-proto";

/// `x-loxi-hop`: the ids of the loxi processes a request passed through.
pub const X_LOXI_HOP: &str = "x-loxi-hop";

// As `HeaderName` statics built at compile time (a `&str` name is parsed at every use).
static XFF: HeaderName = HeaderName::from_static(X_FORWARDED_FOR);
static XFP: HeaderName = HeaderName::from_static(X_FORWARDED_PROTO);
static HOP: HeaderName = HeaderName::from_static(X_LOXI_HOP);

/// This process's hop id: 16 lowercase hex digits of a random u64, drawn once. Its text is
/// leaked once so the value is a static one: every request appends a clone, and a clone of a
/// heap-backed value is a reference count that every connection worker's core writes.
pub fn hop_id() -> &'static HeaderValue {
    static ID: std::sync::OnceLock<HeaderValue> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let id: u64 = rand::random();
        let text: &'static str = Box::leak(format!("{id:016x}").into_boxed_str());
        HeaderValue::from_static(text)
    })
}

/// True when `headers` show the request already passed through this process (its
/// [`hop_id`] in an `X-Loxi-Hop` value): a forwarding loop.
pub fn is_loop(headers: &HeaderMap) -> bool {
    let own = hop_id().as_bytes();
    headers.get_all(&HOP).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .any(|id| id.trim_ascii() == own)
    })
}

/// Appends `client`'s IP to `X-Forwarded-For` and sets `X-Forwarded-Proto` (`https` when
/// `https`, else `http`).
pub fn append(headers: &mut HeaderMap, client: Option<SocketAddr>, https: bool) {
    if let Some(client) = client {
        let ip = client.ip().to_canonical();
        // One lookup of the name for both cases (the usual one: no chain yet).
        match headers.entry(&XFF) {
            Entry::Occupied(mut e) => {
                let mut chain: Vec<String> = e
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                chain.push(ip.to_string());
                if let Ok(v) = HeaderValue::from_str(&chain.join(", ")) {
                    e.insert(v);
                }
            }
            Entry::Vacant(e) => {
                if let Ok(v) = ip_value(ip) {
                    e.insert(v);
                }
            }
        }
    }
    let proto = if https { "https" } else { "http" };
    headers.insert(&XFP, HeaderValue::from_static(proto));
    headers.append(&HOP, hop_id().clone());
}

/// `ip`'s text as a header value. The usual case, an IPv4 client, is written digit by digit
/// into a stack buffer (`to_string` went through the formatting machinery: ~1,400
/// instructions a request, valgrind); IPv6 takes `Display`.
fn ip_value(ip: IpAddr) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
    match ip {
        IpAddr::V4(v4) => {
            let mut buf = [0u8; 15];
            let mut n = 0;
            for (i, o) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if o >= 100 {
                    buf[n] = b'0' + o / 100;
                    n += 1;
                }
                if o >= 10 {
                    buf[n] = b'0' + o / 10 % 10;
                    n += 1;
                }
                buf[n] = b'0' + o % 10;
                n += 1;
            }
            HeaderValue::from_bytes(&buf[..n])
        }
        IpAddr::V6(v6) => HeaderValue::from_maybe_shared(bytes::Bytes::from(v6.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_that_carries_this_process_s_hop_id_is_a_loop() {
        let mut h = HeaderMap::new();
        assert!(!is_loop(&h));
        h.append(X_LOXI_HOP, HeaderValue::from_static("00000000000000aa"));
        assert!(!is_loop(&h), "another gateway's id");
        append(&mut h, client(), false);
        let ids: Vec<_> = h.get_all(X_LOXI_HOP).iter().collect();
        assert_eq!(
            ids,
            [&HeaderValue::from_static("00000000000000aa"), hop_id()]
        );
        assert!(is_loop(&h));
        // Within a joined value too, as a proxy between two hops may fold them.
        let folded = format!("00000000000000aa, {}", hop_id().to_str().expect("ascii"));
        let mut h = HeaderMap::new();
        h.insert(X_LOXI_HOP, HeaderValue::from_str(&folded).expect("value"));
        assert!(is_loop(&h));
        assert_eq!(hop_id().len(), 16);
    }

    fn client() -> Option<SocketAddr> {
        Some("10.0.0.7:4242".parse().expect("addr"))
    }

    #[test]
    fn the_client_address_is_appended_to_an_existing_chain() {
        let mut h = HeaderMap::new();
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.9"));
        h.append(
            X_FORWARDED_FOR,
            HeaderValue::from_static("198.51.100.1, 192.0.2.3"),
        );
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        append(&mut h, client(), false);
        assert_eq!(
            h.get_all(X_FORWARDED_FOR).iter().collect::<Vec<_>>(),
            ["203.0.113.9, 198.51.100.1, 192.0.2.3, 10.0.0.7"]
        );
        assert_eq!(
            h[X_FORWARDED_PROTO], "http",
            "the client cannot claim https"
        );
    }

    #[test]
    fn every_address_is_written_as_its_display_text() {
        for ip in [
            "0.0.0.0",
            "9.10.99.100",
            "255.255.255.255",
            "192.168.1.7",
            "100.64.0.10",
            "::1",
            "2001:db8::42",
        ] {
            let addr: IpAddr = ip.parse().expect("ip");
            let v = ip_value(addr).expect("value");
            assert_eq!(v.to_str().expect("ascii"), addr.to_string(), "{ip}");
        }
    }

    #[test]
    fn without_a_chain_the_client_starts_one_and_mapped_v4_is_shown_as_v4() {
        let mut h = HeaderMap::new();
        append(
            &mut h,
            Some("[::ffff:10.1.2.3]:80".parse().expect("addr")),
            true,
        );
        assert_eq!(h[X_FORWARDED_FOR], "10.1.2.3");
        assert_eq!(h[X_FORWARDED_PROTO], "https", "a TLS connection is https");
    }
}
