//! [`PgStore`]: records in PostgreSQL, shared by many server instances.
//!
//! (Being written: see the PostgreSQL issue.)

use sqlx::Postgres;

/// The transaction a handler writes through in transaction mode.
pub type PgTx = sqlx::Transaction<'static, Postgres>;

/// Records in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgStore {
    _pool: sqlx::PgPool,
}
