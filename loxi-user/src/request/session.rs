//! The persist session key, read from the request per the rule's `session_header_name`:
//! a header name (full value), `cookie:NAME`, `query:NAME` or `basic-auth` (the username of an
//! `Authorization: Basic` header). Empty name or a missing value → `None` (the selector then
//! keys on the client IP). Cookie and query names are case-sensitive; header names are not.

use base64::Engine as _;
use percent_encoding::percent_decode_str;

/// The session key of a request, or `None`.
pub fn session_key(parts: &http::request::Parts, spec: &str) -> Option<String> {
    let spec = spec.trim();
    let key = if spec.is_empty() {
        None
    } else if let Some(name) = strip_prefix_ci(spec, "cookie:") {
        cookie(&parts.headers, name)
    } else if let Some(name) = strip_prefix_ci(spec, "query:") {
        query(parts.uri.query().unwrap_or(""), name)
    } else if spec.eq_ignore_ascii_case("basic-auth") {
        basic_auth_user(&parts.headers)
    } else {
        parts
            .headers
            .get(spec)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    key.filter(|k| !k.is_empty())
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

fn cookie(headers: &http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim_matches('"').to_string())
}

fn query(q: &str, name: &str) -> Option<String> {
    q.split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| percent_decode_str(k).decode_utf8_lossy() == name)
        .map(|(_, v)| {
            percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
}

fn basic_auth_user(headers: &http::HeaderMap) -> Option<String> {
    let v = headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim();
    let b64 = strip_prefix_ci(v, "basic ")?.trim();
    let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    let text = String::from_utf8(raw).ok()?;
    Some(
        text.split_once(':')
            .map_or(text.as_str(), |(u, _)| u)
            .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::get(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn header_cookie_query_and_basic_auth() {
        let p = parts(
            "/x?a=1&sid=ab%20c&z",
            &[
                ("X-Session-ID", "s1"),
                ("cookie", "foo=1; JSESSIONID=\"j2\""),
                ("authorization", "Basic YWxpY2U6c2VjcmV0"),
            ],
        );
        assert_eq!(session_key(&p, "x-session-id").as_deref(), Some("s1"));
        assert_eq!(session_key(&p, "cookie:JSESSIONID").as_deref(), Some("j2"));
        assert_eq!(session_key(&p, "cookie:jsessionid"), None);
        assert_eq!(session_key(&p, "query:sid").as_deref(), Some("ab c"));
        assert_eq!(session_key(&p, "query:missing"), None);
        assert_eq!(session_key(&p, "basic-auth").as_deref(), Some("alice"));
        assert_eq!(session_key(&p, ""), None);
    }

    #[test]
    fn malformed_basic_auth_is_none() {
        let p = parts("/", &[("authorization", "Basic !!!")]);
        assert_eq!(session_key(&p, "basic-auth"), None);
        let p = parts("/", &[("authorization", "Bearer tok")]);
        assert_eq!(session_key(&p, "basic-auth"), None);
    }
}
