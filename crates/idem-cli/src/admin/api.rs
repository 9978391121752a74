//! The admin API of `idem serve` and `idem proxy` (docs/contract.md §15): the operations of
//! [`crate::admin`] over HTTP, behind a bearer token, mounted only when a token is given.
//!
//! - `GET /admin/keys?state=&account=&limit=`: `{"keys": [record, …]}`, newest first;
//! - `GET /admin/keys/{account}/{key}`: one record, with its key's history as the store keeps
//!   it (`"events"`, oldest first; on the `404` of a key without a record too);
//! - `POST /admin/keys/{account}/{key}/resolve` with `{"status": 201, "headers": {"Name":
//!   "value"}, "body": …}` or `{"release": true}`, and optionally `"by": "…"` (who, for the
//!   key's history: `admin API` when not given);
//! - `GET /admin/outcomes`: `idem_requests_total` by outcome, sampled every 10 s over the last
//!   hour.
//!
//! Beside them, unauthenticated and holding no data, the console page that calls them
//! (`GET /admin`).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_core::{AccountId, Clock, Record, RecordEvent, RecordState, Timestamp};
use idem_store::AdminStore;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::outcomes::OutcomeSamples;
use super::{KeyState, Resolution, ResolveError};

/// The token the admin API asks for, kept as its SHA-256 so that every comparison is of 32
/// bytes in constant time, and a wrong token's length tells nothing either. Never printed.
#[derive(Clone)]
pub struct AdminToken(Arc<[u8; 32]>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

impl AdminToken {
    /// The token `text`.
    ///
    /// # Errors
    ///
    /// When it is shorter than 16 characters: an admin token must not be guessable.
    pub fn new(text: &str) -> Result<Self, String> {
        if text.trim().len() < 16 {
            return Err("the admin token must be at least 16 characters".into());
        }
        Ok(Self(Arc::new(
            Sha256::digest(text.trim().as_bytes()).into(),
        )))
    }

    /// Whether `presented` is the token, in time independent of both.
    pub(super) fn accepts(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        digest[..].ct_eq(&self.0[..]).into()
    }
}

/// What every admin route works with.
#[derive(Debug, Clone)]
struct Admin<S> {
    store: S,
    /// The server's clock, the frame of the times its records hold.
    clock: Arc<dyn Clock>,
    /// The layer's counters over the last hour, sampled from the time the router is built.
    outcomes: Arc<OutcomeSamples>,
}

/// The admin routes over `store`, each behind `token`; times by `clock`, the server's. Also
/// the console page, which holds no data and so is served without the token. Starts sampling
/// the layer's outcome counters (a task that ends when the router is dropped).
pub fn router<S: AdminStore>(store: S, token: AdminToken, clock: Arc<dyn Clock>) -> axum::Router {
    let admin = Admin {
        store,
        outcomes: OutcomeSamples::start(clock.clone()),
        clock,
    };
    axum::Router::new()
        .route("/admin/keys", axum::routing::get(list::<S>))
        .route("/admin/keys/{account}/{key}", axum::routing::get(show::<S>))
        .route(
            "/admin/keys/{account}/{key}/resolve",
            axum::routing::post(resolve::<S>),
        )
        .route("/admin/outcomes", axum::routing::get(outcomes::<S>))
        .with_state(admin)
        // On the routes only: a path outside them is not the admin API's to refuse, and the
        // console's files, merged after, are not behind it.
        .route_layer(axum::middleware::from_fn_with_state(token, authorize))
        .merge(super::console::router())
}

async fn authorize(State(token): State<AdminToken>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(presented) if token.accepts(presented.trim_ascii()) => next.run(request).await,
        Some(_) => unauthorized("the admin token is wrong"),
        None => unauthorized("the admin API needs `Authorization: Bearer TOKEN` (--admin-token)"),
    }
}

