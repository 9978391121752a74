//! The layer on `tonic::transport::Server::builder().layer(..)`, called by tonic's client.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use idem_core::{AccountId, GrpcCode, ProblemKind};
use idem_grpc_tests::pb::WatchPaymentsRequest;
use idem_grpc_tests::{CREATE_PAYMENT, WATCH_PAYMENTS};
use idem_tower::Unidentified;
use tonic::Code;

use crate::{Server, call, code, create, replayed, tonic_code};

#[tokio::test]
async fn a_call_runs_once_and_its_replay_has_the_message_trailers_and_the_mark() {
    let server = Server::leased(|l| l).await;
    let mut client = server.client().await;
    let (first, first_meta) = call(&mut client, create(Some("key-first-1"), 4990, ""))
        .await
        .unwrap();
    assert!(!replayed(&first_meta));
    assert_eq!(first_meta.get("x-ledger-entry").unwrap(), "led_42");
    let (again, again_meta) = call(&mut client, create(Some("key-first-1"), 4990, ""))
        .await
        .unwrap();
    assert_eq!(again, first, "the stored message");
    assert!(replayed(&again_meta));
    assert_eq!(
        again_meta.get("x-ledger-entry").unwrap(),
        "led_42",
        "the custom trailer is replayed with the status"
    );
    assert_eq!(server.payments.runs(Some("key-first-1")), 1);

    // The record keeps the status and the custom trailer among its fields.
    use idem_store::Store;
    let scope = idem_core::Scope::new(
        AccountId::new(crate::ACCOUNT),
        idem_core::IdempotencyKey::new("key-first-1", Default::default()).unwrap(),
    );
    let now = idem_core::Clock::now(&idem_core::SystemClock);
    let record = server.store.get(&scope, now).await.unwrap().unwrap();
    let idem_core::RecordState::Completed(stored) = record.state else {
        panic!("completed");
    };
    let trailers: Vec<_> = stored.trailers().collect();
    assert!(trailers.contains(&("grpc-status", "0")), "{trailers:?}");
    assert!(
        trailers.contains(&("x-ledger-entry", "led_42")),
        "{trailers:?}"
    );
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_failed_precondition() {
    let server = Server::leased(|l| l).await;
    let mut client = server.client().await;
    call(&mut client, create(Some("key-reused-1"), 100, ""))
        .await
        .unwrap();
    let other = call(&mut client, create(Some("key-reused-1"), 200, "")).await;
    let status = other.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().starts_with("urn:idem:problem:mismatch"),
        "{}",
        status.message()
    );
    assert_eq!(server.payments.runs(None), 1);
}

/// Eight copies of one call at once, the first held in its handler: lease mode answers the
/// other seven `ABORTED` with a pushback at once, and once the first has ended their retries
/// replay it. One payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_in_lease_mode_make_one_payment() {
    let server = Server::leased(|l| l).await;
    let client = server.client().await;
    let key = "key-concurrent-lease";
    let mut copies: FuturesUnordered<_> = (0..8)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { call(&mut client, create(Some(key), 700, "hold")).await })
        })
        .collect();
    server.payments.entered().await;
    for _ in 0..7 {
        let status = copies.next().await.unwrap().unwrap().unwrap_err();
        assert_eq!(status.code(), Code::Aborted, "{status:?}");
        assert_eq!(
            status.metadata().get("grpc-retry-pushback-ms").unwrap(),
            "1000"
        );
    }
    server.payments.release(1);
    let (first, _) = copies.next().await.unwrap().unwrap().unwrap();
    let mut client = client.clone();
    for _ in 0..7 {
        let (retry, metadata) = call(&mut client, create(Some(key), 700, "hold"))
            .await
            .unwrap();
        assert_eq!(retry, first);
        assert!(replayed(&metadata));
    }
    assert_eq!(server.payments.runs(Some(key)), 1);
    assert_eq!(server.payments.made(Some(key)), 1);
}

