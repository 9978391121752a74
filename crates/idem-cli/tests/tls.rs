//! HTTPS end to end (docs/contract.md §9), with a throwaway CA made by rcgen: `idem serve` and
//! `idem proxy` terminate TLS (HTTP/2 and HTTP/1.1 over ALPN, checked with curl), `idem drill`
//! checks APIs over https, and the proxy calls an https upstream. A certificate the client
//! does not trust is refused with an error naming the host.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::processes::{Idem, Serve};
use crate::common::{ALICE, drill_args, idem};
use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
};
use serde_json::Value;

/// A CA of the test's own, and a server certificate it signed for `localhost` and 127.0.0.1,
/// as PEM files in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        // Distinct names: with rcgen's one default name for both, OpenSSL (curl) would take
        // the leaf for a self-signed certificate.
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name = name("idem test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut leaf =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        leaf.distinguished_name = name("localhost");
        let leaf = leaf.signed_by(&key, &ca).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("server.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.path().join("server.key"), key.serialize_pem()).unwrap();
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn ca(&self) -> String {
        self.path("ca.pem")
    }

    /// `--tls-cert … --tls-key …` for a server.
    fn server_flags(&self) -> [String; 4] {
        [
            "--tls-cert".into(),
            self.path("server.pem"),
            "--tls-key".into(),
            self.path("server.key"),
        ]
    }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

/// `idem serve` over TLS on SQLite in its own directory.
async fn serve_tls(pki: &Pki, dir: &Path) -> Serve {
    let database = format!("sqlite://{}", dir.join("idem.db").display());
    let flags = pki.server_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Serve::start_with(&database, &flags).await
}

/// `https://localhost:PORT`: the name on the certificate, not the address the server printed.
fn by_name(url: &str) -> String {
    url.replace("127.0.0.1", "localhost")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stdout of a run that exited with `code`; its stdout and stderr if it did not.
fn stdout_of(output: &Output, code: i32) -> String {
    let stdout = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(code),
        "{stdout}\n{}",
        text(&output.stderr)
    );
    stdout
}

/// The drill's JSON report: every check passed but two, after-5xx (no --failing-body) and
/// expiry (the default retention, a day, is longer than --max-wait), which skip.
fn assert_drill_passed(output: &Output) {
    let stdout = stdout_of(output, 0);
    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (
            &json["passed"],
            &json["warned"],
            &json["failed"],
            &json["skipped"]
        ),
        (&14.into(), &0.into(), &0.into(), &2.into()),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drill_passes_against_idem_serve_over_https() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let server = serve_tls(&pki, dir.path()).await;
    assert!(server.url.starts_with("https://"), "{}", server.url);
    let url = format!("{}/payments", by_name(&server.url));
    let output = idem(drill_args(&url, &["--ca-cert", &pki.ca(), "--json"])).await;
    assert_drill_passed(&output);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drill_names_the_failed_checks_of_a_broken_api_over_https() {
    let pki = Pki::new();
    // Every POST is a new payment, key or not.
    let router = Router::new().route(
        "/payments",
        post(|_body: Bytes| async {
            let id = format!("pay_{}", uuid::Uuid::new_v4().simple());
            (
                axum::http::StatusCode::CREATED,
                axum::Json(serde_json::json!({ "id": id })),
            )
        }),
    );
    let tls = idem_gateway::ServerTls::from_pem_files(
        Path::new(&pki.path("server.pem")),
        Path::new(&pki.path("server.key")),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "https://localhost:{}/payments",
        listener.local_addr().unwrap().port()
    );
    tokio::spawn(idem_gateway::server::serve_tls(
        listener,
        router,
        idem_gateway::server::HEAD_TIMEOUT,
        tls,
        std::future::pending(),
    ));
    let output = idem(drill_args(&url, &["--ca-cert", &pki.ca()])).await;
    let stdout = stdout_of(&output, 1);
    for (check, level) in [
        ("concurrent", "FAIL"),
        ("replay", "FAIL"),
        ("body-mismatch", "FAIL"),
        // Optional keys depart from a SHOULD of the draft, not from the promise.
        ("missing-key", "WARN"),
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("{check} ")) && l.contains(level)),
            "{check} should be {level}:\n{stdout}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_the_client_does_not_trust_is_refused_naming_the_host() {
    let pki = Pki::new();
    let stranger = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let server = serve_tls(&pki, dir.path()).await;
    let url = format!("{}/payments", by_name(&server.url));
    // Another CA's certificate, then the platform's roots alone: both refused before any check.
    for extra in [vec!["--ca-cert".to_owned(), stranger.ca()], vec![]] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let output = idem(drill_args(&url, &extra)).await;
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{extra:?}");
        assert!(
            stderr.contains("cannot reach https://localhost:"),
            "{stderr}"
        );
        assert!(stderr.contains("certificate"), "{stderr}");
    }
    // A CA file that holds no certificate is a usage error naming the file.
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    let output = idem(drill_args(&url, &["--ca-cert", empty.to_str().unwrap()])).await;
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("empty.pem"), "{stderr}");
}

