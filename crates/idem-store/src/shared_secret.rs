//! [`SharedSecret`]: a secret that every process on one store shares, made once by whichever
//! process needs it first.
//!
//! `idem proxy` derives each caller's scope from its credential with a secret key. Gateways
//! that share a store must derive the same scopes, or a retry that reaches another instance is
//! a new request and runs again; so the secret lives in the store beside the records it scopes.
//! Creating it is one insert-if-absent, like a claim: of any number of processes starting at
//! once, one stores its candidate and every other reads that one.
//!
//! Where it is kept: the table `idem_secrets` (PostgreSQL, SQLite; migration 0002), or the
//! key `{prefix}:secret:{name}` (Redis, also on a cluster), with no TTL.

use std::future::Future;

use crate::{Result, Store};

/// What [`SharedSecret::share_secret`] found.
#[derive(Clone, PartialEq, Eq)]
pub struct Shared {
    /// The secret every process on the store uses.
    pub value: String,
    /// Whether this call stored it (its candidate), rather than finding one stored.
    pub inserted: bool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never printed: a log line with it would hand out every caller's scope.
        f.debug_struct("Shared")
            .field("value", &"..")
            .field("inserted", &self.inserted)
            .finish()
    }
}

/// A store that keeps named secrets for every process on it.
///
/// ```no_run
/// use idem_store::{SharedSecret, SqliteStore};
/// # async fn demo() -> idem_store::Result<()> {
/// let store = SqliteStore::open("idem.db").await?;
/// let shared = store.share_secret("my-secret", "a-fresh-random-candidate").await?;
/// // The same value in every process on this store, whichever stored it first.
/// assert_eq!(store.read_secret("my-secret").await?, Some(shared.value));
/// # Ok(()) }
/// ```
pub trait SharedSecret: Store {
    /// The secret stored under `name`; when none is, `candidate` is stored first, atomically,
    /// so every process that asks gets the same value whichever asked first.
    fn share_secret(
        &self,
        name: &str,
        candidate: &str,
    ) -> impl Future<Output = Result<Shared>> + Send;

    /// The secret stored under `name`, if any; stores nothing.
    fn read_secret(&self, name: &str) -> impl Future<Output = Result<Option<String>>> + Send;
}

/// PostgreSQL: the insert and the read in one transaction of their own, with unnamed
/// statements, so they work through a pooler in transaction mode too. Under READ COMMITTED
/// the insert waits for a concurrent one of the same name to end, and the read, a statement
/// of its own, then sees whichever row was committed.
#[cfg(feature = "postgres")]
impl SharedSecret for crate::PgStore {
    async fn share_secret(&self, name: &str, candidate: &str) -> Result<Shared> {
        let mut tx = self.pool().begin().await.inspect_err(|e| self.notice(e))?;
        let inserted = sqlx::query(
            "INSERT INTO idem_secrets (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        )
        .persistent(false)
        .bind(name)
        .bind(candidate)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        let value: String = sqlx::query_scalar("SELECT value FROM idem_secrets WHERE name = $1")
            .persistent(false)
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Shared { value, inserted })
    }

    async fn read_secret(&self, name: &str) -> Result<Option<String>> {
        let value = sqlx::query_scalar("SELECT value FROM idem_secrets WHERE name = $1")
            .persistent(false)
            .bind(name)
            .fetch_optional(self.pool())
            .await
            .inspect_err(|e| self.notice(e))?;
        Ok(value)
    }
}

/// SQLite: on the writer, between the group committer's groups, in one transaction.
#[cfg(feature = "sqlite")]
impl SharedSecret for crate::SqliteStore {
    async fn share_secret(&self, name: &str, candidate: &str) -> Result<Shared> {
        let mut tx = self.writer().begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO idem_secrets (name, value) VALUES (?1, ?2) ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(candidate)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        let value: String = sqlx::query_scalar("SELECT value FROM idem_secrets WHERE name = ?1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Shared { value, inserted })
    }

    async fn read_secret(&self, name: &str) -> Result<Option<String>> {
        let value = sqlx::query_scalar("SELECT value FROM idem_secrets WHERE name = ?1")
            .bind(name)
            .fetch_optional(self.readers())
            .await?;
        Ok(value)
    }
}

/// Redis: `SET NX`, then `GET` when the key was there already. The key has no TTL, and on a
/// cluster it lives on the node of its own slot like any key. Replication is asynchronous: a
/// failover right after the first gateway made the secret can lose it (see the gateway's
/// docs).
#[cfg(feature = "redis")]
impl SharedSecret for crate::RedisStore {
    async fn share_secret(&self, name: &str, candidate: &str) -> Result<Shared> {
        let key = self.secret_key(name);
        let set: Option<String> = self
            .conn
            .query(redis::cmd("SET").arg(&key).arg(candidate).arg("NX"))
            .await?;
        if set.is_some() {
            return Ok(Shared {
                value: candidate.to_owned(),
                inserted: true,
            });
        }
        match self.read_secret(name).await? {
            Some(value) => Ok(Shared {
                value,
                inserted: false,
            }),
            // Deleted between the two commands (by hand): not a state to guess from.
            None => Err(crate::Error::Raced(format!(
                "the secret {key} vanished right after it was found"
            ))),
        }
    }

    async fn read_secret(&self, name: &str) -> Result<Option<String>> {
        self.conn
            .query(redis::cmd("GET").arg(self.secret_key(name)))
            .await
    }
}

#[cfg(feature = "redis")]
impl crate::RedisStore {
    /// Where the secret `name` is kept: under the store's prefix, so gateways that share a
    /// server under different prefixes (different records) have different secrets.
    fn secret_key(&self, name: &str) -> String {
        format!("{}:secret:{name}", self.prefix)
    }
}
