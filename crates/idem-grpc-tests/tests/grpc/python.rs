//! Python's grpcio (PyPI), with its own retry policy (a service config `retryPolicy` for
//! `UNAVAILABLE` and `ABORTED`, `grpc.enable_retries`), sending each key from several threads
//! at once: one payment per key. The client is scripts/grpc_python.py, through
//! `idem_testkit::grpcio`.

use idem_testkit::grpcio::{assert_one_payment_per_key, grpcio};

use crate::Server;

/// Lease mode: a copy that finds its key in use gets `ABORTED` with a pushback, and grpcio's
/// retry comes back for the replay. `flaky` keys fail `UNAVAILABLE` on their first run, which is
/// not stored, so grpcio's retry runs them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpcio_retries_through_the_lease_layer_make_one_payment_per_key() {
    let server = Server::leased(|l| l).await;
    let target = server.addr.to_string();
    let results = grpcio(
        &target,
        &["--keys", "20", "--copies", "4", "--prefix", "py-lease"],
    )
    .await;
    for key in assert_one_payment_per_key("grpcio, lease mode", &results) {
        assert_eq!(server.payments.made(Some(&key)), 1, "{key}");
    }

    let flaky = grpcio(
        &target,
        &[
            "--keys", "10", "--copies", "3", "--script", "flaky", "--prefix", "py-flaky",
        ],
    )
    .await;
    for key in assert_one_payment_per_key("grpcio, lease mode, flaky", &flaky) {
        assert_eq!(server.payments.made(Some(&key)), 1, "{key}");
        assert_eq!(
            server.payments.runs(Some(&key)),
            2,
            "{key}: the UNAVAILABLE run was not stored"
        );
    }
}

/// Transaction mode: copies wait for the first's commit and replay it; one row per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpcio_through_the_transaction_layer_makes_one_row_per_key() {
    let server = Server::transactional(|l| l).await;
    let results = grpcio(
        &server.addr.to_string(),
        &["--keys", "20", "--copies", "4", "--prefix", "py-tx"],
    )
    .await;
    for key in assert_one_payment_per_key("grpcio, transaction mode", &results) {
        assert_eq!(server.rows(&key).await, 1, "{key}");
    }
}
