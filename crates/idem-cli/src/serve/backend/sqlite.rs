//! SQLite: the service's statements, and the transactions of its single writer.

use anyhow::Context as _;
use idem_store::{SqliteStore, SqliteTx};
use idem_tower::OutcomeSignal;

use super::shared::{
    Statements, if_key_free, migrate_consumer, payment_from_row, service_migrations, shared_methods,
};
use super::{Backend, Invoice, Payment, Receipt};

/// The statements, one file each in `sql/sqlite/`; a payment's `SELECT` and `INSERT`
/// are written once and completed here.
const SQLITE: Statements = Statements {
    insert_receipt: include_str!("sql/sqlite/insert_receipt.sql"),
    insert_payment_if_key_free: concat!(
        include_str!("sql/sqlite/insert_payment.sql"),
        if_key_free!()
    ),
    insert_payment: include_str!("sql/sqlite/insert_payment.sql"),
    retire_key: include_str!("sql/sqlite/retire_key.sql"),
    next_invoice_number: include_str!("sql/sqlite/next_invoice_number.sql"),
    insert_invoice: include_str!("sql/sqlite/insert_invoice.sql"),
    find_payment: concat!(
        include_str!("sql/sqlite/select_payment.sql"),
        " WHERE id = ?1 AND account_id = ?2"
    ),
    list_payments: concat!(
        include_str!("sql/sqlite/select_payment.sql"),
        " WHERE account_id = ?1 ORDER BY created_at DESC, id DESC LIMIT ?2"
    ),
};

impl Backend for SqliteStore {
    shared_methods!(
        db: sqlx::Sqlite,
        sql: SQLITE,
        writer: [writer],
        readers: [readers],
        persistent_in_tx: true,
    );

    async fn insert_payment<'a>(
        tx: &'a mut SqliteTx,
        account: &'a str,
        key: Option<&'a str>,
        retired_before: i64,
        payment: &'a Payment,
        event: Option<&'a idem_consumer::Message>,
    ) -> idem_store::Result<()> {
        let insert = |sql: &'static str| {
            sqlx::query(sql)
                .bind(&payment.id)
                .bind(account)
                .bind(key)
                .bind(payment.amount)
                .bind(&payment.currency)
                .bind(&payment.status)
                .bind(&payment.reference)
                .bind(payment.created_at)
        };
        let inserted = insert(SQLITE.insert_payment_if_key_free)
            .execute(&mut **tx)
            .await?
            .rows_affected();
        if inserted == 0 {
            // See TokioPgStore's: a payment holds the key.
            sqlx::query(SQLITE.retire_key)
                .bind(account)
                .bind(key)
                .bind(retired_before)
                .execute(&mut **tx)
                .await?;
            insert(SQLITE.insert_payment).execute(&mut **tx).await?;
        }
        if let Some(event) = event {
            idem_consumer::enqueue::<sqlx::Sqlite>(&mut **tx, event, payment.created_at).await?;
        }
        Ok(())
    }

    async fn issue_invoice<'a>(
        tx: &'a mut SqliteTx,
        account: &'a str,
        key: &'a str,
        invoice: &'a mut Invoice,
    ) -> idem_store::Result<()> {
        invoice.number = sqlx::query_scalar(SQLITE.next_invoice_number)
            .bind(account)
            .fetch_one(&mut **tx)
            .await?;
        sqlx::query(SQLITE.insert_invoice)
            .bind(&invoice.id)
            .bind(account)
            .bind(invoice.number)
            .bind(invoice.amount)
            .bind(&invoice.currency)
            .bind(key)
            .bind(invoice.created_at)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn open_service(url: &str) -> anyhow::Result<Self> {
        let store = SqliteStore::connect(url)
            .await
            .with_context(|| format!("cannot open the database {url}"))?;
        service_migrations(sqlx::migrate!("migrations/sqlite"))
            .run(store.writer())
            .await
            .context("cannot migrate the payments schema")?;
        migrate_consumer(store.writer()).await?;
        Ok(store)
    }

    /// A turn at the group committer, like a keyed request's.
    async fn begin(&self) -> idem_store::Result<SqliteTx> {
        SqliteStore::begin(self).await
    }

    async fn commit(tx: SqliteTx) -> idem_store::Result<()> {
        tx.commit().await
    }

    /// One SQLite file serves one process: waking this process's waiters is enough.
    async fn outcome_signal(&self) -> anyhow::Result<OutcomeSignal> {
        Ok(OutcomeSignal::default())
    }

    /// One file on this machine: there is no other host to look for.
    fn failed(&self, _e: &sqlx::Error) {}

    /// SQLite's statement cache lives in this process.
    fn persistent(&self) -> bool {
        true
    }
}
