//! Helpers of the auth tests: a cluster with auth on, users with grants, raw HTTP calls.
#![allow(dead_code)]

use std::time::Duration;

use leasecore::client::Client;
use leasecore::domain::auth::PermKind;
use serde_json::Value;

use crate::common::TestCluster;

pub const ROOT_PASSWORD: &str = "root-secret-pw";

/// Create user root (role root) through `anon`, then enable auth; a root client of every node.
pub async fn enable_auth(c: &TestCluster) -> Client {
    let anon = c.client();
    anon.user_add("root", ROOT_PASSWORD).await.unwrap();
    anon.user_grant_role("root", "root").await.unwrap();
    anon.auth_enable().await.unwrap();
    c.client().with_credentials("root", ROOT_PASSWORD)
}

/// A user `name` with one role of the same name holding `grants` (kind, key, prefix); a client
/// authenticated as them.
pub async fn user_with(
    c: &TestCluster,
    root: &Client,
    name: &str,
    grants: &[(PermKind, &str, bool)],
) -> Client {
    root.user_add(name, &format!("{name}-pw")).await.unwrap();
    root.role_add(name).await.unwrap();
    for (kind, key, prefix) in grants {
        root.role_grant(name, *kind, key, *prefix).await.unwrap();
    }
    root.user_grant_role(name, name).await.unwrap();
    c.client()
        .with_credentials(name.to_string(), format!("{name}-pw"))
}

/// One raw call: (status, JSON body or Null).
pub async fn raw(
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let http = reqwest::Client::new();
    let mut req = http.request(method, url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Assert an error answer's status and code.
pub fn assert_error(answer: &(u16, Value), status: u16, code: &str) {
    assert_eq!(answer.0, status, "{}", answer.1);
    assert_eq!(answer.1["error"]["code"], code, "{}", answer.1);
}

/// An open SSE stream, read message by message.
pub struct Sse {
    resp: reqwest::Response,
    buf: String,
}

impl Sse {
    /// Open `url` (GET, or POST with `body`) as an event stream; panics unless 200.
    pub async fn open(url: &str, token: Option<&str>, body: Option<Value>) -> Sse {
        match Self::try_open(url, token, body).await {
            Ok(s) => s,
            Err((status, body)) => panic!("stream refused: {status} {body}"),
        }
    }

    pub async fn try_open(
        url: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> Result<Sse, (u16, Value)> {
        let http = reqwest::Client::new();
        let mut req = match &body {
            Some(b) => http.post(url).json(b),
            None => http.get(url),
        };
        req = req.header("accept", "text/event-stream");
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.unwrap();
        if resp.status() != 200 {
            let status = resp.status().as_u16();
            let v = resp.json().await.unwrap_or(Value::Null);
            return Err((status, v));
        }
        Ok(Sse {
            resp,
            buf: String::new(),
        })
    }

    /// The next event's data (comments and progress skipped).
    pub async fn next_event(&mut self) -> Value {
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let message: String = self.buf.drain(..end + 2).collect();
                if let Some(data) = message.lines().find_map(|l| l.strip_prefix("data:")) {
                    return serde_json::from_str(data.trim()).unwrap();
                }
            }
            let chunk = tokio::time::timeout(Duration::from_secs(10), self.resp.chunk())
                .await
                .expect("the stream stalled")
                .expect("the stream failed")
                .expect("the stream ended");
            self.buf.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }
}