/// A payment POSTed with curl `flag` (`--http2`, `--http1.1`): its head, lowercased, and
/// `version=` the HTTP version curl spoke.
fn curl_post(pki: &Pki, flag: &str, url: &str, key: &str) -> String {
    let output = Command::new("curl")
        .args([
            "-sS",
            flag,
            "--cacert",
            &pki.ca(),
            "-D",
            "-",
            "-o",
            "/dev/null",
        ])
        .args(["-w", "version=%{http_version}\n"])
        .args(["-H", &format!("authorization: Bearer {ALICE}")])
        .args(["-H", &format!("idempotency-key: {key}")])
        .args(["-H", "content-type: application/json"])
        .args(["--data", r#"{"amount": 1200, "currency": "EUR"}"#, url])
        .output()
        .expect("curl is installed");
    let out = text(&output.stdout).to_ascii_lowercase();
    assert!(output.status.success(), "{out}{}", text(&output.stderr));
    out
}

/// curl, asking for HTTP/2 and for HTTP/1.1: ALPN gives each what it asked for, and a retried
/// POST is a replay either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_serve_speaks_http2_and_http1_over_alpn_to_curl() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let server = serve_tls(&pki, dir.path()).await;
    let url = format!("{}/payments", by_name(&server.url));
    let key = uuid::Uuid::new_v4().to_string();
    for (flag, version, replayed) in [("--http2", "2", false), ("--http1.1", "1.1", true)] {
        let out = curl_post(&pki, flag, &url, &key);
        assert!(out.contains(&format!("version={version}\n")), "{out}");
        assert!(out.contains(" 201"), "{out}");
        assert_eq!(out.contains("idempotent-replayed: true"), replayed, "{out}");
    }
}

/// `idem proxy` over TLS in front of `idem serve` over TLS: the drill passes through both
/// hops; without the CA, the proxy cannot reach its upstream and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_https_in_front_of_an_https_upstream() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let upstream = serve_tls(&pki, dir.path()).await;
    let upstream_url = by_name(&upstream.url);
    let flags = pki.server_flags();
    let ca = pki.ca();
    // `idem proxy` with its own TLS flags, a store of its own (`NAME.db`, its log `NAME.log`)
    // and a secret, then `extra`.
    let start_proxy = |name: &str, extra: &[&str]| {
        let mut args: Vec<String> = flags.to_vec();
        args.extend([
            "--store".into(),
            format!(
                "sqlite://{}",
                dir.path().join(format!("{name}.db")).display()
            ),
        ]);
        args.extend(["--secret".into(), "a-test-secret-of-some-length".into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = dir.path().join(format!("{name}.log"));
        let (dir, upstream_url) = (dir.path(), &upstream_url);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Idem::start_proxy(dir, upstream_url, &args, log).await
        }
    };
    let proxy = start_proxy("proxy", &["--ca-cert", &ca]).await;
    assert!(proxy.url.starts_with("https://"), "{}", proxy.url);
    let url = format!("{}/payments", by_name(&proxy.url));
    let output = idem(drill_args(&url, &["--ca-cert", &ca, "--json"])).await;
    assert_drill_passed(&output);
    // An HTTP/2 client of the proxy: its request goes upstream over HTTP/1.1, and its retry
    // is a replay.
    let key = uuid::Uuid::new_v4().to_string();
    for replayed in [false, true] {
        let out = curl_post(&pki, "--http2", &url, &key);
        assert!(out.contains("version=2\n"), "{out}");
        assert!(out.contains(" 201"), "{out}");
        assert_eq!(out.contains("idempotent-replayed: true"), replayed, "{out}");
    }

    // The upstream's certificate is not trusted without --ca-cert: a 502.
    let untrusting = start_proxy("proxy2", &[]).await;
    let client = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(&std::fs::read(PathBuf::from(&ca)).unwrap()).unwrap(),
        )
        .build()
        .unwrap();
    let response = client
        .post(format!("{}/payments", by_name(&untrusting.url)))
        .bearer_auth(ALICE)
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .json(&serde_json::json!({"amount": 700, "currency": "EUR"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
}
