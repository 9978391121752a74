//! The conformance suite against [`SqliteStore`], each test on its own database file.

use idem_store::{SqliteStore, admin_conformance, store_conformance, transactional_conformance};

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
