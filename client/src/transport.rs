//! Transport failures in the words a person acts on: "connection refused", "timed out",
//! rather than reqwest's "error sending request for url (...)" with its cause four sources
//! deep. Used by the client's error messages and the peer network's logs.
//!
//! # What it must not do
//! Classify for retry decisions: callers decide on `reqwest::Error::is_connect()` and the
//! like; this only describes.

use std::io::ErrorKind;

/// The deepest useful cause of a reqwest failure, in a few words.
pub fn cause(e: &reqwest::Error) -> String {
    let mut io_kind = None;
    let mut deepest = e.to_string();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            io_kind = Some(io.kind());
        }
        deepest = err.to_string();
        source = err.source();
    }
    match io_kind {
        Some(ErrorKind::ConnectionRefused) => "connection refused".into(),
        Some(ErrorKind::ConnectionReset) => "connection reset".into(),
        Some(ErrorKind::ConnectionAborted) => "connection aborted".into(),
        Some(ErrorKind::TimedOut) => "timed out".into(),
        _ if e.is_timeout() => "timed out".into(),
        _ if e.is_connect() => format!("cannot connect ({deepest})"),
        _ if e.is_body() || e.is_decode() => format!("the answer broke off ({deepest})"),
        _ => deepest,
    }
}

/// `scheme://host:port` of a URL (what a person recognizes as the endpoint).
pub fn endpoint_of(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(slash) => &url[..after_scheme + slash],
        None => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_of_a_url_is_its_scheme_and_authority() {
        assert_eq!(
            endpoint_of("http://127.0.0.1:7001/v1/kv/a"),
            "http://127.0.0.1:7001"
        );
        assert_eq!(endpoint_of("https://h:1"), "https://h:1");
        assert_eq!(endpoint_of("h:1/x"), "h:1");
    }

    #[tokio::test]
    async fn a_refused_connection_says_so() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let e = reqwest::Client::new()
            .get(format!("http://{addr}/"))
            .send()
            .await
            .unwrap_err();
        assert_eq!(cause(&e), "connection refused");
    }
}
