//! The store's errors.

/// Why a store operation failed. The layer answers each with `503` and `Retry-After`: the
/// request is never processed without its key record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached, or no connection was free in time. The cause is the
    /// backend driver's error (`sqlx::Error`, `redis::RedisError`).
    #[error("the idempotency store is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The database answered with an error.
    #[error("the idempotency store failed")]
    Database(#[source] sqlx::Error),
    /// Applying the schema migrations failed.
    #[error("migrating the idempotency store's schema failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// Redis answered with an error.
    #[cfg(feature = "redis")]
    #[error("the Redis idempotency store failed")]
    Redis(#[source] redis::RedisError),
    /// A row could not be read back as a record.
    #[error("a stored idempotency record is corrupt: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        // Classified by kind, never by message.
        match e {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed => Error::Unavailable(Box::new(e)),
            e => Error::Database(e),
        }
    }
}

/// The store's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
