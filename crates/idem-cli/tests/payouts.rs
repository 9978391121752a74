//! Work outside the database: `kill -9` of a real `idem serve` at each point of a payout, the
//! reconciler, gapless invoices under concurrency, and `idem keys`.

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{ALICE, Spawned, TestServer, idem_output, send, start_psp};
use futures_util::future::join_all;
use idem_cli::fake_psp::{FakePsp, Faults};

/// A real `idem serve` process whose payout leases last one second, so crashed payouts are
/// reconciled fast.
fn serve(db: &std::path::Path, psp: &str, extra: &[&str]) -> Spawned {
    serve_with_lease(db, psp, "1", extra)
}

fn serve_with_lease(db: &std::path::Path, psp: &str, lease: &str, extra: &[&str]) -> Spawned {
    serve_on(&format!("sqlite://{}", db.display()), psp, lease, extra)
}

/// A server on `database`; its provider calls time out after 2 s unless `extra` says
/// otherwise, so a crashed payout's claim (lease + provider timeout) runs out quickly.
fn serve_on(database: &str, psp: &str, lease: &str, extra: &[&str]) -> Spawned {
    let timeout: &[&str] = if extra.contains(&"--psp-timeout-secs") {
        &[]
    } else {
        &["--psp-timeout-secs", "2"]
    };
    Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--listen", "127.0.0.1:0", "--lease-secs", lease])
            .args(["--database", database])
            .args(["--psp-url", psp])
            .args(timeout)
            .args(extra),
    )
}

/// Waits for `served` to print `needle` (a fault pause it reached).
fn await_line(served: &Spawned, needle: &str) {
    assert!(
        served.await_line(needle, Duration::from_secs(20)),
        "idem serve never printed {needle:?}"
    );
}

/// The first line `served` prints on stderr that contains `needle`.
fn line_with(served: &Spawned, needle: &str) -> String {
    served
        .line_with(needle, Duration::from_secs(20))
        .unwrap_or_else(|| panic!("idem serve never printed {needle:?}"))
}

/// `idem keys ARGS`: its exit code, stdout and stderr.
fn keys(args: &[&str]) -> (Option<i32>, String, String) {
    idem_output("keys", args)
}

pub(crate) fn payout(url: &str, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{url}/payouts"))
        .bearer_auth(ALICE)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount": 2500, "currency": "EUR"}"#)
        .timeout(Duration::from_secs(30))
}

