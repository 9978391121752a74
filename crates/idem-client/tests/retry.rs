//! The client against real local servers scripted to fail: overloaded, cutting connections
//! after the work, busy with the same key, refusing the request. No test really waits: the
//! sleeper records the waits instead.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_client::{
    Client, Error, Intent, RecordingSleeper, RetryBudget, RetryPolicy, Sleep, Sleeper, Stop,
};
use idem_core::{IdempotencyKey, KeyLimits, ManualClock, Timestamp};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

// ---------------------------------------------------------------------------------------------
// A scripted axum server: answer `n` (0-based) is `script(n)`; it records each request's key.

type Reply = (u16, Vec<(&'static str, String)>, &'static str);

struct Scripted {
    url: String,
    keys: Arc<Mutex<Vec<Option<String>>>>,
}

impl Scripted {
    async fn start(script: impl Fn(usize) -> Reply + Send + Sync + 'static) -> Self {
        let keys: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let seen = keys.clone();
        let script = Arc::new(script);
        let handler = move |headers: HeaderMap, _body: Bytes| {
            let (seen, script) = (seen.clone(), script.clone());
            async move {
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(
                        headers
                            .get("idempotency-key")
                            .map(|v| v.to_str().unwrap().to_owned()),
                    );
                    seen.len() - 1
                };
                let (status, headers, body) = script(n);
                let mut response: Response =
                    (StatusCode::from_u16(status).unwrap(), body).into_response();
                for (name, value) in headers {
                    response.headers_mut().insert(name, value.parse().unwrap());
                }
                response
            }
        };
        let app = axum::Router::new().route("/payments", axum::routing::post(handler));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/payments", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { url, keys }
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.keys.lock().unwrap().clone()
    }

    fn requests(&self) -> usize {
        self.keys.lock().unwrap().len()
    }
}

fn reply(status: u16) -> Reply {
    (status, vec![], "")
}

fn problem(status: u16, kind: &str, retry_after: Option<&str>) -> Reply {
    let mut headers = vec![("content-type", "application/problem+json".to_owned())];
    if let Some(after) = retry_after {
        headers.push(("retry-after", after.to_owned()));
    }
    let body = match kind {
        "in-use" => r#"{"type":"urn:idem:problem:in-use","status":409}"#,
        "mismatch" => r#"{"type":"urn:idem:problem:mismatch","status":422}"#,
        _ => r#"{"type":"urn:example:already-refunded","status":409}"#,
    };
    (status, headers, body)
}

// ---------------------------------------------------------------------------------------------
// A raw HTTP/1.1 server that does the work (a "charge" per new key, or per request without a
// key) and then fails to deliver the answer to the first `faulty` requests.

#[derive(Clone, Copy)]
enum Fault {
    /// Close the connection without a byte of answer.
    Drop,
    /// Keep the connection open and never answer.
    Hang,
}

#[derive(Default)]
struct Ledger {
    keys: Vec<Option<String>>,
    charged: HashSet<String>,
    charges: usize,
    held: Vec<TcpStream>,
    /// Told each time a connection is held ([`Fault::Hang`]).
    hung: Arc<Notify>,
}

struct AckLoss {
    url: String,
    ledger: Arc<Mutex<Ledger>>,
}

impl AckLoss {
    async fn start(faulty: usize, fault: Fault) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/payments", listener.local_addr().unwrap());
        let ledger: Arc<Mutex<Ledger>> = Arc::default();
        let shared = ledger.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                tokio::spawn(serve_one(stream, shared.clone(), faulty, fault));
            }
        });
        Self { url, ledger }
    }

    fn charges(&self) -> usize {
        self.ledger.lock().unwrap().charges
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.ledger.lock().unwrap().keys.clone()
    }

    /// Returns once a request has been read whole and its connection held.
    async fn hung(&self) {
        let hung = self.ledger.lock().unwrap().hung.clone();
        tokio::time::timeout(Duration::from_secs(30), hung.notified())
            .await
            .expect("the first attempt reaches the server");
    }
}