/// idem's own refusals reach a gRPC client as statuses (trailers-only responses), never as
/// problem-details bodies it cannot read.
#[tokio::test]
async fn refusals_are_grpc_statuses() {
    let server = Server::leased(|l| l.with_grpc_key_required([CREATE_PAYMENT])).await;
    let mut client = server.client().await;
    let missing = call(&mut client, create(None, 100, "")).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(
        missing
            .message()
            .starts_with("urn:idem:problem:missing-key")
    );
    let malformed = call(&mut client, create(Some("short"), 100, ""))
        .await
        .unwrap_err();
    assert_eq!(malformed.code(), Code::InvalidArgument);
    assert!(
        malformed
            .message()
            .starts_with("urn:idem:problem:malformed-key")
    );

    let mut anonymous = create(Some("key-no-account"), 100, "");
    anonymous.metadata_mut().remove("authorization");
    let no_account = call(&mut client, anonymous).await.unwrap_err();
    assert_eq!(no_account.code(), Code::Internal);
    assert!(
        no_account
            .message()
            .starts_with("urn:idem:problem:no-account")
    );

    let panicked = call(&mut client, create(Some("key-panics-1"), 100, "panic"))
        .await
        .unwrap_err();
    assert_eq!(panicked.code(), Code::Internal);
    assert!(
        panicked
            .message()
            .starts_with("urn:idem:problem:handler-failed")
    );
    assert_eq!(server.payments.runs(None), 1, "only the panicking call ran");

    // The store gone: nothing runs without its key record.
    server.store.writer().close().await;
    let down = call(&mut client, create(Some("key-store-down"), 100, ""))
        .await
        .unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert!(
        down.message()
            .starts_with("urn:idem:problem:store-unavailable")
    );
    assert_eq!(
        down.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "1000"
    );
    assert_eq!(server.payments.runs(None), 1);

    // Each kind's status is the one the contract names.
    for (kind, expected) in [
        (ProblemKind::MissingKey, GrpcCode::InvalidArgument),
        (ProblemKind::Mismatch, GrpcCode::FailedPrecondition),
        (ProblemKind::InUse, GrpcCode::Aborted),
        (ProblemKind::StoreUnavailable, GrpcCode::Unavailable),
        (ProblemKind::NoCredential, GrpcCode::Unauthenticated),
        (ProblemKind::NoAccount, GrpcCode::Internal),
        (ProblemKind::HandlerFailed, GrpcCode::Internal),
    ] {
        assert_eq!(kind.grpc_code(), expected, "{kind:?}");
    }
}

#[tokio::test]
async fn a_call_without_its_credential_is_unauthenticated() {
    let server = Server::leased(|l| {
        l.with_account(|parts| match parts.headers.get("authorization") {
            Some(token) => Ok(AccountId::new(token.to_str().unwrap_or("?"))),
            None => Err(Unidentified::NoCredential(
                "send authorization: Bearer <token>".into(),
            )),
        })
    })
    .await;
    let mut client = server.client().await;
    let mut request = create(Some("key-no-credential"), 100, "");
    request.metadata_mut().remove("authorization");
    let status = call(&mut client, request).await.unwrap_err();
    assert_eq!(status.code(), tonic_code(GrpcCode::Unauthenticated));
    assert!(
        status.message().contains("send authorization"),
        "{status:?}"
    );
    assert_eq!(server.payments.runs(None), 0);
}

#[tokio::test]
async fn a_call_without_a_key_passes_through_unless_its_method_requires_one() {
    let server = Server::leased(|l| l).await;
    let mut client = server.client().await;
    for _ in 0..2 {
        let (_, metadata) = call(&mut client, create(None, 100, "")).await.unwrap();
        assert!(!replayed(&metadata));
    }
    assert_eq!(
        server.payments.runs(None),
        2,
        "keyless calls run unprotected"
    );
}

/// A business error is a result: stored with its message, details and custom metadata, and
/// replayed without running again.
#[tokio::test]
async fn a_business_error_status_is_stored_and_replayed() {
    let server = Server::leased(|l| l).await;
    let mut client = server.client().await;
    let first = call(&mut client, create(Some("key-declined-1"), 100, "decline"))
        .await
        .unwrap_err();
    let again = call(&mut client, create(Some("key-declined-1"), 100, "decline"))
        .await
        .unwrap_err();
    for status in [&first, &again] {
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(status.message(), "card declined");
        assert_eq!(status.details(), b"declined: insufficient funds");
        assert_eq!(
            status.metadata().get("x-decline-code").unwrap(),
            "insufficient_funds"
        );
    }
    assert!(!replayed(first.metadata()));
    assert!(replayed(again.metadata()));
    assert_eq!(server.payments.runs(Some("key-declined-1")), 1);
}

