//! SQLite: the service's statements, and the transactions of its single writer.

use anyhow::Context as _;
use idem_store::{SqliteStore, SqliteTx};
use idem_tower::OutcomeSignal;

use super::shared::{
    Statements, if_key_free, migrate_consumer, payment_from_row, service_migrations, shared_methods,
};
use super::{Backend, Invoice, Payment, Receipt};

macro_rules! sqlite_insert_payment {
    () => {
        "INSERT INTO payments
             (id, account_id, idem_key, amount, currency, status, reference, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
    };
}

macro_rules! sqlite_select_payment {
    () => {
        "SELECT id, amount, currency, status, reference, created_at FROM payments"
    };
}

const SQLITE: Statements = Statements {
    insert_receipt:
        "INSERT INTO receipts (event_id, payment_id, account_id, amount, currency, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    insert_payment_if_key_free: concat!(sqlite_insert_payment!(), if_key_free!()),
    insert_payment: sqlite_insert_payment!(),
    retire_key: "UPDATE payments SET retired_idem_key = idem_key, idem_key = NULL
         WHERE account_id = ?1 AND idem_key = ?2 AND created_at <= ?3",
    next_invoice_number: "INSERT INTO invoice_counters (account_id, last_number) VALUES (?1, 1)
         ON CONFLICT (account_id) DO UPDATE SET last_number = last_number + 1
         RETURNING last_number",
    insert_invoice:
        "INSERT INTO invoices (id, account_id, number, amount, currency, idem_key, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    find_payment: concat!(
        sqlite_select_payment!(),
        " WHERE id = ?1 AND account_id = ?2"
    ),
    list_payments: concat!(
        sqlite_select_payment!(),
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
