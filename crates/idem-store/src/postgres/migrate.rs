//! [`migrate_pg`]: sqlx's migrations applied in a way that works through a pooler.
//!
//! sqlx's own `Migrator::run` takes a session advisory lock and prepares its statements under
//! names, both of which outlive a transaction: behind PgBouncer in transaction mode its second
//! statement fails (`prepared statement "sqlx_s_1" already exists`), and its lock may be taken
//! on one server session and released on another. This runs the same migrations, recorded in
//! the same history table (so a database migrated by either is current for the other), in one
//! transaction under a transaction-scoped advisory lock, with unnamed statements only.

use std::time::Instant;

use sqlx::migrate::Migrator;
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Executor as _};

/// Why [`migrate_pg`] failed. Nothing was applied: the migrations commit together or not at
/// all.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// The database failed outside any one migration (connecting, locking, reading the history).
    #[error("the database failed while migrating")]
    Database(#[source] sqlx::Error),
    /// A migration's SQL failed.
    #[error("migration {version} ({description}) failed")]
    Migration {
        /// The migration's version.
        version: i64,
        /// Its description.
        description: String,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },
    /// The history lists a migration these migrations do not have (a newer release migrated
    /// this database).
    #[error("migration {0} was applied to this database but is not among the known migrations")]
    Missing(i64),
    /// An applied migration's SQL differs from the known migration of its version.
    #[error("migration {0} was applied with other contents than the known migration's")]
    Changed(i64),
    /// The history records a migration that failed half-way (sqlx leaves one so when a
    /// migration outside a transaction fails): the schema needs a look by hand.
    #[error("migration {0} failed part-way before; repair the schema by hand")]
    Dirty(i64),
    /// A migration that must run outside a transaction; these run in one.
    #[error("migration {0} must run outside a transaction, which is not supported here")]
    OutsideTransaction(i64),
}

impl From<sqlx::Error> for MigrationError {
    fn from(e: sqlx::Error) -> Self {
        MigrationError::Database(e)
    }
}

/// Applies `migrator`'s migrations not yet applied to the database of `pool`, recording them
/// in the migrator's history table (sqlx's format), in one transaction. Instances starting
/// together take turns (`pg_advisory_xact_lock`, keyed by the table's name) and each finds the
/// work done by the one before. The statement timeout is lifted for the transaction (a
/// migration on a large table may take long); the lock timeout stays.
///
/// # Errors
///
/// Nothing is applied when it fails:
/// - [`MigrationError::Database`] when the database fails outside a migration's own SQL.
/// - [`MigrationError::Migration`] when a migration's SQL fails.
/// - [`MigrationError::Missing`] when the history lists a migration `migrator` lacks.
/// - [`MigrationError::Changed`] when an applied migration's checksum differs.
/// - [`MigrationError::Dirty`] when the history records a migration that failed part-way.
/// - [`MigrationError::OutsideTransaction`] for a migration that cannot run in a transaction.
pub async fn migrate_pg(pool: &PgPool, migrator: &Migrator) -> Result<(), MigrationError> {
    let table = &*migrator.table_name;
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = 0")
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .persistent(false)
        .bind(lock_id(table))
        .execute(&mut *tx)
        .await?;
    tx.execute(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {table} (
            version BIGINT PRIMARY KEY,
            description TEXT NOT NULL,
            installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
            success BOOLEAN NOT NULL,
            checksum BYTEA NOT NULL,
            execution_time BIGINT NOT NULL
        )"
    )))
    .await?;
    let applied: Vec<(i64, Vec<u8>, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT version, checksum, success FROM {table} ORDER BY version"
    )))
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    if let Some((version, _, _)) = applied.iter().find(|(_, _, success)| !success) {
        return Err(MigrationError::Dirty(*version));
    }
    let ups = || {
        migrator
            .iter()
            .filter(|m| !m.migration_type.is_down_migration())
    };
    for (version, checksum, _) in &applied {
        match ups().find(|m| m.version == *version) {
            Some(m) if *m.checksum != checksum[..] => {
                return Err(MigrationError::Changed(*version));
            }
            Some(_) => {}
            None if migrator.ignore_missing => {}
            None => return Err(MigrationError::Missing(*version)),
        }
    }
    for m in ups().filter(|m| !applied.iter().any(|(v, _, _)| *v == m.version)) {
        if m.no_tx {
            return Err(MigrationError::OutsideTransaction(m.version));
        }
        let started = Instant::now();
        tx.execute(m.sql.clone())
            .await
            .map_err(|source| MigrationError::Migration {
                version: m.version,
                description: m.description.to_string(),
                source,
            })?;
        let took = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} (version, description, success, checksum, execution_time)
             VALUES ($1, $2, TRUE, $3, $4)"
        )))
        .persistent(false)
        .bind(m.version)
        .bind(&*m.description)
        .bind(&*m.checksum)
        .bind(took)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The advisory lock of one history table: FNV-1a of its name, the same in every process and
/// every build.
fn lock_id(table: &str) -> i64 {
    let hash = format!("idem migrations {table}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
    i64::from_ne_bytes(hash.to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_table_has_its_own_lock() {
        assert_eq!(
            lock_id("idem_store_migrations"),
            lock_id("idem_store_migrations")
        );
        assert_ne!(
            lock_id("idem_store_migrations"),
            lock_id("idem_consumer_migrations")
        );
    }
}