/// A transient status is not stored: the retry runs again, and succeeds.
#[tokio::test]
async fn a_transient_status_is_not_stored() {
    let server = Server::leased(|l| l).await;
    let mut client = server.client().await;
    for _ in 0..2 {
        let answer = call(
            &mut client,
            create(Some("key-transient"), 100, "unavailable"),
        )
        .await;
        assert_eq!(code(&answer), Code::Unavailable);
    }
    assert_eq!(server.payments.runs(Some("key-transient")), 2);

    let first = call(&mut client, create(Some("key-flaky-01"), 100, "flaky")).await;
    assert_eq!(code(&first), Code::Unavailable);
    let (payment, metadata) = call(&mut client, create(Some("key-flaky-01"), 100, "flaky"))
        .await
        .unwrap();
    assert!(!replayed(&metadata));
    assert_eq!(payment.attempt, 2);
    assert_eq!(server.payments.made(Some("key-flaky-01")), 1);
}

/// A streaming method named as such is untouched, key or not: its events arrive as they are
/// sent (the first while the rest are held), and a second call with the same key runs again.
#[tokio::test]
async fn a_streaming_method_is_untouched() {
    let server = Server::leased(|l| l.with_grpc_streaming([WATCH_PAYMENTS])).await;
    let mut client = server.client().await;
    for _ in 0..2 {
        let mut request = tonic::Request::new(WatchPaymentsRequest { count: 3 });
        request
            .metadata_mut()
            .insert("idempotency-key", "key-stream-1".parse().unwrap());
        request
            .metadata_mut()
            .insert("authorization", "Bearer acct_alice".parse().unwrap());
        let response = client.watch_payments(request).await.unwrap();
        assert!(!replayed(response.metadata()));
        let mut events = response.into_inner();
        let first = events.next().await.unwrap().unwrap();
        assert_eq!(
            first.id, "evt_1",
            "the first event comes before the stream ends"
        );
        server.payments.release_streams(1);
        let rest: Vec<_> = events.map(|e| e.unwrap().id).collect().await;
        assert_eq!(rest, ["evt_2", "evt_3"]);
    }
}

