//! Real concurrent requests against a real `idem serve`: one intent, one payment.

use std::collections::{HashMap, HashSet};

use crate::common::{ALICE, Answer, TestServer, send};
use futures_util::future::join_all;
use rand::seq::SliceRandom;

const BODY: &str = r#"{"amount": 49900, "currency": "INR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_simultaneous_copies_make_one_payment() {
    let server = TestServer::start().await;
    let answers: Vec<Answer> =
        join_all((0..50).map(|_| send(server.post(ALICE, Some("concurrent-key-001"), BODY)))).await;

    let ids: HashSet<&str> = answers.iter().map(Answer::id).collect();
    assert_eq!(ids.len(), 1, "one payment id for every copy: {ids:?}");
    assert!(answers.iter().all(|a| a.status == 201));
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(replayed, 49, "all but the first are replays");
    // Every copy got the very same bytes.
    assert!(answers.iter().all(|a| a.raw == answers[0].raw));
    assert_eq!(server.payments().await, 1);
    assert_eq!(server.keys().await, 1);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_keys_times_five_shuffled_copies_make_a_hundred_payments() {
    let server = TestServer::start().await;
    let mut requests: Vec<(String, i64)> = (0..100)
        .flat_map(|k| (0..5).map(move |_| (format!("shuffled-key-{k:04}"), 100 + k)))
        .collect();
    requests.shuffle(&mut rand::rng());

    let answers = join_all(requests.iter().map(|(key, amount)| {
        let body = format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#);
        let req = server.post(ALICE, Some(key), &body);
        async move { (key.clone(), send(req).await) }
    }))
    .await;

    let mut ids_per_key: HashMap<String, HashSet<String>> = HashMap::new();
    let mut fresh = 0;
    for (key, answer) in &answers {
        assert_eq!(answer.status, 201, "{key}: {}", answer.body);
        if !answer.replayed() {
            fresh += 1;
        }
        ids_per_key
            .entry(key.clone())
            .or_default()
            .insert(answer.id().to_owned());
    }
    assert_eq!(ids_per_key.len(), 100);
    assert!(ids_per_key.values().all(|ids| ids.len() == 1));
    assert_eq!(fresh, 100, "exactly one fresh answer per key");
    assert_eq!(server.payments().await, 100);
    let distinct: i64 = server
        .count("SELECT COUNT(DISTINCT idem_key) FROM payments")
        .await;
    assert_eq!(distinct, 100);
    server.stop().await;
}
