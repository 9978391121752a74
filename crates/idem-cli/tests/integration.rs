//! idem-cli's integration tests, one binary: each file in this folder is a module (ripgrep's
//! layout), so a change links once instead of once per file. Name tests by module in nextest
//! filters: `test(/^payouts::/)`.

mod common;

mod admin_api;
mod admin_console;
mod bad_input;
mod binary;
mod chaos;
mod concurrency;
mod contract;
mod drill;
mod gateway_chaos;
mod keys_redis;
mod keys_resolve;
mod openapi;
mod outbox;
mod payouts;
mod pgbouncer;
mod postgres_cluster;
mod postgres_failover;
mod proxy_binary;
mod proxy_cluster;
mod proxy_config;
mod proxy_instances;
mod simulate;
mod simulate_url;
mod sqlite_crash;
mod telemetry;
mod tenant_isolation;
mod tls;

/// With `autotests = false`, a new file in `tests/` is compiled only when it is declared
/// above: a test file left out would never run, silently.
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests");
    let root = include_str!("integration.rs");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let is_module = path.is_dir() && path.join("mod.rs").exists()
            || path.extension().is_some_and(|e| e == "rs") && name != "integration";
        if is_module {
            assert!(
                root.lines().any(|l| l == format!("mod {name};")),
                "tests/{name} is not declared in tests/integration.rs, so none of its tests run"
            );
        }
    }
}
