//! The three stores the gateway's tests run on, each in a place of its own that is removed
//! when its guard drops: a temporary SQLite file, a throwaway PostgreSQL database, a Redis
//! key prefix.

#![allow(dead_code, unreachable_pub)]

/// A store on a fresh SQLite file in a temporary folder.
pub async fn sqlite_store() -> (idem_store::SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_store::SqliteStore::open(dir.path().join("gateway.db"))
        .await
        .unwrap();
    (store, dir)
}

/// A store on a throwaway PostgreSQL database.
pub async fn postgres_store() -> (idem_store::PgStore, idem_store::testing::PgTestDatabase) {
    let db = idem_store::testing::PgTestDatabase::create().await;
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