fn unauthorized(detail: &str) -> Response {
    let mut response = problem(StatusCode::UNAUTHORIZED, "Unauthorized", detail);
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// A problem-details answer (RFC 9457).
fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// `GET /admin/keys`'s query.
#[derive(Debug, serde::Deserialize)]
struct ListQuery {
    state: Option<KeyState>,
    account: Option<String>,
    #[serde(default = "default_limit")]
    limit: u32,
}

fn default_limit() -> u32 {
    50
}

async fn list<S: AdminStore>(
    State(Admin { store, clock, .. }): State<Admin<S>>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return problem(
            StatusCode::BAD_REQUEST,
            "Bad query",
            "expected state=in-progress|unknown|completed, account=ACCOUNT, limit=N",
        );
    };
    let now = clock.now();
    let filter = super::filter(
        query.state,
        query.account.map(AccountId::new),
        query.limit,
        now,
    );
    match store.list(&filter, now).await {
        Ok(records) => Json(json!({
            "keys": records.iter().map(|r| record_json(r, now)).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => store_failed(&e),
    }
}

async fn show<S: AdminStore>(
    State(Admin { store, clock, .. }): State<Admin<S>>,
    Path((account, key)): Path<(String, String)>,
) -> Response {
    let Ok(scope) = super::scope(&account, &key) else {
        return problem(StatusCode::BAD_REQUEST, "Bad key", "not a valid key");
    };
    let now = clock.now();
    let events = match store.events(&scope).await {
        Ok(events) => events_json(&events),
        Err(e) => return store_failed(&e),
    };
    match store.get(&scope, now).await {
        Ok(Some(record)) => {
            let mut shown = record_json(&record, now);
            shown["events"] = events;
            Json(shown).into_response()
        }
        Ok(None) => {
            // A released key's history outlives its record: the problem carries it.
            let body = json!({
                "type": "about:blank",
                "title": "No record",
                "status": 404,
                "detail": ResolveError::NoRecord.to_string(),
                "events": events,
            });
            (
                StatusCode::NOT_FOUND,
                [(header::CONTENT_TYPE, "application/problem+json")],
                body.to_string(),
            )
                .into_response()
        }
        Err(e) => store_failed(&e),
    }
}

/// A key's history as the admin API shows it, oldest first; times in Unix milliseconds.
fn events_json(events: &[RecordEvent]) -> Value {
    events
        .iter()
        .map(|event| json!({"at_ms": event.at.0, "what": event.what, "by": event.by}))
        .collect()
}

/// `POST …/resolve`'s body: an answer to store, or a release.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    status: Option<u16>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    body: Option<Value>,
    #[serde(default)]
    release: bool,
    /// Who resolves, for the key's history (the console says `console`).
    by: Option<String>,
}

async fn resolve<S: AdminStore>(
    State(Admin { store, clock, .. }): State<Admin<S>>,
    Path((account, key)): Path<(String, String)>,
    body: Result<Json<ResolveBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Ok(scope) = super::scope(&account, &key) else {
        return problem(StatusCode::BAD_REQUEST, "Bad key", "not a valid key");
    };
    let by = match &body {
        Ok(Json(ResolveBody { by: Some(by), .. })) if !super::valid_by(by) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "Bad resolution",
                "\"by\" names who resolves: 1 to 64 characters, no control characters",
            );
        }
        Ok(Json(ResolveBody { by: Some(by), .. })) => by.trim().to_owned(),
        _ => super::BY_ADMIN_API.to_owned(),
    };
    let resolution = match body {
        Ok(Json(ResolveBody {
            release: true,
            status: None,
            body: None,
            headers,
            ..
        })) if headers.is_empty() => Resolution::Release,
        Ok(Json(ResolveBody {
            release: false,
            status: Some(status),
            headers,
            body,
            ..
        })) => {
            let body = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
            match Resolution::complete(status, headers.into_iter().collect(), body) {
                Ok(resolution) => resolution,
                Err(e) => return resolve_failed(&e),
            }
        }
        _ => {
            return problem(
                StatusCode::BAD_REQUEST,
                "Bad resolution",
                r#"expected {"status": N, "headers": {…}, "body": …} or {"release": true}, each with an optional "by": "…""#,
            );
        }
    };
    match super::resolve(&store, &scope, &resolution, clock.now(), &by).await {
        Ok(resolved) => Json(json!({"resolved": resolved.name()})).into_response(),
        Err(e) => resolve_failed(&e),
    }
}

async fn outcomes<S: AdminStore>(State(Admin { outcomes, .. }): State<Admin<S>>) -> Response {
    Json(outcomes.to_json()).into_response()
}

fn resolve_failed(e: &ResolveError) -> Response {
    if let ResolveError::Store(e) = e {
        return store_failed(e);
    }
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::CONFLICT);
    problem(status, "Not resolved", &e.to_string())
}

fn store_failed(e: &idem_store::Error) -> Response {
    tracing::warn!(error = %idem_core::ErrorChain(e), "the admin API's store failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Store unavailable",
        "the store did not answer; try again",
    )
}

/// A record as the admin API shows it; times in Unix milliseconds.
fn record_json(record: &Record, now: Timestamp) -> Value {
    let mut shown = json!({
        "account": record.scope.account.as_str(),
        "key": record.scope.key.as_str(),
        "state": KeyState::of(record, now).name(),
        "created_at_ms": record.created_at.0,
        "fingerprint": record.fingerprint.to_string(),
    });
    match &record.state {
        RecordState::InProgress { lease_until, token } => {
            shown["lease_until_ms"] = lease_until.0.into();
            shown["token"] = token.0.into();
        }
        RecordState::Completed(response) => {
            shown["expires_at_ms"] = record.expires_at.0.into();
            shown["response"] = json!({
                "status": response.status,
                "headers": response.headers,
                "body": String::from_utf8_lossy(&response.body),
                "body_omitted": response.body_omitted,
            });
        }
    }
    shown
}
