//! `idem simulate --url`: the ACK-loss experiment against an API the simulator did not start,
//! its charges counted as the resource ids the fault injector saw (and, with a list, as the
//! resources the API lists). Against `idem serve` as a process (keys hold), a naive API that
//! ignores keys (extra charges with and without them), `idem proxy` in front of that naive
//! API (keys hold again), and `idem serve` over https with a throwaway CA.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::common::processes::{Idem, Serve};
use crate::common::{ALICE, idem_output};
use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::post;
use idem_cli::simulate::{
    RateReport, Report, ResourceList, SimulateConfig, Target, TargetApi, simulate,
};
use indicatif::ProgressBar;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use reqwest::header::{AUTHORIZATION, HeaderValue};
use serde_json::{Value, json};

/// Intents per run: at a loss rate of 0.2 about 80 are charged twice without keys and about
/// 100 charges are extra, far from 0.
const INTENTS: u64 = 400;
const LOSS: f64 = 0.2;

/// `TargetApi` for `url`, with `Authorization: Bearer <token>`.
fn api(url: &str, token: &str) -> TargetApi {
    let mut api = TargetApi::new(url.parse().unwrap());
    api.headers.push((
        AUTHORIZATION,
        HeaderValue::try_from(format!("Bearer {token}")).unwrap(),
    ));
    api
}

/// One rate, [`INTENTS`] intents at [`LOSS`], against `api`.
async fn measure(api: TargetApi) -> Report {
    let mut config = SimulateConfig::new(INTENTS, vec![LOSS]);
    config.target = Some(api);
    simulate(&config, &ProgressBar::hidden()).await.unwrap()
}

/// Without keys, an API that charges on every POST: each lost answer's retry charged again,
/// about as many times as the statistics say. Returns the rate's figures.
fn assert_charged_again_without_keys(report: &Report) -> &RateReport {
    assert_eq!(report.rates.len(), 1);
    let rate = &report.rates[0];
    let without = &rate.without_keys;
    let expected = rate.expected.extra_charges;
    let extra = without.extra_charges as f64;
    assert!(
        (extra - expected).abs() <= 0.4 * expected,
        "extra charges {extra}, expected about {expected}"
    );
    assert_eq!(without.extra_charges, without.run.answers_lost);
    assert!(without.double_charge_incidents > 0);
    assert_eq!(without.run.resources_seen, INTENTS + without.extra_charges);
    assert_eq!(without.run.intents_charged, INTENTS);
    assert_eq!(without.run.answers_without_id, 0);
    assert_eq!(without.run.unanswered, 0);
    rate
}

/// With keys, an API that keeps them: one charge per intent, every lost answer's retry
/// answered from the stored response.
fn assert_keys_held(report: &Report) {
    let rate = &report.rates[0];
    let with = &rate.with_keys;
    assert_eq!((with.double_charges, with.extra_charges), (0, 0));
    assert_eq!(with.run.resources_seen, INTENTS);
    assert_eq!(with.run.intents_charged, INTENTS);
    // The same seed: the same faults as the run without keys.
    assert_eq!(with.run.answers_lost, rate.without_keys.run.answers_lost);
    assert_eq!(with.duplicates_prevented, with.run.answers_lost);
    assert_eq!(with.run.attempts, INTENTS + with.run.answers_lost);
    assert_eq!(with.run.unanswered, 0);
    assert!(report.keys_held(), "{}", report.table());
}

/// Against an API that requires keys, the run without them is refused intent by intent: the
/// refusals are counted (no charge could happen) and the run with keys still measures. A
/// refused token, a set-up error, stops the simulation instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_counted_and_a_refused_token_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("idem.db").display());
    let serve = Serve::start(&database).await;
    let url = format!("{}/payments", serve.url);
    let mut config = SimulateConfig::new(50, vec![LOSS]);
    config.target = Some(api(&url, ALICE));
    let report = simulate(&config, &ProgressBar::hidden()).await.unwrap();
    let rate = &report.rates[0];
    assert_eq!(rate.without_keys.run.refused, 50, "{}", report.table());
    assert_eq!(rate.without_keys.run.intents_charged, 0);
    assert_eq!(rate.without_keys.extra_charges, 0);
    assert_eq!(rate.with_keys.run.refused, 0);
    assert_eq!(rate.with_keys.run.intents_charged, 50);
    assert_eq!(rate.with_keys.double_charges, 0);
    assert!(
        report
            .table()
            .contains("without keys, 50 intent(s) ended refused"),
        "{}",
        report.table()
    );

    config.target = Some(api(&url, "sk_test_nobody"));
    let err = simulate(&config, &ProgressBar::hidden()).await.unwrap_err();
    assert!(
        format!("{err:#}").contains("was refused with 401"),
        "{err:#}"
    );
}

