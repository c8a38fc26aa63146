//! The dashboard: a static page served at `/ui` by every node, with its script and style.
//!
//! The assets are compiled into the binary (`include_str!`): no CDN, no build step, nothing to
//! install. The page talks only to the public `/v1` API of the node that served it, so it
//! honours auth like any client (a 401 shows a sign-in box).
//!
//! # Invariants
//! - A strict Content-Security-Policy: scripts, styles and requests only from this origin, no
//!   inline script, no framing. The page renders everything with DOM text nodes, never HTML.
//!
//! # What it must not do
//! Expose anything the API does not: it holds no state and no secret.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                HeaderName::from_static("content-security-policy"),
                HeaderValue::from_static(CSP),
            ),
            (
                HeaderName::from_static("x-content-type-options"),
                HeaderValue::from_static("nosniff"),
            ),
            // A node upgrade changes the assets: revalidate rather than run a stale script.
            (CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
        .into_response()
}

/// `GET /ui` (and `/ui/`): the page.
pub async fn page() -> Response {
    asset(INDEX, "text/html; charset=utf-8")
}

/// `GET /ui/app.js`.
pub async fn script() -> Response {
    asset(SCRIPT, "text/javascript; charset=utf-8")
}

/// `GET /ui/style.css`.
pub async fn style() -> Response {
    asset(STYLE, "text/css; charset=utf-8")
}
