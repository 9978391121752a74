//! Every error of the store, the consumer and this binary names its own layer only and hands
//! its cause on through `source()`, so that a chain printed whole ([`idem_core::ErrorChain`],
//! as `main` prints it) shows each cause once.

use std::error::Error;

use idem_consumer::{BrokerError, EventId, HandlerError, ProcessError, RelayError};
use idem_store::{MigrationError, PgUrlError};

/// The innermost cause of every error below.
const CAUSE: &str = "connection reset by the test";

fn leaf() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionReset, CAUSE)
}

/// Walks `e`'s first `ours` layers (the errors of idem's crates; past them come the drivers'
/// own, which may repeat their cause), asserting that none repeats its cause's text, and then
/// that the whole chain, printed as `main` prints it, holds the innermost cause once.
#[track_caller]
fn check(e: &(dyn Error + 'static), ours: usize) {
    let mut layer = Some(e);
    for _ in 0..ours {
        let current = layer.expect("as many layers as claimed");
        let cause = current
            .source()
            .unwrap_or_else(|| panic!("{current} has a cause"));
        assert!(
            !current.to_string().contains(&cause.to_string()),
            "{current:?} repeats its cause {cause}"
        );
        layer = Some(cause);
    }
    let printed = idem_core::ErrorChain(e).to_string();
    assert_eq!(printed.matches(CAUSE).count(), 1, "{printed}");
}

fn sqlx_error() -> sqlx::Error {
    sqlx::Error::Io(leaf())
}

#[test]
fn store_errors_name_their_own_layer() {
    check(&idem_store::Error::Unavailable(Box::new(leaf())), 1);
    check(&idem_store::Error::Database(sqlx_error()), 1);
    check(&idem_store::Error::from(sqlx_error()), 1);
    check(
        &idem_store::Error::PgMigrate(MigrationError::Migration {
            version: 1,
            description: "idempotency keys".into(),
            source: sqlx_error(),
        }),
        2,
    );
    check(
        &idem_store::Error::PgMigrate(MigrationError::Database(sqlx_error())),
        2,
    );
    check(
        &idem_store::Error::Url(PgUrlError::Options(sqlx::Error::Configuration(Box::new(
            leaf(),
        )))),
        2,
    );
}

#[test]
fn consumer_errors_name_their_own_layer() {
    let event = EventId::new("evt_1").unwrap();
    check(
        &ProcessError::<std::io::Error>::Database {
            event: event.clone(),
            source: sqlx_error(),
        },
        1,
    );
    check(
        &ProcessError::Handler {
            event,
            source: leaf(),
        },
        1,
    );
    check(&RelayError::Database(sqlx_error()), 1);
    let broker = || BrokerError::new("nats", "publishing evt_1 to payments", leaf());
    check(&broker(), 1);
    check(&RelayError::Broker(broker()), 2);
    check(&HandlerError::Transient(Box::new(leaf())), 1);
}

/// The binary's own layers are anyhow contexts: each a message of its own over the store's or
/// the consumer's error.
#[test]
fn the_binary_s_contexts_name_their_own_layer() {
    use anyhow::Context as _;
    let failed: Result<(), idem_store::Error> = Err(idem_store::Error::PgMigrate(
        MigrationError::Database(sqlx_error()),
    ));
    let e = failed
        .context("cannot migrate the payments schema")
        .unwrap_err();
    let e: &(dyn Error + 'static) = e.as_ref();
    check(e, 3);
}
