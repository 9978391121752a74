//! The service's own tables, per database: `idem serve` runs on SQLite or PostgreSQL with the
//! same handlers, and only the SQL differs.

use std::future::Future;

use anyhow::Context as _;
use idem_store::{AdminStore, SqliteStore, SqliteTx, TokioPgStore, TokioPgTx, TransactionalStore};
use idem_tower::OutcomeSignal;
use serde::Serialize;
use sqlx::Row;
use tokio_postgres::types::{ToSql, Type};

use crate::store_url::redact;

/// A payment as stored and as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Payment {
    pub(crate) id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reference: Option<String>,
    pub(crate) created_at: i64,
}

/// An invoice.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Invoice {
    pub(crate) id: String,
    pub(crate) number: i64,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) created_at: i64,
}

/// A receipt: the worker's side effect for one `payment.succeeded` event.
#[derive(Debug, Clone)]
pub(crate) struct Receipt {
    pub(crate) event_id: String,
    pub(crate) payment_id: String,
    pub(crate) account_id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) created_at: i64,
}

/// A record store that also holds the service's payments and invoices, its outbox, and the
/// worker's inbox and receipts.
pub(crate) trait Backend: TransactionalStore + AdminStore {
    /// The database the outbox and the inbox live in.
    type Db: idem_consumer::Database;

    /// The pool that writes (SQLite's single writer).
    fn write_pool(&self) -> &sqlx::Pool<Self::Db>;

    /// Records `receipt` through `conn` (inside the inbox's transaction).
    fn insert_receipt<'a>(
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Connects, applies the store's and the service's migrations.
    fn open_service(url: &str) -> impl Future<Output = anyhow::Result<Self>> + Send;

    /// Opens a transaction of the service's own (for requests without a key).
    fn begin(&self) -> impl Future<Output = idem_store::Result<Self::Tx>> + Send;

    /// Commits a transaction opened with [`Backend::begin`].
    fn commit(tx: Self::Tx) -> impl Future<Output = idem_store::Result<()>> + Send;

    /// Inserts `payment` in `tx`. With a key, first retires the key from a payment made before
    /// `retired_before` (a key past its retention is a new request). With an `event`, writes
    /// it to the outbox in the same transaction.
    fn insert_payment<'a>(
        tx: &'a mut Self::Tx,
        account: &'a str,
        key: Option<&'a str>,
        retired_before: i64,
        payment: &'a Payment,
        event: Option<&'a idem_consumer::Message>,
    ) -> impl Future<Output = idem_store::Result<()>> + Send + 'a;

    /// Takes the account's next invoice number and records `invoice` with it, in `tx`.
    fn issue_invoice<'a>(
        tx: &'a mut Self::Tx,
        account: &'a str,
        key: &'a str,
        invoice: &'a mut Invoice,
    ) -> impl Future<Output = idem_store::Result<()>> + Send + 'a;

    /// The account's payment `id`, if it has one.
    fn find_payment(
        &self,
        account: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<Payment>, sqlx::Error>> + Send;

    /// The account's latest payments, newest first.
    fn list_payments(
        &self,
        account: &str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Payment>, sqlx::Error>> + Send;

    /// Checks that the database answers.
    fn ping(&self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Hears of a statement the service ran itself, outside the store's own methods, that
    /// failed with `e` (so that on PostgreSQL a lost primary is looked for again).
    fn failed(&self, e: &sqlx::Error);

    /// Whether sqlx may prepare the service's statements under a name and cache them on their
    /// connection: not behind a pooler that lends sessions per transaction.
    fn persistent(&self) -> bool;

    /// The signal that wakes duplicates waiting for an outcome, relayed between every process
    /// on this database where the database can relay.
    fn outcome_signal(&self) -> impl Future<Output = anyhow::Result<OutcomeSignal>> + Send;
}

fn payment_from_row<R: Row>(row: &R) -> Result<Payment, sqlx::Error>
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
struct Statements {
    insert_receipt: &'static str,
    /// The payment, or nothing when a payment holds its key already.
    insert_payment_if_key_free: &'static str,
    /// The payment; fails on the UNIQUE when a payment holds its key.
    insert_payment: &'static str,
    /// Takes the key away from a payment made before the key's retention ended.
    retire_key: &'static str,
    next_invoice_number: &'static str,
    insert_invoice: &'static str,
    find_payment: &'static str,
    list_payments: &'static str,
}

/// The clause that turns a payment's insert into nothing when a payment holds its key.
macro_rules! if_key_free {
    () => {
        " ON CONFLICT (account_id, idem_key) DO NOTHING"
    };
}

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

macro_rules! pg_insert_payment {
    () => {
        "INSERT INTO payments
             (id, account_id, idem_key, amount, currency, status, reference, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7,
                 to_timestamp($8 / 1000) + ($8 % 1000) * interval '1 millisecond')"
    };
}

macro_rules! pg_select_payment {
    () => {
        "SELECT id, amount, currency, status, reference,
                (extract(epoch FROM created_at) * 1000)::bigint AS created_at
         FROM payments"
    };
}

const POSTGRES: Statements = Statements {
    insert_receipt:
        "INSERT INTO receipts (event_id, payment_id, account_id, amount, currency, created_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    insert_payment_if_key_free: concat!(pg_insert_payment!(), if_key_free!()),
    insert_payment: pg_insert_payment!(),
    retire_key: "UPDATE payments SET retired_idem_key = idem_key, idem_key = NULL
         WHERE account_id = $1 AND idem_key = $2
           AND created_at <= to_timestamp($3 / 1000) + ($3 % 1000) * interval '1 millisecond'",
    // The counter row's lock orders concurrent invoices of one account; it is held until the
    // request's transaction ends, so numbers are issued in commit order, without gaps.
    next_invoice_number:
        "INSERT INTO invoice_counters AS c (account_id, last_number) VALUES ($1, 1)
         ON CONFLICT (account_id) DO UPDATE SET last_number = c.last_number + 1
         RETURNING last_number",
    insert_invoice:
        "INSERT INTO invoices (id, account_id, number, amount, currency, idem_key, created_at)
         VALUES ($1, $2, $3, $4, $5, $6,
                 to_timestamp($7 / 1000) + ($7 % 1000) * interval '1 millisecond')",
    find_payment: concat!(pg_select_payment!(), " WHERE id = $1 AND account_id = $2"),
    list_payments: concat!(
        pg_select_payment!(),
        " WHERE account_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
    ),
};

/// The [`Backend`] items that are the same code on both databases, written once: `$sql`
/// holds the database's statements, `$writer` and `$readers` name the store's sqlx pools.
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

/// The service's own migrations, with their own history table.
fn service_migrations(mut migrator: sqlx::migrate::Migrator) -> sqlx::migrate::Migrator {
    migrator.dangerous_set_table_name("idem_serve_migrations");
    migrator
}

/// Applies the outbox's and inbox's migrations (after the service's own).
async fn migrate_consumer<DB: idem_consumer::Database>(
    pool: &sqlx::Pool<DB>,
) -> anyhow::Result<()> {
    DB::migrate(pool)
        .await
        .context("cannot migrate the outbox and inbox schema")
}

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
