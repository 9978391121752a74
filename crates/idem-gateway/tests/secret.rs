//! Where the gateway's secret lives (docs/contract.md §12): in the store, made once by
//! whichever gateway starts first and read by the others, so gateways on one store derive the
//! same scope from the same credential; an earlier version's secret file moves into a store
//! that has none. For each store.

mod common;

use futures_util::future::join_all;
use idem_gateway::{SCOPE_SECRET, Secret, SecretOrigin};
use idem_store::{SharedSecret, Store};

/// A path where no secret file is.
fn no_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    dir.path().join("idem-proxy.secret")
}

/// Eight gateways start at once on an empty store: one makes the secret, the seven others
/// read that one, and all derive the same scopes.
async fn gateways_starting_together_share_one_secret<St: Store + SharedSecret>(store: St) {
    let dir = tempfile::tempdir().unwrap();
    let path = no_file(&dir);
    let started = join_all((0..8).map(|_| Secret::shared(&store, &path))).await;
    let started: Vec<(Secret, SecretOrigin)> = started.into_iter().map(Result::unwrap).collect();
    let created = started
        .iter()
        .filter(|(_, origin)| *origin == SecretOrigin::Created)
        .count();
    assert_eq!(
        created,
        1,
        "{:?}",
        started.iter().map(|s| &s.1).collect::<Vec<_>>()
    );
    let id = started[0].0.id();
    assert!(started.iter().all(|(secret, _)| secret.id() == id));
    // A later start reads it too; no file was made.
    let (later, origin) = Secret::shared(&store, &path).await.unwrap();
    assert_eq!((later.id(), origin), (id, SecretOrigin::Store));
    assert!(!path.exists());
}

/// An existing deployment's `idem-proxy.secret` goes into a store that has none, so the keys
/// stored under it keep their scopes; once there, the store's is every gateway's. A gateway
/// whose file holds another secret (each instance made its own before) takes the store's and
/// says so.
async fn an_existing_secret_file_moves_into_the_store_and_the_store_wins_after<
    St: Store + SharedSecret,
>(
    store: St,
) {
    let dir = tempfile::tempdir().unwrap();
    let legacy = dir.path().join("idem-proxy.secret");
    std::fs::write(&legacy, "3b1f0c7a9d2e4f6a8b0c1d2e3f4a5b6c\n").unwrap();
    let from_file = Secret::new(b"3b1f0c7a9d2e4f6a8b0c1d2e3f4a5b6c".to_vec()).unwrap();

    let (first, origin) = Secret::shared(&store, &legacy).await.unwrap();
    assert_eq!(origin, SecretOrigin::File(legacy.clone()));
    assert_eq!(first.id(), from_file.id(), "the file's scopes are kept");
    assert_eq!(
        store.read_secret(SCOPE_SECRET).await.unwrap().as_deref(),
        Some("3b1f0c7a9d2e4f6a8b0c1d2e3f4a5b6c")
    );
    // The file is left as it was.
    assert!(legacy.exists());

    let (again, origin) = Secret::shared(&store, &legacy).await.unwrap();
    assert_eq!((again.id(), origin), (first.id(), SecretOrigin::Store));
    let (without, origin) = Secret::shared(&store, &no_file(&tempfile::tempdir().unwrap()))
        .await
        .unwrap();
    assert_eq!((without.id(), origin), (first.id(), SecretOrigin::Store));

    let other_dir = tempfile::tempdir().unwrap();
    let other = other_dir.path().join("idem-proxy.secret");
    std::fs::write(&other, "another-instances-own-secret-0001").unwrap();
    let (store_wins, origin) = Secret::shared(&store, &other).await.unwrap();
    assert_eq!(origin, SecretOrigin::StoreOverFile(other));
    assert_eq!(store_wins.id(), first.id());
}

/// A secret given explicitly is not stored; a gateway can tell whether the store's differs.
async fn a_given_secret_is_compared_with_the_stores_but_not_stored<St: Store + SharedSecret>(
    store: St,
) {
    let given = b"an-explicit-secret-of-enough-bytes";
    assert!(!Secret::differs_from_store(&store, given).await.unwrap());
    assert_eq!(store.read_secret(SCOPE_SECRET).await.unwrap(), None);
    let dir = tempfile::tempdir().unwrap();
    let (shared, _) = Secret::shared(&store, &no_file(&dir)).await.unwrap();
    assert!(Secret::differs_from_store(&store, given).await.unwrap());
    let stored = store.read_secret(SCOPE_SECRET).await.unwrap().unwrap();
    assert!(
        !Secret::differs_from_store(&store, stored.as_bytes())
            .await
            .unwrap()
    );
    assert_eq!(Secret::new(stored.into_bytes()).unwrap().id(), shared.id());
}

on_every_store!(
    gateways_starting_together_share_one_secret,
    an_existing_secret_file_moves_into_the_store_and_the_store_wins_after,
    a_given_secret_is_compared_with_the_stores_but_not_stored,
);
