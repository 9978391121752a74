//! Tenant isolation: account B reusing account A's keys always makes a fresh request of its
//! own (never a replay of A's response, a 409 or a 422), 10,000 times over.

use crate::common::{ALICE, BOB, TestServer, send};
use futures_util::stream::{self, StreamExt};

const TRIALS: usize = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_trials_of_b_reusing_a_s_keys_are_always_fresh_for_b() {
    let server = TestServer::start().await;
    let failures: Vec<String> = stream::iter(0..TRIALS)
        .map(|i| {
            let server = &server;
            async move {
                let key = format!("tenant-key-{i:06}");
                let a_body = format!(r#"{{"amount": {}, "currency": "EUR"}}"#, 100 + i);
                // Three ways B meets A's key: after A finished with the same body, with
                // another body, and while A is still in flight.
                let b_body = match i % 3 {
                    1 => format!(r#"{{"amount": {}, "currency": "USD"}}"#, 7 + i),
                    _ => a_body.clone(),
                };
                let (a, b) = if i % 3 == 2 {
                    tokio::join!(
                        send(server.post(ALICE, Some(&key), &a_body)),
                        send(server.post(BOB, Some(&key), &b_body))
                    )
                } else {
                    let a = send(server.post(ALICE, Some(&key), &a_body)).await;
                    (a, send(server.post(BOB, Some(&key), &b_body)).await)
                };
                if a.status != 201 || b.status != 201 || b.replayed() || a.id() == b.id() {
                    Some(format!(
                        "trial {i}: A {} {}, B {} replayed={} {}",
                        a.status,
                        a.id(),
                        b.status,
                        b.replayed(),
                        b.body
                    ))
                } else {
                    None
                }
            }
        })
        .buffer_unordered(32)
        .filter_map(|failure| async move { failure })
        .collect()
        .await;
    assert!(
        failures.is_empty(),
        "{} failures, first: {:?}",
        failures.len(),
        failures.first()
    );
    assert_eq!(server.payments().await, 2 * TRIALS as i64);
    eprintln!("{TRIALS} trials: B always got a fresh payment of its own");
    server.stop().await;
}