/// In both runs the list gained exactly the resources whose ids the answers carried.
fn assert_list_agrees(rate: &RateReport) {
    for run in [&rate.without_keys.run, &rate.with_keys.run] {
        assert_eq!(
            run.resources_listed,
            Some(run.resources_seen),
            "{}",
            run.run_id
        );
        assert_eq!(run.listed_not_seen, Some(0), "{}", run.run_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_hold_against_idem_serve_as_a_process() {
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("idem.db").display());
    let serve = Serve::start_with(&database, &["--key-optional"]).await;
    let report = measure(api(&format!("{}/payments", serve.url), ALICE)).await;
    let rate = assert_charged_again_without_keys(&report);
    assert_keys_held(&report);
    let Target::Url { url, .. } = &report.target else {
        panic!("{:?}", report.target)
    };
    assert_eq!(*url, format!("{}/payments", serve.url));

    // The ids the fault injector saw are the payments the service holds, no more, no less.
    let db = sqlx::SqlitePool::connect(&database).await.unwrap();
    let (payments,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM payments")
        .fetch_one(&db)
        .await
        .unwrap();
    let seen = rate.without_keys.run.resources_seen + rate.with_keys.run.resources_seen;
    assert_eq!(payments as u64, seen);
    db.close().await;
}

/// A charge the naive API made: its id and the `run` member of the body that made it.
type Charge = (String, Option<String>);

/// A naive charges API: every POST makes a charge with a new id, whatever key it carries.
/// `GET /charges` lists them as `{"data": [...]}`, only one run's with `?run=`.
#[derive(Clone, Default)]
struct Naive {
    /// Every charge made.
    charges: Arc<Mutex<Vec<Charge>>>,
}

impl Naive {
    /// Serves on 127.0.0.1:0; returns `http://127.0.0.1:PORT`.
    async fn start(&self) -> String {
        let app = axum::Router::new()
            .route("/charges", post(create).get(list))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn count(&self) -> u64 {
        self.charges.lock().unwrap().len() as u64
    }
}

async fn create(State(naive): State<Naive>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let id = format!("ch_{}", uuid::Uuid::new_v4().simple());
    let run = body["run"].as_str().map(str::to_owned);
    naive.charges.lock().unwrap().push((id.clone(), run));
    (
        StatusCode::CREATED,
        Json(json!({ "id": id, "object": "charge" })),
    )
}

async fn list(
    State(naive): State<Naive>,
    Query(query): Query<HashMap<String, String>>,
) -> Json<Value> {
    let charges = naive.charges.lock().unwrap();
    let data: Vec<Value> = charges
        .iter()
        .filter(|(_, run)| {
            query
                .get("run")
                .is_none_or(|wanted| run.as_ref() == Some(wanted))
        })
        .map(|(id, _)| json!({ "id": id }))
        .collect();
    Json(json!({ "data": data }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_naive_api_charges_again_with_keys_and_without() {
    let naive = Naive::default();
    let url = naive.start().await;
    let mut target = api(&format!("{url}/charges"), "sk_naive");
    // The run id in the body, and the list filtered by it: how a real API's metadata keeps
    // the runs apart.
    target.body = r#"{"amount": 100, "currency": "EUR", "run": "{{run}}"}"#.to_owned();
    target.list = Some(ResourceList::new(format!("{url}/charges?run={{{{run}}}}")));
    let report = measure(target).await;
    let rate = assert_charged_again_without_keys(&report);

    // Keys change nothing here: the same faults, the same extra charges.
    let with = &rate.with_keys;
    assert_eq!(with.extra_charges, with.run.answers_lost);
    assert_eq!(with.extra_charges, rate.without_keys.extra_charges);
    assert!(with.double_charges > 0);
    assert_eq!(with.duplicates_prevented, 0);
    assert!(!report.keys_held());
    assert!(
        report.table().contains("IDEMPOTENCY FAILED"),
        "{}",
        report.table()
    );

    // The API's own list agrees with the ids the fault injector saw.
    assert_list_agrees(rate);
    assert_eq!(
        naive.count(),
        rate.without_keys.run.resources_seen + with.run.resources_seen
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_proxy_in_front_of_the_naive_api_holds_with_keys() {
    let naive = Naive::default();
    let upstream = naive.start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = Idem::start_proxy(
        dir.path(),
        &upstream,
        &["--key-optional"],
        dir.path().join("proxy.log"),
    )
    .await;
    let mut target = api(&format!("{}/charges", proxy.url), "sk_naive");
    // Unfiltered, through the proxy: what the list gained during a run is what it made.
    target.list = Some(ResourceList::new(format!("{}/charges", proxy.url)));
    let report = measure(target).await;
    let rate = assert_charged_again_without_keys(&report);
    assert_keys_held(&report);
    assert_list_agrees(rate);
    assert_eq!(naive.count(), 2 * INTENTS + rate.without_keys.extra_charges);
    let table = report.table();
    assert!(
        table.contains(&format!("Target: {}/charges", proxy.url)),
        "{table}"
    );
    assert!(table.contains("listed"), "{table}");
}

/// A CA of the test's own, and a certificate it signed for `localhost`, as PEM files in
/// `dir`: `ca.pem`, `server.pem`, `server.key`.
fn throwaway_ca(dir: &Path) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "simulate test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("server.pem"), leaf.pem()).unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_measures_idem_serve_over_https() {
    let dir = tempfile::tempdir().unwrap();
    throwaway_ca(dir.path());
    let file = |name: &str| dir.path().join(name).display().to_string();
    let database = format!("sqlite://{}", file("idem.db"));
    let (cert, key) = (file("server.pem"), file("server.key"));
    let serve = Serve::start_with(
        &database,
        &["--key-optional", "--tls-cert", &cert, "--tls-key", &key],
    )
    .await;
    assert!(serve.url.starts_with("https://"), "{}", serve.url);
    // The name on the certificate, not the address the server printed.
    let url = format!("{}/payments", serve.url.replace("127.0.0.1", "localhost"));
    let authorization = format!("Authorization: Bearer {ALICE}");
    let plot = file("sim.svg");
    let target = [
        "--url",
        &url,
        "--header",
        &authorization,
        "--loss",
        "0.2",
        "--json",
    ];

    let ca = file("ca.pem");
    let mut args = target.to_vec();
    args.extend(["--requests", "200", "--ca-cert", &ca, "--plot", &plot]);
    let (code, stdout, stderr) = idem_output("simulate", &args);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["target"]["kind"], "url");
    assert_eq!(json["target"]["url"], url.as_str());
    let rate = &json["rates"][0];
    assert_eq!(rate["with_keys"]["double_charges"], 0);
    assert_eq!(rate["with_keys"]["extra_charges"], 0);
    assert_eq!(rate["with_keys"]["resources_seen"], 200);
    let extra = rate["without_keys"]["extra_charges"].as_u64().unwrap();
    assert!(extra > 0, "{rate}");
    assert_eq!(rate["without_keys"]["answers_lost"], extra);
    assert_eq!(rate["without_keys"]["resources_seen"], 200 + extra);
    let svg = std::fs::read_to_string(&plot).expect("the chart was written");
    // Without a system font the chart has no text at all.
    if svg.contains("<text") {
        assert!(svg.contains(&url), "the chart names the target");
    }

    // Without the CA the certificate is refused, and the error says so.
    let mut args = target.to_vec();
    args.extend(["--requests", "1"]);
    let (code, stdout, stderr) = idem_output("simulate", &args);
    assert_eq!(code, Some(2), "{stdout}\n{stderr}");
    assert!(stderr.contains("certificate"), "{stderr}");
}

#[test]
fn the_api_flags_need_a_url() {
    for flags in [
        &["--body", "{}"][..],
        &["--header", "X-A: 1"],
        &["--list-url", "http://127.0.0.1:1/x"],
        &[
            "--database",
            "sqlite://x.db",
            "--url",
            "http://127.0.0.1:1/x",
        ],
    ] {
        let (code, _, stderr) = idem_output("simulate", flags);
        assert_eq!(code, Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains("--url"), "{flags:?}: {stderr}");
    }
}