/// Retries like a client until a final answer; returns it and how many 409s it saw.
async fn retry_until_final(url: &str, key: &str) -> (crate::common::Answer, usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut conflicts = 0;
    loop {
        let answer = send(payout(url, key)).await;
        if answer.status != 409 || Instant::now() > deadline {
            return (answer, conflicts);
        }
        conflicts += 1;
        assert!(answer.headers.get("retry-after").is_some());
        // The client honours Retry-After, shortened so the test is quick.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends a payout that never gets its answer: the server dies before answering.
fn send_and_lose(url: &str, key: &str) -> tokio::task::JoinHandle<()> {
    let request = payout(url, key);
    tokio::spawn(async move {
        let _ = request.send().await;
    })
}

#[derive(Clone, Copy, Debug)]
enum KillPoint {
    Before,
    During,
    After,
}

async fn kill_at(point: KillPoint) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (psp, psp_url) = start_psp().await;
    let key = format!("payout-{point:?}");
    let pause: &[&str] = match point {
        KillPoint::Before => &["--fault-pause", "before-provider"],
        KillPoint::After => &["--fault-pause", "after-provider"],
        KillPoint::During => &[],
    };
    if let KillPoint::During = point {
        // The provider takes its time, so the server dies while the call is in flight; the
        // provider still completes the charge, as a real one would.
        psp.set_faults(Faults {
            delay_ms: 1500,
            ..Faults::default()
        })
        .await;
    }
    let mut first = serve(&db, &psp_url, pause);
    let arrived = psp.arrived.notified();
    let lost = send_and_lose(&first.url, &key);
    match point {
        KillPoint::Before => await_line(&first, "paused at BeforeProvider"),
        KillPoint::After => await_line(&first, "paused at AfterProvider"),
        KillPoint::During => arrived.await,
    }
    first.kill9();
    lost.await.unwrap();
    psp.set_faults(Faults::default()).await;

    let second = serve(&db, &psp_url, &[]);
    let (answer, conflicts) = retry_until_final(&second.url, &key).await;
    // Let a delayed charge land before counting.
    if let KillPoint::During = point {
        tokio::time::sleep(Duration::from_millis(1600)).await;
    }
    let charges = psp.charges().await;
    eprintln!(
        "{point:?}: final {} after {conflicts} × 409; provider charges: {charges}",
        answer.status
    );
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_eq!(charges, 1, "exactly one charge at the provider");
    assert_eq!(
        answer.body["provider_charge"], "ch_1",
        "the provider's answer"
    );
    // And it replays from now on.
    let again = send(payout(&second.url, &key)).await;
    assert!(again.replayed());
    assert_eq!(again.body, answer.body);
    assert_eq!(psp.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_before_the_provider_call_leaves_one_charge() {
    kill_at(KillPoint::Before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_the_provider_call_leaves_one_charge() {
    kill_at(KillPoint::During).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_after_the_provider_call_before_the_outcome_is_stored_leaves_one_charge() {
    kill_at(KillPoint::After).await;
}

/// A provider that charges every `POST` it receives, a repeated key too, and holds each for
/// `hold_ms` before it records the charge: while it holds one, a lookup by key says `404`.
async fn start_forgetful_psp(hold_ms: u64) -> (FakePsp, String) {
    let (psp, url) = start_psp().await;
    psp.set_faults(forgetful(hold_ms)).await;
    (psp, url)
}

fn forgetful(hold_ms: u64) -> Faults {
    Faults {
        delay_ms: hold_ms,
        no_dedupe: true,
        ..Faults::default()
    }
}

/// The payout `key` sent to `first`, which is killed with SIGKILL the moment the provider
/// receives the call (held 3 s there, longer than the 2 s lease); then retried on `retry_on`
/// until its final answer. Only the claim's hold (lease + provider timeout) stands between the
/// reconciler and a `404` that would release the key while the charge is still being made.
async fn kill_during_a_held_call(
    psp: &FakePsp,
    mut first: Spawned,
    retry_on: impl FnOnce() -> Spawned,
    key: &str,
) {
    let arrived = psp.arrived.notified();
    let lost = send_and_lose(&first.url, key);
    arrived.await;
    let killed_at = Instant::now();
    first.kill9();
    lost.await.unwrap();
    let second = retry_on();
    let (answer, conflicts) = retry_until_final(&second.url, key).await;
    eprintln!(
        "final {} {:.1} s after the kill, after {conflicts} × 409; provider: {} POST /charges, {} charges",
        answer.status,
        killed_at.elapsed().as_secs_f64(),
        psp.requests(),
        psp.charges().await
    );
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_eq!(answer.body["provider_charge"], "ch_1");
    assert_eq!(
        psp.requests(),
        1,
        "exactly one POST /charges reached the provider"
    );
    assert_eq!(psp.charges().await, 1);
    let again = send(payout(&second.url, key)).await;
    assert!(again.replayed());
    assert_eq!(again.raw, answer.raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_a_held_call_to_a_provider_without_dedup_makes_one_post() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (psp, psp_url) = start_forgetful_psp(3000).await;
    let args = ["--psp-timeout-secs", "4"];
    let first = serve_with_lease(&db, &psp_url, "2", &args);
    let restart = || serve_with_lease(&db, &psp_url, "2", &args);
    kill_during_a_held_call(&psp, first, restart, "held-call-key-01").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_a_held_call_the_other_instance_reconciles_with_one_post() {
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let (psp, psp_url) = start_forgetful_psp(3000).await;
    let args = ["--psp-timeout-secs", "4"];
    let a = serve_on(db.url(), &psp_url, "2", &args);
    let b = serve_on(db.url(), &psp_url, "2", &args);
    kill_during_a_held_call(&psp, a, || b, "held-call-key-02").await;
}

/// Retries as a client that honours `Retry-After` to the second, counted from each answer's
/// arrival (the first's at `first_at`), until a final answer. Returns the answers seen, the
/// final one last.
async fn honour_retry_after(
    url: &str,
    key: &str,
    first: crate::common::Answer,
    first_at: Instant,
) -> Vec<crate::common::Answer> {
    let mut answers = vec![first];
    let mut last_at = first_at;
    while let Some(last) = answers.last()
        && matches!(last.status, 409 | 502 | 503 | 504)
    {
        assert!(answers.len() < 30, "no final answer");
        let after: u64 = last
            .headers
            .get("retry-after")
            .unwrap_or_else(|| panic!("{} without Retry-After: {}", last.status, last.body))
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        tokio::time::sleep_until((last_at + Duration::from_secs(after)).into()).await;
        answers.push(send(payout(url, key)).await);
        last_at = Instant::now();
    }
    answers
}

/// A provider fault that leaves a payout's outcome unknown at first.
#[derive(Clone, Copy, Debug)]
enum ProviderFault {
    /// The provider charges, but its answer is lost on the way back.
    LostAnswer,
    /// The provider fails the call before it charges.
    ErrorBeforeCharging,
}

/// The provider fails a payout with `fault`: the client's first answer is an
/// `outcome-unknown` problem, a duplicate's answer while the reconciler asks the provider a
/// `409`, and a client that honours `Retry-After` gets its final `201` at its first retry,
/// with the one charge the provider made.
async fn unknown_outcome(fault: ProviderFault, key: &str) {
    // The first answer's status; whether the retry replays (the reconciler found the charge and
    // stored it) or runs fresh (the key was released at once); the calls the provider received;
    // what the reconciler made of the record.
    let (faults, first_status, replays, posts, reconciled) = match fault {
        ProviderFault::LostAnswer => (
            Faults {
                drop_next: 1,
                ..Faults::default()
            },
            504,
            true,
            1,
            "result=Completed",
        ),
        ProviderFault::ErrorBeforeCharging => (
            Faults {
                fail_next: 1,
                ..Faults::default()
            },
            502,
            false,
            2,
            "result=Released",
        ),
    };
    let dir = tempfile::tempdir().unwrap();
    let (psp, psp_url) = start_psp().await;
    psp.set_faults(faults).await;
    // The reconciler's lookup waits at the provider until the duplicate below has met the
    // unknown record, however slow the machine.
    psp.hold_lookups();
    // Long enough that the held lookup cannot time out first.
    let timeout = ["--psp-timeout-secs", "60"];
    let served = serve(&dir.path().join("idem.db"), &psp_url, &timeout);
    let started = Instant::now();
    let first = send(payout(&served.url, key)).await;
    let first_at = Instant::now();
    tokio::time::timeout(Duration::from_secs(20), psp.lookups_arrived(1))
        .await
        .expect("the reconciler never asked the provider");
    let duplicate = send(payout(&served.url, key)).await;
    assert_eq!(duplicate.status, 409, "{}", duplicate.body);
    assert_eq!(
        duplicate.body["type"], "urn:idem:problem:outcome-unknown",
        "the handler has returned: never \"still running\""
    );
    assert!(duplicate.headers.contains_key("retry-after"));
    assert_eq!(first.status, first_status, "{}", first.body);
    assert_eq!(first.body["type"], "urn:idem:problem:outcome-unknown");
    psp.release_lookups();
    let released = Instant::now();
    // The reconciler logs a record once it has stored what it learnt. (Blocking off the
    // worker: the lookup just woken may wait in this worker's LIFO slot, which no other
    // worker steals.)
    let line = tokio::task::block_in_place(|| line_with(&served, "reconciled a stale payout"));
    assert!(line.contains(reconciled), "{fault:?}: {line}");
    let reconciled_at = Instant::now();
    // The retry comes at the first Retry-After, or once the pass is over if this machine was
    // slower than that.
    let answers = honour_retry_after(&served.url, key, first, first_at).await;
    let last = answers.last().unwrap();
    eprintln!(
        "{key}: {} answers ({:?}), final {} {:.2} s after the fault; reconciled {:.2} s after the \
         first answer, {:.2} s after the lookup was released",
        answers.len(),
        answers.iter().map(|a| a.status).collect::<Vec<_>>(),
        last.status,
        started.elapsed().as_secs_f64(),
        (reconciled_at - first_at).as_secs_f64(),
        (reconciled_at - released).as_secs_f64(),
    );
    assert_eq!(last.status, 201, "{}", last.body);
    assert_eq!(
        answers.len(),
        2,
        "the first retry at its Retry-After gets the final answer"
    );
    assert_eq!(
        last.replayed(),
        replays,
        "{fault:?}: the retry replays only a charge the reconciler stored"
    );
    assert_eq!(last.body["provider_charge"], "ch_1");
    assert_eq!(
        psp.requests(),
        posts,
        "{fault:?}: the calls the provider got"
    );
    assert_eq!(psp.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_provider_answer_is_reconciled_not_charged_twice() {
    unknown_outcome(ProviderFault::LostAnswer, "lost-answer-01").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_error_before_charging_is_released_at_once_and_the_retry_pays() {
    unknown_outcome(ProviderFault::ErrorBeforeCharging, "provider-500-01").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_that_is_down_releases_the_key_and_a_decline_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let parked = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = format!("http://{}", parked.local_addr().unwrap());
    drop(parked);
    let served = serve(&dir.path().join("idem.db"), &down, &[]);
    let answer = send(payout(&served.url, "provider-down-1")).await;
    assert_eq!(answer.status, 502);
    drop(served);

    let (psp, psp_url) = start_psp().await;
    psp.set_faults(Faults {
        decline_next: 1,
        ..Faults::default()
    })
    .await;
    let served = serve(&dir.path().join("idem.db"), &psp_url, &[]);
    // The same key runs fresh (it was released), and the decline is stored and replayed.
    let declined = send(payout(&served.url, "provider-down-1")).await;
    assert_eq!(declined.status, 402);
    let again = send(payout(&served.url, "provider-down-1")).await;
    assert_eq!(again.status, 402);
    assert!(again.replayed());
    assert_eq!(psp.charges().await, 0);
}

/// A key reused, after its retention, for a different payout is a new payout: the provider is
/// called under another key (its downstream key covers the request, not only the scope), so
/// the new payout is made rather than answered with the old one's charge. Found by the model
/// checker (crates/idem-model, `key-reuse-after-retention`): with the provider's key derived
/// from the scope alone, the call met the old charge's key with another body (the provider's
/// `422`), the outcome was unknown, and the reconciler completed the new payout with the old
/// charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_reused_after_its_retention_for_another_payout_pays_it() {
    let dir = tempfile::tempdir().unwrap();
    let (psp, psp_url) = start_psp().await;
    let served = serve(
        &dir.path().join("idem.db"),
        &psp_url,
        &["--retention-secs", "1"],
    );
    let first = send(payout(&served.url, "reused-key-01")).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let other =
        || payout(&served.url, "reused-key-01").body(r#"{"amount": 4000, "currency": "EUR"}"#);
    // Until the first payout's retention ends, the other body under its key is a mismatch.
    let deadline = Instant::now() + Duration::from_secs(30);
    let second = loop {
        let answer = send(other()).await;
        if answer.status != 422 || Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(second.status, 201, "{:?}", second.body);
    assert!(!second.replayed());
    assert_eq!(
        second.body["amount"], 4000,
        "the new payout, not the old charge"
    );
    assert_ne!(second.body["id"], first.body["id"]);
    assert_eq!(psp.charges().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_concurrent_invoice_requests_with_200_keys_issue_1_to_200_once_each() {
    let server = TestServer::start().await;
    let requests: Vec<String> = (0..1000)
        .map(|i| format!("invoice-key-{:04}", i % 200))
        .collect();
    let answers = join_all(requests.iter().map(|key| {
        let req = server.post_to(
            "/invoices",
            ALICE,
            Some(key),
            r#"{"amount": 100, "currency": "EUR"}"#,
        );
        async move { (key.clone(), send(req).await) }
    }))
    .await;
    let mut number_of: HashMap<String, i64> = HashMap::new();
    for (key, answer) in &answers {
        assert_eq!(answer.status, 201, "{}", answer.body);
        let number = answer.body["number"].as_i64().unwrap();
        let previous = number_of.insert(key.clone(), number);
        assert!(
            previous.is_none_or(|p| p == number),
            "a retry got the number already issued"
        );
    }
    let mut numbers: Vec<i64> = number_of.values().copied().collect();
    numbers.sort_unstable();
    assert_eq!(
        numbers,
        (1..=200).collect::<Vec<_>>(),
        "1..200, each exactly once"
    );
    assert_eq!(server.count("SELECT COUNT(*) FROM invoices").await, 200);
    server.stop().await;
}

/// `idem.db` in `dir`, where an `idem serve` (gone again) paid out once for each of `keys`; and
/// the provider's URL.
async fn paid(dir: &std::path::Path, keys: &[&str]) -> (std::path::PathBuf, String) {
    let db = dir.join("idem.db");
    let (_psp, psp_url) = start_psp().await;
    let served = serve(&db, &psp_url, &[]);
    for key in keys {
        assert_eq!(send(payout(&served.url, key)).await.status, 201);
    }
    (db, psp_url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idem_keys_lists_shows_purges_and_completes() {
    let dir = tempfile::tempdir().unwrap();
    let (db, psp_url) = paid(dir.path(), &["listed-key-0001"]).await;
    // A worker killed before it stored the outcome, under an hour's lease: stuck.
    let mut served = serve_with_lease(&db, &psp_url, "3600", &["--fault-pause", "after-provider"]);
    let lost = send_and_lose(&served.url, "stuck-key-00001");
    await_line(&served, "paused at AfterProvider");
    served.kill9();
    lost.await.unwrap();

    let database = format!("sqlite://{}", db.display());
    let idem = |args: &[&str]| {
        let (code, stdout, _) = keys(&[&["--database", database.as_str()], args].concat());
        (code, stdout)
    };
    let (code, list) = idem(&["list"]);
    assert_eq!(code, Some(0));
    assert!(
        list.contains("listed-key-0001") && list.contains("completed"),
        "{list}"
    );
    assert!(
        list.contains("stuck-key-00001") && list.contains("in_progress"),
        "{list}"
    );
    assert!(list.contains("2 keys"), "{list}");
    let (_, stuck_only) = idem(&["list", "--in-progress"]);
    assert!(!stuck_only.contains("listed-key-0001"), "{stuck_only}");

    let (_, shown) = idem(&["show", "acct_alice", "listed-key-0001"]);
    assert!(
        shown.contains("--body to show") && !shown.contains("po_ch_1"),
        "{shown}"
    );
    let (_, with_body) = idem(&["show", "acct_alice", "listed-key-0001", "--body"]);
    assert!(with_body.contains("po_ch_1"), "{with_body}");

    let complete = [
        "complete",
        "acct_alice",
        "stuck-key-00001",
        "--status",
        "201",
    ];
    let (code, _) = idem(&[&complete[..], &["--body", r#"{"id":"po_ch_2"}"#]].concat());
    assert_eq!(code, Some(0));
    let (code, _) = idem(&complete);
    assert_eq!(code, Some(1), "only an in-progress key can be completed");
    let (code, _) = idem(&["purge", "acct_alice", "listed-key-0001"]);
    assert_eq!(code, Some(0));
    let (_, list) = idem(&["list"]);
    assert!(
        list.contains("1 keys") && !list.contains("listed-key-0001"),
        "{list}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_on_another_instance_waits_for_the_outcome_woken_by_notify() {
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let (psp, psp_url) = start_psp().await;
    // The provider takes 1.5 s; the duplicate may wait 20 s: it must come back with the
    // payout as soon as the first instance stores it, which only a NOTIFY can tell it.
    psp.set_faults(Faults {
        delay_ms: 1500,
        ..Faults::default()
    })
    .await;
    let wait = ["--wait-for-outcome-secs", "20"];
    let a = serve_on(db.url(), &psp_url, "30", &wait);
    let b = serve_on(db.url(), &psp_url, "30", &wait);
    let arrived = psp.arrived.notified();
    let original = tokio::spawn(send(payout(&a.url, "notified-key-01")));
    arrived.await;
    let started = Instant::now();
    let duplicate = send(payout(&b.url, "notified-key-01")).await;
    let waited = started.elapsed();
    let original = original.await.unwrap();
    eprintln!("the duplicate on the other instance waited {waited:?}");
    assert_eq!(original.status, 201);
    assert_eq!(duplicate.status, 201, "{}", duplicate.body);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, original.body);
    assert!(
        waited < Duration::from_secs(10),
        "woken by the notification, not the bound"
    );
    assert_eq!(psp.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idem_keys_refuses_a_missing_database_takes_both_key_forms_and_wraps_long_keys() {
    let dir = tempfile::tempdir().unwrap();
    let long_key = format!("long-{}", "k".repeat(90));
    let (db, _) = paid(dir.path(), &["order-1042-pay", &long_key]).await;
    let database = format!("sqlite://{}", db.display());

    // A wrong path is an error, not an empty database with "0 keys".
    let missing = format!("sqlite://{}", dir.path().join("elsewhere.db").display());
    let (code, _, stderr) = keys(&["--database", &missing, "list"]);
    assert_eq!(code, Some(2), "an error: {stderr}");
    assert!(stderr.contains("no database at"), "{stderr}");
    assert!(
        !dir.path().join("elsewhere.db").exists(),
        "nothing was created"
    );

    // --database after the subcommand; the quoted form names the same key.
    let (code, shown, stderr) = keys(&[
        "show",
        "acct_alice",
        "\"order-1042-pay\"",
        "--database",
        &database,
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(shown.contains("key          order-1042-pay"), "{shown}");

    // A long key wraps under its column; every line of the table stays aligned.
    let (code, list, _) = keys(&["list", "--database", &database]);
    assert_eq!(code, Some(0));
    let lines: Vec<&str> = list.lines().collect();
    let row = lines
        .iter()
        .position(|line| line.contains(&long_key[..36]))
        .unwrap_or_else(|| panic!("{list}"));
    assert!(lines[row].contains("completed"), "{list}");
    let column = lines[0].find("KEY").unwrap();
    let rest: String = lines[row + 1..]
        .iter()
        .take_while(|line| line[..column].trim().is_empty())
        .map(|line| line[column..].trim())
        .collect();
    assert_eq!(format!("{}{rest}", &long_key[..36]), long_key, "{list}");
    assert!(list.contains("2 keys"), "{list}");
}
