//! [`PgTx`], and the simple queries that carry BEGIN with the claim and the stored response
//! with COMMIT.
//!
//! sqlx binds parameters only in PostgreSQL's extended protocol, which carries one statement
//! per round trip, and it does not pipeline. The simple protocol carries several statements in
//! one round trip but no parameters, so there the values travel in the SQL text ([`Call`]),
//! written in an alphabet that cannot end a literal.

use std::fmt::Write as _;
use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgTransactionManager};
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr as _};
// The trait behind `Transaction`, public in sqlx-core but not re-exported by sqlx: it lets a
// transaction begin with statements of our own and keeps sqlx's own record of it (so a
// handler's nested `begin` opens a savepoint, and a dropped transaction rolls back).
use sqlx_core::transaction::TransactionManager as _;

use crate::Result;

/// The transaction a handler writes through in transaction mode: a pooled connection with a
/// transaction open on it.
///
/// It dereferences to the connection, so queries run on it as on any sqlx connection
/// (`.execute(&mut **tx)` from idem-tower's `Tx<PgTx>`); sqlx's `begin` on it opens a
/// savepoint. Dropping it without [`PgTx::commit`] rolls the transaction back.
#[derive(Debug)]
pub struct PgTx {
    conn: PoolConnection<Postgres>,
}

impl PgTx {
    /// Opens a transaction on `conn` with `begin`: BEGIN, then any statements to run in the
    /// same round trip. On failure the connection comes back, its transaction (if `begin`
    /// opened one) still to end.
    pub(super) async fn begin(
        mut conn: PoolConnection<Postgres>,
        begin: String,
    ) -> Result<Self, (PoolConnection<Postgres>, sqlx::Error)> {
        let begin = AssertSqlSafe(begin).into_sql_str();
        match PgTransactionManager::begin(&mut conn, Some(begin)).await {
            Ok(()) => Ok(Self { conn }),
            Err(e) => Err((conn, e)),
        }
    }

    /// Commits the transaction.
    pub async fn commit(mut self) -> Result<()> {
        PgTransactionManager::commit(&mut self.conn)
            .await
            .map_err(super::classify)
    }

    /// Rolls the transaction back.
    pub async fn rollback(mut self) -> Result<()> {
        PgTransactionManager::rollback(&mut self.conn)
            .await
            .map_err(super::classify)
    }

    /// Runs `last` and commits, in one round trip.
    pub(super) async fn commit_after(mut self, last: Call) -> Result<(), sqlx::Error> {
        // The trailing BEGIN leaves the connection in a transaction, as sqlx's record of it
        // says, so that sqlx's own bookkeeping can end it: `start_rollback` queues a ROLLBACK
        // of that empty transaction, which travels with the ping sqlx sends anyway when the
        // connection goes back to the pool. (COMMIT alone would leave sqlx believing a
        // transaction is open, and its ROLLBACK would draw a warning from the server.)
        let sql = format!("{}; COMMIT; BEGIN", last.sql());
        match sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *self.conn)
            .await
        {
            Ok(_) => {
                PgTransactionManager::start_rollback(&mut self.conn);
                Ok(())
            }
            Err(e) => {
                // Aborted (a statement failed) or ended (COMMIT failed): which, sqlx cannot
                // say, so the connection is not reused; closing it ends whatever is open.
                self.conn.close_on_drop();
                Err(e)
            }
        }
    }
}

impl Deref for PgTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        // Queued, not awaited: sqlx sends it before the connection's next use (at the latest
        // with the ping that returns it to the pool). A savepoint a handler left open would
        // have rolled back with its own guard; this ends whatever is still open.
        while PgTransactionManager::get_transaction_depth(&self.conn) > 0 {
            PgTransactionManager::start_rollback(&mut self.conn);
        }
    }
}

/// `SELECT function(arguments…)` as SQL text for a simple query, its arguments written as
/// literals that no value can break out of: text and bytes as hexadecimal digits decoded by
/// the server, integers as digits, booleans as keywords.
#[derive(Debug)]
pub(super) struct Call {
    sql: String,
    arguments: usize,
}

impl Call {
    /// A call of `function` (a name of ours, never input), arguments to follow.
    pub(super) fn new(function: &'static str) -> Self {
        Self {
            sql: format!("SELECT {function}("),
            arguments: 0,
        }
    }

    fn next(&mut self) -> &mut String {
        if self.arguments > 0 {
            self.sql.push_str(", ");
        }
        self.arguments += 1;
        &mut self.sql
    }

    /// A UTF-8 text argument.
    pub(super) fn text(mut self, value: &str) -> Self {
        let sql = self.next();
        sql.push_str("convert_from(decode('");
        sql.push_str(&hex::encode(value));
        sql.push_str("', 'hex'), 'UTF8')");
        self
    }

    /// A `jsonb` argument.
    pub(super) fn json(self, value: &str) -> Self {
        let mut call = self.text(value);
        call.sql.push_str("::jsonb");
        call
    }

    /// A `bytea` argument.
    pub(super) fn bytes(mut self, value: &[u8]) -> Self {
        let sql = self.next();
        sql.push_str("decode('");
        sql.push_str(&hex::encode(value));
        sql.push_str("', 'hex')");
        self
    }

    /// An integer argument, for a parameter of any integer type: a quoted literal takes the
    /// parameter's type, where a bare negative number would be a numeric expression.
    pub(super) fn int(mut self, value: impl Into<i64>) -> Self {
        let value = value.into();
        write!(self.next(), "'{value}'").expect("writing to a String cannot fail");
        self
    }

    /// A boolean argument.
    pub(super) fn bool(mut self, value: bool) -> Self {
        self.next().push_str(if value { "true" } else { "false" });
        self
    }

    /// The statement.
    pub(super) fn sql(mut self) -> String {
        self.sql.push(')');
        self.sql
    }
}

/// Whether `e` is the server's error with this SQLSTATE.
pub(super) fn is_raised(e: &sqlx::Error, sqlstate: &str) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == sqlstate)
}

#[cfg(test)]
mod tests {
    use super::Call;

    #[test]
    fn arguments_become_literals_of_hex_digits_and_digits() {
        let sql = Call::new("f")
            .text("it's a \\ key")
            .bytes(&[0, 0xff])
            .int(-5)
            .bool(true)
            .json("{}")
            .sql();
        assert_eq!(
            sql,
            "SELECT f(convert_from(decode('697427732061205c206b6579', 'hex'), 'UTF8'), \
             decode('00ff', 'hex'), '-5', true, \
             convert_from(decode('7b7d', 'hex'), 'UTF8')::jsonb)"
        );
    }
}