async fn serve_one(mut stream: TcpStream, ledger: Arc<Mutex<Ledger>>, faulty: usize, fault: Fault) {
    let Some(key) = read_request(&mut stream).await else {
        return;
    };
    let (replayed, deliver) = {
        let mut ledger = ledger.lock().unwrap();
        ledger.keys.push(key.clone());
        let replayed = match &key {
            Some(k) => !ledger.charged.insert(k.clone()),
            None => false,
        };
        if !replayed {
            ledger.charges += 1;
        }
        let deliver = ledger.keys.len() > faulty;
        (replayed, deliver)
    };
    if !deliver {
        match fault {
            Fault::Drop => drop(stream),
            Fault::Hang => {
                let mut ledger = ledger.lock().unwrap();
                ledger.held.push(stream);
                ledger.hung.notify_one();
            }
        }
        return;
    }
    let replay_header = if replayed {
        "idempotent-replayed: true\r\n"
    } else {
        ""
    };
    let body = r#"{"id":"pay_1"}"#;
    let response = format!(
        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{replay_header}connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
}

/// Reads one request whole and returns its `Idempotency-Key` (`Some(None)`: no key).
async fn read_request(stream: &mut TcpStream) -> Option<Option<String>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8(buf[..head_end].to_vec()).ok()?;
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    };
    let length: usize = header("content-length").map_or(0, |v| v.parse().unwrap());
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(header("idempotency-key"))
}

// ---------------------------------------------------------------------------------------------

fn policy(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        ..RetryPolicy::default()
    }
}

fn client(max_attempts: u32) -> (Client, RecordingSleeper) {
    let sleeper = RecordingSleeper::new();
    let client = Client::new()
        .with_policy(policy(max_attempts))
        .with_budget(RetryBudget::unlimited())
        .with_sleeper(sleeper.clone())
        .with_rng(StdRng::seed_from_u64(42));
    (client, sleeper)
}

fn payment(url: &str) -> Intent {
    Intent::post(url).json(&serde_json::json!({"amount": 49900, "currency": "INR"}))
}

#[tokio::test]
async fn fails_twice_then_succeeds_with_one_key_on_every_attempt() {
    let server = Scripted::start(|n| {
        if n < 2 {
            reply(503)
        } else {
            (201, vec![], r#"{"id":"pay_1"}"#)
        }
    })
    .await;
    let (client, sleeper) = client(5);
    let intent = payment(&server.url);

    let answer = client.send(&intent).await.unwrap();

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.body, r#"{"id":"pay_1"}"#);
    assert_eq!(answer.attempts, 3);
    assert!(!answer.replayed);
    let key = intent.key().unwrap();
    assert_eq!(answer.key.as_ref(), Some(key));
    // The server saw the same key, in the IETF draft's sf-string form, on every attempt.
    let sent = Some(format!("\"{}\"", key.as_str()));
    assert_eq!(server.keys(), vec![sent.clone(), sent.clone(), sent]);
    let slept = sleeper.slept();
    assert_eq!(slept.len(), 2);
    for (n, wait) in slept.iter().enumerate() {
        assert!(
            *wait <= policy(5).ceiling(n as u32),
            "retry {n} waited {wait:?}"
        );
    }
}

#[tokio::test]
async fn a_chosen_key_is_sent_as_is() {
    let server = Scripted::start(|_| reply(201)).await;
    let (client, _) = client(5);
    let key = IdempotencyKey::new("order-0001", KeyLimits::default()).unwrap();

    client
        .send(&payment(&server.url).with_key(key))
        .await
        .unwrap();

    assert_eq!(server.keys(), vec![Some("\"order-0001\"".to_owned())]);
}

#[tokio::test]
async fn work_done_then_connection_dropped_is_retried_and_replayed() {
    let server = AckLoss::start(1, Fault::Drop).await;
    let (client, sleeper) = client(5);
    let intent = payment(&server.url);

    let answer = client.send(&intent).await.unwrap();

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.attempts, 2);
    assert!(answer.replayed, "the retry got the stored answer");
    assert_eq!(server.charges(), 1, "one intent, one charge");
    let sent = Some(format!("\"{}\"", intent.key().unwrap().as_str()));
    assert_eq!(server.keys(), vec![sent.clone(), sent]);
    assert_eq!(sleeper.slept().len(), 1);
}

#[tokio::test]
async fn without_a_key_the_retry_of_a_lost_answer_charges_twice() {
    let server = AckLoss::start(1, Fault::Drop).await;
    let (client, _) = client(5);
    let intent = payment(&server.url).without_key();

    let answer = client.send(&intent).await.unwrap();

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.attempts, 2);
    assert!(!answer.replayed);
    assert_eq!(answer.key, None);
    assert_eq!(server.keys(), vec![None, None]);
    assert_eq!(
        server.charges(),
        2,
        "the double charge keys exist to prevent"
    );
}

