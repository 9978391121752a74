//! The service's own tables, per database: `idem serve` runs on SQLite or PostgreSQL with the
//! same handlers, and only the SQL differs.
//!
//! [`Backend`] is what the handlers ask of a database; [`model`] holds what they store;
//! [`shared`] the code both databases run alike; [`sqlite`] and [`postgres`] their statements
//! and what only one of them does.

use std::future::Future;

use idem_store::{AdminStore, TransactionalStore};
use idem_tower::OutcomeSignal;

mod model;
mod postgres;
mod shared;
mod sqlite;

pub(crate) use model::{Invoice, Payment, Receipt};

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
