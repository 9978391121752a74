//! A PostgreSQL database of its own per test, on the server at `IDEM_TEST_PG_URL` (default: the
//! local server with trust authentication), dropped when the test ends, pass or fail.
//!
//! A test that wants idem's store on it migrates a pool itself
//! (`PgStore::from_pool(db.pool(4).await)`): this crate is below idem-store, whose own tests
//! use it.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};

const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The administrative URL tests connect to.
pub fn admin_url() -> String {
    std::env::var("IDEM_TEST_PG_URL").unwrap_or_else(|_| {
        crate::require(crate::Service::Postgres);
        DEFAULT_ADMIN_URL.to_owned()
    })
}

/// `url` with its database replaced by `database`, keeping any query parameters.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority..].find('/') {
        Some(slash) => &base[..authority + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{database}?{query}"),
        None => format!("{base}/{database}"),
    }
}

/// `url` with its host replaced by `hosts`, in that order (libpq's multi-host form), and
/// `params` (`name=value&…`, or nothing) added to its query.
pub fn with_hosts(url: &str, hosts: &[std::net::SocketAddr], params: &str) -> String {
    let authority = url.find("://").map_or(0, |i| i + 3);
    let at = url[authority..]
        .find('@')
        .map_or(authority, |i| authority + i + 1);
    let path = url[at..].find(['/', '?']).map_or(url.len(), |i| at + i);
    let hosts: Vec<String> = hosts.iter().map(ToString::to_string).collect();
    let joiner = if url.contains('?') { '&' } else { '?' };
    let params = if params.is_empty() {
        String::new()
    } else {
        format!("{joiner}{params}")
    };
    format!("{}{}{}{params}", &url[..at], hosts.join(","), &url[path..])
}

/// A database for one test; dropping it drops the database.
#[derive(Debug)]
pub struct PgTestDatabase {
    name: String,
    url: String,
}

impl PgTestDatabase {
    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates a fresh, empty database.
    ///
    /// # Panics
    ///
    /// When the test server ([`admin_url`]) cannot be reached or refuses to create the
    /// database.
    pub async fn create() -> Self {
        // A UUID's simple form is lower-case hex, so the name needs no quoting. Copying
        // template0, which nobody connects to, works whichever database the admin URL names
        // (copying template1 fails while another test's admin session is connected to it).
        let name = format!("idem_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(&admin_url())
            .await
            .expect("connect to the test server (set IDEM_TEST_PG_URL)");
        admin
            .execute(AssertSqlSafe(format!(
                "CREATE DATABASE {name} TEMPLATE template0"
            )))
            .await
            .expect("create the test database");
        admin.close().await.expect("close the admin connection");
        Self {
            url: with_database(&admin_url(), &name),
            name,
        }
    }

    /// A pool of at most `max` connections to the database.
    ///
    /// # Panics
    ///
    /// When the database cannot be reached.
    pub async fn pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .connect(&self.url)
            .await
            .expect("connect to the test database")
    }
}

impl Drop for PgTestDatabase {
    fn drop(&mut self) {
        // Drop cannot await, and a runtime cannot be blocked on from inside itself: the drop
        // runs to completion on a thread with a runtime of its own. FORCE ends the sessions the
        // test's pools may still hold.
        let name = self.name.clone();
        let dropped = std::thread::spawn(
            move || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async {
                    let mut admin = PgConnection::connect(&admin_url()).await?;
                    admin
                        .execute(AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .await?;
                    admin.close().await?;
                    Ok(())
                })
            },
        )
        .join();
        // No panic here: this may run while a failed test unwinds, and a second panic aborts.
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop test database {}: {e}", self.name),
            Err(_) => eprintln!("dropping test database {} panicked", self.name),
        }
    }
}
