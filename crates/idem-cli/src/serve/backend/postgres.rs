//! PostgreSQL: the service's statements, run on tokio-postgres in the request path and on
//! sqlx elsewhere.

use anyhow::Context as _;
use idem_store::{TokioPgStore, TokioPgTx};
use idem_tower::OutcomeSignal;
use tokio_postgres::types::{ToSql, Type};

use super::shared::{
    Statements, if_key_free, migrate_consumer, payment_from_row, service_migrations, shared_methods,
};
use super::{Backend, Invoice, Payment, Receipt};
use crate::store_url::redact;

/// The statements, one file each in `sql/postgres/`; a payment's `SELECT` and `INSERT`
/// are written once and completed here.
const POSTGRES: Statements = Statements {
    insert_receipt: include_str!("sql/postgres/insert_receipt.sql"),
    insert_payment_if_key_free: concat!(
        include_str!("sql/postgres/insert_payment.sql"),
        if_key_free!()
    ),
    insert_payment: include_str!("sql/postgres/insert_payment.sql"),
    retire_key: include_str!("sql/postgres/retire_key.sql"),
    // The counter row's lock orders concurrent invoices of one account; it is held until the
    // request's transaction ends, so numbers are issued in commit order, without gaps.
    next_invoice_number: include_str!("sql/postgres/next_invoice_number.sql"),
    insert_invoice: include_str!("sql/postgres/insert_invoice.sql"),
    find_payment: concat!(
        include_str!("sql/postgres/select_payment.sql"),
        " WHERE id = $1 AND account_id = $2"
    ),
    list_payments: concat!(
        include_str!("sql/postgres/select_payment.sql"),
        " WHERE account_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
    ),
};

/// The parameters of [`Statements::insert_payment`] and its `if_key_free` form on PostgreSQL:
/// id, account, key, amount, currency, status, reference, created at (Unix milliseconds).
const PG_PAYMENT_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
];

/// The parameters of [`Statements::insert_invoice`] on PostgreSQL.
const PG_INVOICE_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
];

/// The parameters of [`idem_consumer::INSERT_OUTBOX`].
const PG_OUTBOX_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::BYTEA, Type::INT8];

/// On PostgreSQL the request path runs on tokio-postgres, whose pipelining makes a first
/// payment three round trips (idem-store's TokioPgStore); the outbox relay, the worker's
/// inbox, the reads and the lease-mode payouts run on sqlx, through its PgStore.
impl Backend for TokioPgStore {
    shared_methods!(
        db: sqlx::Postgres,
        sql: POSTGRES,
        writer: [pg_store, pool],
        readers: [pg_store, pool],
        persistent_in_tx: false,
    );

    async fn insert_payment<'a>(
        tx: &'a mut TokioPgTx,
        account: &'a str,
        key: Option<&'a str>,
        retired_before: i64,
        payment: &'a Payment,
        event: Option<&'a idem_consumer::Message>,
    ) -> idem_store::Result<()> {
        // `execute_sql`: prepared once per connection, or unnamed behind a pooler.
        let params: [&(dyn ToSql + Sync); 8] = [
            &payment.id,
            &account,
            &key,
            &payment.amount,
            &payment.currency,
            &payment.status,
            &payment.reference,
            &payment.created_at,
        ];
        let if_key_free = POSTGRES.insert_payment_if_key_free;
        // The common case in one round trip, with the event when there is one: the key holds
        // no payment yet. (A failed INSERT would abort the transaction, hence DO NOTHING and a
        // look at the count.)
        let inserted = match event {
            None => {
                tx.execute_sql(if_key_free, PG_PAYMENT_TYPES, &params)
                    .await?
            }
            Some(event) => {
                let (id, payload) = (event.id.as_str(), &event.payload[..]);
                let event_params: [&(dyn ToSql + Sync); 4] =
                    [&id, &event.topic, &payload, &payment.created_at];
                let (inserted, enqueued) = tokio::join!(
                    tx.execute_sql(if_key_free, PG_PAYMENT_TYPES, &params),
                    tx.execute_sql(idem_consumer::INSERT_OUTBOX, PG_OUTBOX_TYPES, &event_params)
                );
                enqueued?;
                inserted?
            }
        };
        if inserted == 0 {
            // A payment holds the key. Only one made before the key's retention ended may give
            // it up; if it is younger, the plain insert below fails on the UNIQUE: the safety
            // net against a duplicate the layer let through.
            let retire_types = [Type::TEXT, Type::TEXT, Type::INT8];
            tx.execute_sql(
                POSTGRES.retire_key,
                &retire_types,
                &[&account, &key, &retired_before],
            )
            .await?;
            tx.execute_sql(POSTGRES.insert_payment, PG_PAYMENT_TYPES, &params)
                .await?;
        }
        Ok(())
    }

    async fn issue_invoice<'a>(
        tx: &'a mut TokioPgTx,
        account: &'a str,
        key: &'a str,
        invoice: &'a mut Invoice,
    ) -> idem_store::Result<()> {
        invoice.number = tx
            .query_one_sql(POSTGRES.next_invoice_number, &[Type::TEXT], &[&account])
            .await?
            .try_get(0)?;
        let params: [&(dyn ToSql + Sync); 7] = [
            &invoice.id,
            &account,
            &invoice.number,
            &invoice.amount,
            &invoice.currency,
            &key,
            &invoice.created_at,
        ];
        tx.execute_sql(POSTGRES.insert_invoice, PG_INVOICE_TYPES, &params)
            .await?;
        Ok(())
    }

    async fn open_service(url: &str) -> anyhow::Result<Self> {
        let store = TokioPgStore::connect(url)
            .await
            .with_context(|| format!("cannot open the database {}", redact(url)))?;
        let pool = store.pg_store().pool();
        idem_store::migrate_pg(
            pool,
            &service_migrations(sqlx::migrate!("migrations/postgres")),
        )
        .await
        .context("cannot migrate the payments schema")?;
        migrate_consumer(pool).await?;
        Ok(store)
    }

    async fn begin(&self) -> idem_store::Result<TokioPgTx> {
        TokioPgStore::begin(self).await
    }

    async fn commit(tx: TokioPgTx) -> idem_store::Result<()> {
        tx.commit().await
    }

    /// Relays wake-ups through `NOTIFY idem_outcome, '<key label>'`, which every instance
    /// `LISTEN`s to, so a duplicate waiting on one instance wakes when another stores the
    /// outcome: the store's own channel (as the gateway's), whose listener follows the pool
    /// to a new primary. A wake-up missed while it reconnects only makes a waiter wait out
    /// its bound and answer 409.
    async fn outcome_signal(&self) -> anyhow::Result<OutcomeSignal> {
        idem_gateway::outcome_signal(self.pg_store())
            .await
            .context("cannot LISTEN for outcome wake-ups")
    }

    fn failed(&self, e: &sqlx::Error) {
        self.pg_store().notice(e);
    }

    fn persistent(&self) -> bool {
        !self.pg_store().behind_a_pooler()
    }
}