/// Records like [`RecordingSleeper`], and resumes Tokio's clock (which the test has paused by
/// then) at the first wait: the attempts after it run on the real clock.
#[derive(Debug, Clone, Default)]
struct ResumingSleeper {
    recorded: RecordingSleeper,
    resumed: Arc<AtomicBool>,
}

impl Sleeper for ResumingSleeper {
    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        if !self.resumed.swap(true, Ordering::SeqCst) {
            tokio::time::resume();
        }
        self.recorded.sleep(duration)
    }
}

#[tokio::test]
async fn an_attempt_that_times_out_is_retried() {
    // The attempts run on the real clock, with time to spare, except while the server holds
    // the first one: the clock is paused then, so its timeout runs out at once. (Paused
    // throughout, the clock would jump to a timeout whenever the runtime idled waiting for
    // the loopback socket, which a loaded machine makes likely.)
    let server = AckLoss::start(1, Fault::Hang).await;
    let sleeper = ResumingSleeper::default();
    let client = Client::new()
        .with_policy(RetryPolicy {
            attempt_timeout: Duration::from_secs(30),
            ..policy(3)
        })
        .with_sleeper(sleeper.clone());
    let intent = payment(&server.url);
    let sent = tokio::spawn(async move { client.send(&intent).await });
    server.hung().await;
    tokio::time::pause();

    let answer = sent.await.unwrap().unwrap();

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.attempts, 2);
    assert!(answer.replayed);
    assert_eq!(server.charges(), 1);
    assert_eq!(sleeper.recorded.slept().len(), 1);
}

#[tokio::test]
async fn key_in_use_waits_what_retry_after_says() {
    let server = Scripted::start(|n| match n {
        0 => problem(409, "in-use", Some("7")),
        _ => (201, vec![("idempotent-replayed", "true".to_owned())], "{}"),
    })
    .await;
    let (client, sleeper) = client(5);

    let answer = client.send(&payment(&server.url)).await.unwrap();

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.attempts, 2);
    assert!(answer.replayed);
    assert_eq!(sleeper.slept(), vec![Duration::from_secs(7)]);
}

#[tokio::test]
async fn a_business_conflict_is_final() {
    let server = Scripted::start(|_| problem(409, "already-refunded", None)).await;
    let (client, sleeper) = client(5);

    let answer = client.send(&payment(&server.url)).await.unwrap();

    assert_eq!(answer.status, StatusCode::CONFLICT);
    assert_eq!(answer.attempts, 1);
    assert_eq!(server.requests(), 1);
    assert!(sleeper.slept().is_empty());
}

#[tokio::test]
async fn unprocessable_and_other_client_errors_take_one_attempt() {
    for status in [422, 400, 404] {
        let server = Scripted::start(move |_| problem(status, "mismatch", None)).await;
        let (client, sleeper) = client(5);

        let answer = client.send(&payment(&server.url)).await.unwrap();

        assert_eq!(answer.status.as_u16(), status);
        assert_eq!(answer.attempts, 1);
        assert_eq!(server.requests(), 1, "{status} is not retried");
        assert!(sleeper.slept().is_empty());
    }
}

#[tokio::test]
async fn too_many_requests_is_retried() {
    let server = Scripted::start(|n| if n == 0 { reply(429) } else { reply(201) }).await;
    let (client, _) = client(5);

    let answer = client.send(&payment(&server.url)).await.unwrap();

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.attempts, 2);
}

#[tokio::test]
async fn retry_after_as_an_http_date_is_measured_with_the_injected_clock() {
    let now = Timestamp(1_700_000_000_000);
    let date = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(1_700_000_042));
    let server = Scripted::start(move |n| match n {
        0 => (503, vec![("retry-after", date.clone())], ""),
        _ => reply(201),
    })
    .await;
    let (client, sleeper) = client(5);
    let client = client.with_clock(ManualClock::new(now));

    let answer = client.send(&payment(&server.url)).await.unwrap();

    assert_eq!(answer.attempts, 2);
    assert_eq!(sleeper.slept(), vec![Duration::from_secs(42)]);
}