/// Transaction mode from a tonic handler: it takes the layer's transaction from the request's
/// extensions, so its payment row commits with the key, and an `INTERNAL` rolls both back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_mode_reaches_the_transaction_from_a_tonic_handler() {
    let server = Server::transactional(|l| l).await;
    let mut client = server.client().await;
    let (first, _) = call(&mut client, create(Some("key-tx-0001"), 100, ""))
        .await
        .unwrap();
    let (again, metadata) = call(&mut client, create(Some("key-tx-0001"), 100, ""))
        .await
        .unwrap();
    assert_eq!(again, first);
    assert!(replayed(&metadata));
    assert_eq!(server.rows("key-tx-0001").await, 1);

    // INTERNAL after the write: the 5xx rule of transaction mode rolls the row back with the
    // key, and the retry runs fresh.
    let failed = call(&mut client, create(Some("key-tx-0002"), 100, "internal")).await;
    assert_eq!(code(&failed), Code::Internal);
    assert_eq!(server.rows("key-tx-0002").await, 0);
    let (retried, _) = call(&mut client, create(Some("key-tx-0002"), 100, ""))
        .await
        .unwrap();
    assert_eq!(retried.attempt, 2);
    assert_eq!(server.rows("key-tx-0002").await, 1);

    // Concurrent copies: the others wait for the first's commit, then replay it.
    let copies: Vec<_> = (0..6)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                call(&mut client, create(Some("key-tx-0003"), 300, "hold")).await
            })
        })
        .collect();
    server.payments.entered().await;
    server.payments.release(1);
    let mut ids = Vec::new();
    for copy in copies {
        let (payment, _) = copy.await.unwrap().unwrap();
        ids.push(payment.id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(server.rows("key-tx-0003").await, 1);
    assert_eq!(server.payments.runs(Some("key-tx-0003")), 1);
}

/// Each gRPC call runs in the layer's `idempotency` span (docs/contract.md §15), as an HTTP
/// request does: `protocol` `grpc`, the outcome, the mode and the key's hash, never the key.
/// The test runs on one thread, where its subscriber is the default, server and client alike.
#[tokio::test(flavor = "current_thread")]
async fn a_call_s_span_records_its_outcome_and_protocol() {
    let spans = spans::Recorder::default();
    let _default = spans.install();
    let server = Server::leased(|l| l).await;
    let mut client = server.client().await;
    for _ in 0..2 {
        call(&mut client, create(Some("key-span-1"), 100, ""))
            .await
            .unwrap();
    }
    let refused = call(&mut client, create(Some("key-span-1"), 200, "")).await;
    assert_eq!(refused.unwrap_err().code(), Code::FailedPrecondition);
    // A call the app's authentication found no account for: a service wired wrong.
    let mut anonymous = create(Some("key-span-2"), 100, "");
    anonymous.metadata_mut().remove("authorization");
    let unscoped = call(&mut client, anonymous).await;
    assert_eq!(unscoped.unwrap_err().code(), Code::Internal);
    // A span closes when the server drops the call's future, which may come after the
    // client has its answer.
    let recorded = spans.closed(4).await;
    let mut outcomes: Vec<_> = recorded
        .iter()
        .map(|s| s["idempotency.outcome"].as_str())
        .collect();
    outcomes.sort_unstable();
    assert_eq!(outcomes, ["fresh", "mismatch", "no_account", "replayed"]);
    let (unscoped, scoped): (Vec<_>, Vec<_>) = recorded
        .iter()
        .partition(|s| s["idempotency.outcome"] == "no_account");
    assert!(
        !unscoped[0].contains_key("idempotency.key_hash"),
        "no account, no scope to hash"
    );
    let recorded = scoped;
    for span in &recorded {
        assert_eq!(span["idempotency.protocol"], "grpc");
        assert_eq!(span["idempotency.mode"], "lease");
        assert_eq!(
            span["idempotency.key_hash"],
            recorded[0]["idempotency.key_hash"]
        );
        assert!(!span["idempotency.key_hash"].contains("key-span"));
    }
}

mod spans {
    //! A `tracing` layer that keeps the fields of each `idempotency` span.

    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing_subscriber::layer::{Context, SubscriberExt};

    type Fields = BTreeMap<String, String>;

    /// The spans still open (the registry reuses a closed span's id) and those closed.
    #[derive(Default)]
    struct Spans {
        open: Vec<(Id, Fields)>,
        closed: Vec<Fields>,
    }

    #[derive(Clone, Default)]
    pub(crate) struct Recorder(Arc<Mutex<Spans>>);

    impl Recorder {
        /// Makes this the current thread's subscriber until the guard drops.
        pub(crate) fn install(&self) -> tracing::subscriber::DefaultGuard {
            let subscriber = tracing_subscriber::registry().with(self.clone());
            tracing::subscriber::set_default(subscriber)
        }

        /// The fields of the first `n` `idempotency` spans to close, once they have (within
        /// 10 s).
        pub(crate) async fn closed(&self, n: usize) -> Vec<Fields> {
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let closed = self.0.lock().unwrap().closed.clone();
                if closed.len() >= n {
                    return closed;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{} of {n} spans closed: {closed:?}",
                    closed.len()
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }

    struct Text<'a>(&'a mut Fields);

    impl Visit for Text<'_> {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.0.insert(field.name().to_owned(), value.to_owned());
        }

        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.0.insert(field.name().to_owned(), format!("{value:?}"));
        }
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Recorder {
        fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
            if attributes.metadata().name() == "idempotency" {
                let mut fields = Fields::new();
                attributes.record(&mut Text(&mut fields));
                self.0.lock().unwrap().open.push((id.clone(), fields));
            }
        }

        fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
            let mut spans = self.0.lock().unwrap();
            if let Some((_, fields)) = spans.open.iter_mut().find(|(known, _)| known == id) {
                values.record(&mut Text(fields));
            }
        }

        fn on_close(&self, id: Id, _: Context<'_, S>) {
            let mut spans = self.0.lock().unwrap();
            if let Some(at) = spans.open.iter().position(|(known, _)| *known == id) {
                let (_, fields) = spans.open.remove(at);
                spans.closed.push(fields);
            }
        }
    }
}
