//! The console page (`GET /admin`): plain HTML, CSS and JavaScript embedded in the binary, with
//! nothing to build and nothing fetched from elsewhere. The page holds no data and is served
//! without the token; its script asks for the token and sends it with each call to the admin
//! API, which is where the token is checked.

use axum::http::{HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// The console's own files, unauthenticated.
pub(crate) fn router() -> axum::Router {
    axum::Router::new()
        .route(
            "/admin",
            axum::routing::get(|| async { file("text/html; charset=utf-8", PAGE) }),
        )
        .route(
            "/admin/console.js",
            axum::routing::get(|| async { file("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/admin/console.css",
            axum::routing::get(|| async { file("text/css; charset=utf-8", STYLE) }),
        )
}

/// Only the page's own origin for scripts, styles and calls, and no framing: a page that
/// holds an admin token in its session must not run another origin's code or sit in another
/// origin's frame (clickjacking a resolution).
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

fn file(content_type: &'static str, text: &'static str) -> Response {
    let headers = [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ];
    let mut response = text.into_response();
    for (name, value) in headers {
        response
            .headers_mut()
            .insert::<HeaderName>(name, HeaderValue::from_static(value));
    }
    response
}
