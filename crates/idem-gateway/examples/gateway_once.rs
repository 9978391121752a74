//! Sends a fixed number of payments through `idem proxy` on Redis, or through a plain hyper
//! reverse proxy, to a trivial upstream, all in one process on one thread, and nothing else:
//! instruction counts of the gateway's path that do not move with the machine's load.
//!
//! ```text
//! cargo build --release -p idem-gateway --example gateway_once
//! valgrind --tool=callgrind target/release/examples/gateway_once idem 2000
//! valgrind --tool=callgrind target/release/examples/gateway_once plain 2000
//! ```
//!
//! As with idem-bench's `micro_once`, the count per request is the difference between two runs (say 1,000
//! and 3,000 requests) divided by their difference, so start-up cancels out. Redis runs in its
//! own process and is not counted; `INFO commandstats` tells its share. `REDIS_URL` (default
//! `redis://127.0.0.1:6379`) picks the server; the records go under a prefix of their own,
//! deleted at the end.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_gateway::{GatewayConfig, Secret};
use idem_store::RedisStore;
use tokio::net::TcpListener;

/// Requests in flight at once, each on its own keep-alive connection.
const CONNECTIONS: u64 = 8;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(variant), Some(times)) = (args.next(), args.next().and_then(|n| n.parse().ok()))
    else {
        eprintln!("usage: gateway_once idem|plain REQUESTS");
        return ExitCode::from(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    match runtime.block_on(run(&variant, times)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gateway_once: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T, E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

async fn run(variant: &str, times: u64) -> Result<()> {
    let upstream = spawn_app(
        Router::new()
            .fallback(payment)
            .with_state(Arc::new(AtomicU64::new(0))),
    )
    .await?;
    let upstream_url = format!("http://{upstream}/");
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let prefix = format!("idem-gateway-once:{}", uuid::Uuid::new_v4().simple());
    let proxy = match variant {
        "plain" => spawn_app(plain_proxy(upstream_url.parse()?)).await?,
        "idem" => {
            let config = GatewayConfig::new(
                upstream_url.parse()?,
                Secret::new(*b"idem-bench-secret-of-32-bytes...")?,
            )?;
            let store = RedisStore::connect(&redis_url, prefix.clone()).await?;
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            tokio::spawn(idem_gateway::serve(
                listener,
                store,
                config,
                std::future::pending(),
            ));
            addr
        }
        other => return Err(format!("no variant {other:?}: idem or plain").into()),
    };
    let url: http::Uri = format!("http://{proxy}/payments").parse()?;
    let mut workers = Vec::new();
    for worker in 0..CONNECTIONS {
        let url = url.clone();
        let client: Client<HttpConnector, Body> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let count = times / CONNECTIONS + u64::from(worker < times % CONNECTIONS);
        workers.push(tokio::spawn(async move {
            for n in 0..count {
                let request = http::Request::post(url.clone())
                    .header(header::AUTHORIZATION, "Bearer sk_test_alice")
                    .header(header::CONTENT_TYPE, "application/json")
                    .header("idempotency-key", format!("once-{worker}-{n}"))
                    .body(Body::from(r#"{"amount": 49900, "currency": "INR"}"#))?;
                let response = client.request(request).await?;
                if response.status() != 201 {
                    return Err(format!("got {}", response.status()).into());
                }
                response.into_body().collect().await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for worker in workers {
        worker.await??;
    }
    if variant == "idem" {
        clean_up(&redis_url, &prefix).await?;
    }
    Ok(())
}

/// Serves `app` on a port of its own.
async fn spawn_app(app: Router) -> Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// The trivial upstream: `201` with the next payment id, as idem-bench's.
async fn payment(State(counter): State<Arc<AtomicU64>>, body: Bytes) -> Response {
    let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/pay_{n}"))],
        axum::Json(serde_json::json!({
            "id": format!("pay_{n}"),
            "amount": value["amount"],
            "currency": value["currency"],
            "status": "succeeded",
        })),
    )
        .into_response()
}

/// The plain reverse proxy idem-bench compares with: the same HTTP client and server, nothing
/// else.
fn plain_proxy(upstream: http::Uri) -> Router {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Body> =
        Client::builder(TokioExecutor::new()).build(connector);
    Router::new().fallback(move |request: Request| {
        let (client, upstream) = (client.clone(), upstream.clone());
        async move {
            let (mut parts, body) = request.into_parts();
            let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
            parts.uri = format!("{upstream}{}", path.trim_start_matches('/'))
                .parse()
                .expect("a valid upstream URL");
            parts.headers.remove(header::HOST);
            match client.request(Request::from_parts(parts, body)).await {
                Ok(response) => response.map(Body::new),
                Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
            }
        }
    })
}

/// Deletes the run's records and index.
async fn clean_up(url: &str, prefix: &str) -> Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await?;
    for chunk in keys.chunks(1000) {
        let _: () = redis::cmd("UNLINK")
            .arg(chunk)
            .query_async(&mut conn)
            .await?;
    }
    Ok(())
}
