//! What the gateway's tests share: the three stores they run on, each in a place of its own
//! that is removed when its guard drops (a temporary SQLite file, a throwaway PostgreSQL
//! database, a Redis key prefix), a gateway served on a port of its own, and its answers read
//! whole.

#![allow(dead_code, unreachable_pub)]

use idem_gateway::{GatewayConfig, Secret};

/// A store on a fresh SQLite file in a temporary folder.
pub async fn sqlite_store() -> (idem_store::SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_store::SqliteStore::open(dir.path().join("gateway.db"))
        .await
        .unwrap();
    (store, dir)
}

/// A store on a throwaway PostgreSQL database.
pub async fn postgres_store() -> (idem_store::PgStore, idem_testkit::postgres::PgTestDatabase) {
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let store = idem_store::PgStore::connect(db.url()).await.unwrap();
    (store, db)
}

/// Deletes a test's Redis keys when dropped.
pub struct RedisPrefix(pub String);

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        if let Ok(client) = ::redis::Client::open(redis_url())
            && let Ok(mut conn) = client.get_connection()
        {
            let keys: Vec<String> = ::redis::cmd("KEYS")
                .arg(format!("{}:*", self.0))
                .query(&mut conn)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: Result<(), _> = ::redis::cmd("DEL").arg(keys).query(&mut conn);
            }
        }
    }
}

/// The Redis the tests use (`IDEM_TEST_REDIS_URL`, default the local one, which must be up).
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| {
        idem_testkit::require(idem_testkit::Service::Redis);
        "redis://127.0.0.1:6379".into()
    })
}

/// A store on Redis under a key prefix of its own.
pub async fn redis_store() -> (idem_store::RedisStore, RedisPrefix) {
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let store = idem_store::RedisStore::connect(&redis_url(), prefix.clone())
        .await
        .unwrap();
    (store, RedisPrefix(prefix))
}

/// An answer read whole: its status, headers and body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

impl Answer {
    /// Whether the gateway answered from the stored response.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The problem type's last part (`missing-key`), or "" for a body that is not a problem.
    pub fn problem(&self) -> String {
        let body: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        body["type"]
            .as_str()
            .unwrap_or("")
            .trim_start_matches("urn:idem:problem:")
            .to_owned()
    }

    /// Checks that this is idem's refusal with `status` and the problem type `problem`
    /// (`missing-key`).
    #[track_caller]
    pub fn assert_refused(&self, status: u16, problem: &str) {
        assert_eq!(
            (self.status, self.problem().as_str()),
            (status, problem),
            "{}",
            self.body
        );
    }

    /// Checks that this is `first` again, replayed: its status and body, marked as a replay.
    #[track_caller]
    pub fn assert_replays(&self, first: &Answer) {
        assert!(self.replayed(), "not a replay: {self:?}");
        assert_eq!((self.status, &self.body), (first.status, &first.body));
    }
}

/// A JSON `POST` of `body` to `url` from `credential` (the `Authorization` header), with these
/// extra `headers` (an `Idempotency-Key`, say).
pub fn json_post(
    client: &reqwest::Client,
    url: String,
    credential: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> reqwest::RequestBuilder {
    headers.iter().fold(
        client
            .post(url)
            .header("authorization", credential)
            .header("content-type", "application/json")
            .body(body.to_owned()),
        |request, (name, value)| request.header(*name, *value),
    )
}

/// Sends `request` and reads its answer whole.
pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("the gateway answers");
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.text().await.unwrap(),
    }
}

/// The tests' gateway configuration in front of the upstream at `upstream`.
pub fn config(upstream: std::net::SocketAddr) -> GatewayConfig {
    GatewayConfig::new(
        format!("http://{upstream}").parse().unwrap(),
        Secret::new(b"test-secret-0123456789".to_vec()).unwrap(),
    )
    .expect("the platform's roots")
}

/// Serves a gateway with `config` over `store` on a port of its own for the rest of the test;
/// its URL.
pub async fn serve<St: idem_store::Store>(store: St, config: GatewayConfig) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(idem_gateway::serve(
        listener,
        store,
        config,
        std::future::pending(),
    ));
    url
}

/// One test per name on each store, in `mod sqlite`, `mod postgres` and `mod redis`: each
/// makes a fresh store and passes it to the test file's function of that name.
#[macro_export]
macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        $crate::on_every_store!(@on sqlite, $crate::common::sqlite_store(); $($name),*);
        $crate::on_every_store!(@on postgres, $crate::common::postgres_store(); $($name),*);
        $crate::on_every_store!(@on redis, $crate::common::redis_store(); $($name),*);
    };
    (@on $store:ident, $make:expr; $($name:ident),*) => {
        mod $store {
            idem_store::tests_per_store!($make => [super]; $($name),*);
        }
    };
}
