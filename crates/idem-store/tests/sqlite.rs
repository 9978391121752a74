//! The conformance suite against [`SqliteStore`], each test on its own database file.

#![cfg(feature = "sqlite")]

use idem_store::{
    SqliteStore, admin_conformance, store_conformance, table_events_conformance,
    transactional_conformance,
};

async fn fresh_store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("idem.db"))
        .await
        .expect("open store");
    (store, dir)
}

store_conformance!(fresh_store());
transactional_conformance!(fresh_store());
admin_conformance!(fresh_store());
table_events_conformance!(fresh_store());

// The group commit: requests waiting for the writer share one transaction and one commit, and
// each hears of its commit only once it happened.

use std::time::Duration;

use idem_core::{
    AccountId, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RecordState,
    RequestParts, Scope, StoredResponse, Timestamp,
};
use idem_store::{NewClaim, SqliteTx, TransactionalStore, TxClaim};

async fn store_with_items() -> (SqliteStore, tempfile::TempDir) {
    let (store, dir) = fresh_store().await;
    sqlx::query("CREATE TABLE items (name TEXT NOT NULL)")
        .execute(store.writer())
        .await
        .unwrap();
    (store, dir)
}

async fn insert(tx: &mut SqliteTx, name: &str) {
    sqlx::query("INSERT INTO items (name) VALUES (?1)")
        .bind(name)
        .execute(&mut **tx)
        .await
        .unwrap();
}

/// A turn at the writer that has inserted `name`: the writer is held until it ends.
async fn turn_with(store: &SqliteStore, name: &str) -> SqliteTx {
    let mut tx = store.begin().await.unwrap();
    insert(&mut tx, name).await;
    tx
}

/// What a reader (another connection) sees: only committed rows.
async fn committed(store: &SqliteStore) -> Vec<String> {
    sqlx::query_scalar("SELECT name FROM items ORDER BY name")
        .fetch_all(store.readers())
        .await
        .unwrap()
}

/// Polls `future` once, so that it takes its place in the writer's queue, and hands it back.
async fn queued<F: Future + Unpin>(mut future: F) -> F {
    assert!(
        tokio::time::timeout(Duration::ZERO, &mut future)
            .await
            .is_err(),
        "the writer is held, so this waits for its turn"
    );
    future
}

/// Whether `future` is still waiting after a moment.
async fn still_waiting<F: Future + Unpin>(future: &mut F) -> bool {
    tokio::time::timeout(Duration::from_millis(50), future)
        .await
        .is_err()
}

#[tokio::test]
async fn a_request_hears_of_its_commit_only_when_its_whole_group_commits() {
    let (store, _dir) = store_with_items().await;
    let first = turn_with(&store, "first").await;
    let second = queued(Box::pin(store.begin())).await;

    // The first request is done, but the second was waiting: they share the commit.
    let mut first_commit = tokio::spawn(first.commit());
    let mut second = second.await.unwrap();
    insert(&mut second, "second").await;
    assert!(
        still_waiting(&mut first_commit).await,
        "the first request's commit is not acknowledged while its group is open"
    );
    assert!(committed(&store).await.is_empty(), "nothing is visible yet");

    second.commit().await.unwrap();
    first_commit.await.unwrap().unwrap();
    assert_eq!(committed(&store).await, ["first", "second"]);
}

#[tokio::test]
async fn a_rolled_back_or_dropped_turn_undoes_only_its_own_writes() {
    let (store, _dir) = store_with_items().await;
    let kept = turn_with(&store, "kept").await;
    let rolled_back = queued(Box::pin(store.begin())).await;
    let dropped = queued(Box::pin(store.begin())).await;
    let also_kept = queued(Box::pin(store.begin())).await;

    let kept_commit = tokio::spawn(kept.commit());
    let mut rolled_back = rolled_back.await.unwrap();
    insert(&mut rolled_back, "rolled back").await;
    rolled_back.rollback().await.unwrap();
    let mut dropped = dropped.await.unwrap();
    insert(&mut dropped, "dropped").await;
    drop(dropped); // a cancelled request
    let mut also_kept = also_kept.await.unwrap();
    insert(&mut also_kept, "also kept").await;
    also_kept.commit().await.unwrap();
    kept_commit.await.unwrap().unwrap();

    assert_eq!(committed(&store).await, ["also kept", "kept"]);
}

fn claim_of(key: &str, token: i64) -> NewClaim {
    let scope = Scope::new(
        AccountId::new("acct_1"),
        IdempotencyKey::parse(key.as_bytes(), KeyLimits::default()).unwrap(),
    );
    let fingerprint = Fingerprint::compute(&RequestParts {
        account: "acct_1",
        method: "POST",
        route: "/items",
        query: "",
        content_type: "application/json",
        body: b"{}",
    })
    .unwrap();
    NewClaim::new(
        scope,
        fingerprint,
        FencingToken(token),
        Timestamp(1_700_000_000_000),
        &Policy::default(),
    )
}

#[tokio::test]
async fn a_duplicate_is_not_answered_with_a_record_before_the_record_commits() {
    let (store, _dir) = store_with_items().await;
    let wait = Duration::from_secs(5);
    let claim = claim_of("group-key-1", 1);
    let TxClaim::Claimed(mut original) = store.begin_claim(&claim, wait).await.unwrap() else {
        panic!("a free key is claimed");
    };
    insert(&mut original, "original").await;
    let (store_1, retry) = (store.clone(), claim_of("group-key-1", 2));
    let duplicate = queued(Box::pin(
        async move { store_1.begin_claim(&retry, wait).await },
    ))
    .await;
    // Driven on its own, as a concurrent request is.
    let mut duplicate = tokio::spawn(duplicate);
    let holder = queued(Box::pin(store.begin())).await;

    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"{\"id\":1}".to_vec(),
        body_omitted: false,
    };
    let (store_2, scope) = (store.clone(), claim.scope.clone());
    let original_commit = tokio::spawn(async move {
        store_2
            .commit_response(original, &scope, FencingToken(1), &response)
            .await
    });
    // The duplicate reads the completed record in the open group, then waits for its commit
    // while a later request holds the writer.
    let mut holder = holder.await.unwrap();
    assert!(
        still_waiting(&mut duplicate).await,
        "the duplicate waits for the record's commit"
    );
    insert(&mut holder, "holder").await;
    holder.commit().await.unwrap();

    let TxClaim::Existing(record) = duplicate.await.unwrap().unwrap() else {
        panic!("the duplicate finds the original's record");
    };
    assert!(matches!(record.state, RecordState::Completed(ref r) if r.status == 201));
    original_commit.await.unwrap().unwrap();
    assert_eq!(committed(&store).await, ["holder", "original"]);
}
