//! Extractors that turn every malformed request into a JSON error (never axum's plain text).
//!
//! - [`ApiJson`] reads the body as JSON whatever the `Content-Type` (curl users forget it), and
//!   maps a body over the limit to 413 `too_large` and anything undecodable to 400.
//! - [`ApiQuery`] and [`ApiPath`] map bad query strings and paths (invalid percent-encoding,
//!   invalid UTF-8, wrong types) to 400.

use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use bytes::Bytes;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::listener::BodyDeadlineExceeded;

/// A JSON body.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        if bytes.is_empty() {
            return Err(ApiError::invalid(
                "the request body must be a JSON document",
            ));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
    }
}

/// Map a body read failure: over the limit is 413, too slow 408, the rest 400.
pub fn body_rejection(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large("the request body is over the size limit")
    } else if caused_by_deadline(&e) {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request body did not arrive in time",
        )
    } else {
        ApiError::invalid(format!("unreadable request body: {}", e.body_text()))
    }
}

fn caused_by_deadline(e: &BytesRejection) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.is::<BodyDeadlineExceeded>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Query parameters.
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| ApiQuery(q))
            .map_err(|e: QueryRejection| {
                ApiError::invalid(format!("invalid query string: {}", e.body_text()))
            })
    }
}

/// Path parameters.
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(p)| ApiPath(p))
            .map_err(|e: PathRejection| {
                ApiError::invalid(format!("invalid path: {}", e.body_text()))
            })
    }
}
