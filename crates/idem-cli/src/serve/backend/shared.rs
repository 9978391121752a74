//! The [`Backend`](super::Backend) code that is the same on both databases, and the
//! statements each one supplies to it.

use anyhow::Context as _;
use sqlx::Row;

use super::Payment;

/// The payment in `row` (a `SELECT` of [`Statements::find_payment`]'s columns).
pub(super) fn payment_from_row<R: Row>(row: &R) -> Result<Payment, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(Payment {
        id: row.try_get("id")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        status: row.try_get("status")?,
        reference: row.try_get("reference")?,
        created_at: row.try_get("created_at")?,
    })
}

/// The service's statements in one database's SQL. Both databases bind the same values in
/// the same order; they differ in placeholders and in how a time is kept (SQLite: Unix
/// milliseconds; PostgreSQL: `timestamptz`, converted exactly, see idem-store's PgStore).
pub(super) struct Statements {
    pub(super) insert_receipt: &'static str,
    /// The payment, or nothing when a payment holds its key already.
    pub(super) insert_payment_if_key_free: &'static str,
    /// The payment; fails on the UNIQUE when a payment holds its key.
    pub(super) insert_payment: &'static str,
    /// Takes the key away from a payment made before the key's retention ended.
    pub(super) retire_key: &'static str,
    pub(super) next_invoice_number: &'static str,
    pub(super) insert_invoice: &'static str,
    pub(super) find_payment: &'static str,
    pub(super) list_payments: &'static str,
}

/// The clause that turns a payment's insert into nothing when a payment holds its key.
macro_rules! if_key_free {
    () => {
        " ON CONFLICT (account_id, idem_key) DO NOTHING"
    };
}

pub(super) use if_key_free;

/// The [`Backend`](super::Backend) items that are the same code on both databases, written
/// once: `$sql` holds the database's statements, `$writer` and `$readers` name the store's
/// sqlx pools.
/// `$persistent_in_tx`: whether the statements run in the inbox's transaction may be named (the
/// consumer's own are not on PostgreSQL).
macro_rules! shared_methods {
    (
        db: $db:ty,
        sql: $sql:expr,
        writer: [$($writer:ident),+],
        readers: [$($readers:ident),+],
        persistent_in_tx: $persistent_in_tx:expr $(,)?
    ) => {
        type Db = $db;

        fn write_pool(&self) -> &sqlx::Pool<$db> {
            self$(.$writer())+
        }

        async fn insert_receipt<'a>(
            conn: &'a mut <$db as sqlx::Database>::Connection,
            receipt: &'a Receipt,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($sql.insert_receipt)
                .persistent($persistent_in_tx)
                .bind(&receipt.event_id)
                .bind(&receipt.payment_id)
                .bind(&receipt.account_id)
                .bind(receipt.amount)
                .bind(&receipt.currency)
                .bind(receipt.created_at)
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn find_payment(
            &self,
            account: &str,
            id: &str,
        ) -> Result<Option<Payment>, sqlx::Error> {
            let query = sqlx::query($sql.find_payment)
                .persistent(self.persistent())
                .bind(id)
                .bind(account);
            let row = if self.persistent() {
                query.fetch_optional(self$(.$readers())+).await
            } else {
                // Behind a pooler an unnamed statement is prepared and run in two exchanges,
                // which the pooler may give two server sessions unless a transaction holds one.
                async {
                    let mut tx = self$(.$readers())+.begin().await?;
                    let row = query.fetch_optional(&mut *tx).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(row)
                }
                .await
            }
            .inspect_err(|e| self.failed(e))?;
            row.as_ref().map(payment_from_row).transpose()
        }

        async fn list_payments(
            &self,
            account: &str,
            limit: i64,
        ) -> Result<Vec<Payment>, sqlx::Error> {
            let query = sqlx::query($sql.list_payments)
                .persistent(self.persistent())
                .bind(account)
                .bind(limit);
            let rows = if self.persistent() {
                query.fetch_all(self$(.$readers())+).await
            } else {
                // As in `find_payment`: one server session for the preparation and the run.
                async {
                    let mut tx = self$(.$readers())+.begin().await?;
                    let rows = query.fetch_all(&mut *tx).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(rows)
                }
                .await
            }
            .inspect_err(|e| self.failed(e))?;
            rows.iter().map(payment_from_row).collect()
        }

        async fn ping(&self) -> Result<(), sqlx::Error> {
            // The simple protocol: no statement to prepare, so behind a pooler no other
            // client's statement can come between a preparation and its execution.
            sqlx::raw_sql("SELECT 1")
                .execute(self$(.$readers())+)
                .await
                .inspect_err(|e| self.failed(e))
                .map(|_| ())
        }
    };
}
pub(super) use shared_methods;

/// The service's own migrations, with their own history table.
pub(super) fn service_migrations(mut migrator: sqlx::migrate::Migrator) -> sqlx::migrate::Migrator {
    migrator.dangerous_set_table_name("idem_serve_migrations");
    migrator
}

/// Applies the outbox's and inbox's migrations (after the service's own).
pub(super) async fn migrate_consumer<DB: idem_consumer::Database>(
    pool: &sqlx::Pool<DB>,
) -> anyhow::Result<()> {
    DB::migrate(pool)
        .await
        .context("cannot migrate the outbox and inbox schema")
}
