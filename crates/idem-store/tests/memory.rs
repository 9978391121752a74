//! The conformance suite against [`MemoryStore`], each test on a store of its own.

use idem_store::{MemoryStore, admin_conformance, store_conformance, table_events_conformance};

async fn fresh_store() -> (MemoryStore, ()) {
    (MemoryStore::new(), ())
}

store_conformance!(fresh_store());
admin_conformance!(fresh_store());
table_events_conformance!(fresh_store());