#[tokio::test]
async fn a_retry_after_longer_than_the_maximum_is_shortened() {
    let server = Scripted::start(|n| match n {
        0 => (503, vec![("retry-after", "86400".to_owned())], ""),
        _ => reply(201),
    })
    .await;
    let (client, sleeper) = client(5);

    client.send(&payment(&server.url)).await.unwrap();

    assert_eq!(
        sleeper.slept(),
        vec![RetryPolicy::default().max_retry_after]
    );
}

#[tokio::test]
async fn the_attempt_limit_returns_the_last_response() {
    let server = Scripted::start(|_| reply(503)).await;
    let (client, sleeper) = client(4);

    let error = client.send(&payment(&server.url)).await.unwrap_err();

    let Error::Status { stop, last } = &error else {
        panic!("expected a status error, got {error:?}");
    };
    assert_eq!(*stop, Stop::AttemptLimit);
    assert_eq!(last.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error.attempts(), 4);
    assert_eq!(server.requests(), 4);
    assert_eq!(sleeper.slept().len(), 3);
    assert_eq!(
        error.to_string(),
        "still 503 Service Unavailable after 4 attempt(s): attempt limit reached"
    );
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_the_limit() {
    // A port that was just free: nothing listens there.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    drop(listener);
    let (client, sleeper) = client(3);

    let error = client.send(&payment(&url)).await.unwrap_err();

    let Error::Transport {
        attempts,
        stop,
        source,
    } = &error
    else {
        panic!("expected a transport error, got {error:?}");
    };
    assert_eq!((*attempts, *stop), (3, Stop::AttemptLimit));
    assert!(source.is_connect(), "{source:?}");
    assert_eq!(sleeper.slept().len(), 2);
}

#[tokio::test]
async fn an_empty_budget_stops_retries_for_every_intent_of_the_client() {
    let server = Scripted::start(|_| reply(503)).await;
    let (client, sleeper) = client(10);
    let client = client.with_budget(RetryBudget::new(3, 0.0));

    let first = client.send(&payment(&server.url)).await.unwrap_err();
    let second = client.send(&payment(&server.url)).await.unwrap_err();

    assert!(matches!(
        first,
        Error::Status {
            stop: Stop::BudgetExhausted,
            ..
        }
    ));
    assert_eq!(first.attempts(), 4, "the first try and three retries");
    assert!(matches!(
        second,
        Error::Status {
            stop: Stop::BudgetExhausted,
            ..
        }
    ));
    assert_eq!(second.attempts(), 1, "no retry left for the next intent");
    assert_eq!(server.requests(), 5);
    assert_eq!(sleeper.slept().len(), 3);
}

#[tokio::test]
async fn final_answers_earn_retries_back() {
    // Every intent needs one retry: 503, then 201.
    let server = Scripted::start(|n| if n % 2 == 0 { reply(503) } else { reply(201) }).await;
    let (client, _) = client(5);
    let client = client.with_budget(RetryBudget::new(1, 1.0));

    for _ in 0..3 {
        let answer = client.send(&payment(&server.url)).await.unwrap();
        assert_eq!(answer.attempts, 2);
    }

    let starved = Client::new()
        .with_budget(RetryBudget::new(1, 0.0))
        .with_sleeper(RecordingSleeper::new());
    starved.send(&payment(&server.url)).await.unwrap();
    let error = starved.send(&payment(&server.url)).await.unwrap_err();
    assert!(matches!(
        error,
        Error::Status {
            stop: Stop::BudgetExhausted,
            ..
        }
    ));
}

#[tokio::test]
async fn the_same_seed_waits_the_same() {
    let server = Scripted::start(|_| reply(503)).await;
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (client, sleeper) = client(6);
        for _ in 0..3 {
            client.send(&payment(&server.url)).await.unwrap_err();
        }
        runs.push(sleeper.slept());
    }
    assert_eq!(runs[0].len(), 15);
    assert_eq!(runs[0], runs[1]);
}

#[tokio::test]
async fn an_unparsable_url_is_a_build_error_before_any_attempt() {
    let (client, sleeper) = client(5);

    let error = client.send(&payment("not a url")).await.unwrap_err();

    assert!(matches!(error, Error::Build(_)), "{error:?}");
    assert_eq!(error.attempts(), 0);
    assert!(sleeper.slept().is_empty());
}
