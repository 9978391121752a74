//! `idem proxy` in front of a gRPC upstream (tonic, without idem): clients speak h2c to the
//! gateway, which speaks h2c or HTTP/2 over TLS (ALPN `h2`) to the upstream and applies the
//! same rules as the layer.

use std::net::SocketAddr;
use std::path::PathBuf;

use idem_gateway::{ClientTls, GatewayConfig, Secret};
use idem_grpc_tests::{Effects, Payments, PaymentsServer};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
};
use tonic::Code;
use tonic::transport::{Identity, ServerTlsConfig};

use crate::{LedgerTrailer, call, client, create, replayed};
use idem_testkit::grpcio::{assert_one_payment_per_key, grpcio};

/// A CA of the test's own and a certificate it signed for `localhost`, as PEM files.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name = name("idem grpc test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        leaf.distinguished_name = name("localhost");
        let leaf = leaf.signed_by(&key, &ca).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("server.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.path().join("server.key"), key.serialize_pem()).unwrap();
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(
            std::fs::read(self.path("server.pem")).unwrap(),
            std::fs::read(self.path("server.key")).unwrap(),
        )
    }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

/// The gRPC upstream: [`Payments`] on tonic with no idem in front, in clear text (h2c) or
/// over TLS with `pki`'s certificate.
struct Upstream {
    url: String,
    payments: Payments,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn upstream(pki: Option<&Pki>) -> Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let payments = Payments::new(Effects::Memory);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut builder = tonic::transport::Server::builder();
    let url = match pki {
        Some(pki) => {
            // tonic's TLS asks rustls for the process's provider, which rustls cannot guess
            // when the build carries two (aws-lc-rs, idem's, and ring through other crates).
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
            builder = builder
                .tls_config(ServerTlsConfig::new().identity(pki.identity()))
                .unwrap();
            format!("https://localhost:{port}")
        }
        None => format!("http://127.0.0.1:{port}"),
    };
    let router = builder
        .layer(tower::layer::layer_fn(LedgerTrailer))
        .add_service(PaymentsServer::new(payments.clone()));
    tokio::spawn(router.serve_with_incoming_shutdown(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        async {
            let _ = stopped.await;
        },
    ));
    Upstream {
        url,
        payments,
        _stop: stop,
    }
}

/// `idem proxy` (the library under it) on SQLite in front of `upstream`, trusting `pki`'s CA.
struct Gateway {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn gateway(upstream: &str, pki: Option<&Pki>) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_store::SqliteStore::open(dir.path().join("gateway.db"))
        .await
        .unwrap();
    let mut config = GatewayConfig::new(
        upstream.parse().unwrap(),
        Secret::new(*b"a-test-secret-of-32-bytes-000000").unwrap(),
    )
    .unwrap();
    if let Some(pki) = pki {
        config.upstream_tls = ClientTls::new(&[pki.path("ca.pem")]).unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(idem_gateway::serve(listener, store, config, async {
        let _ = stopped.await;
    }));
    Gateway {
        addr,
        _dir: dir,
        _stop: stop,
    }
}

/// Through the gateway, a gRPC call gets what it would get from the layer: one run, a replay
/// with the message, the trailers and the mark, a mismatch as `FAILED_PRECONDITION`, a
/// business error stored, a transient one not.
async fn the_contract_holds_through(upstream: Upstream, gateway: Gateway) {
    let mut client = client(gateway.addr).await;
    let (first, first_meta) = call(&mut client, create(Some("gw-key-0001"), 100, ""))
        .await
        .unwrap();
    assert!(!replayed(&first_meta));
    assert_eq!(first_meta.get("x-ledger-entry").unwrap(), "led_42");
    let (again, again_meta) = call(&mut client, create(Some("gw-key-0001"), 100, ""))
        .await
        .unwrap();
    assert_eq!(again, first);
    assert!(replayed(&again_meta));
    assert_eq!(again_meta.get("x-ledger-entry").unwrap(), "led_42");
    assert_eq!(upstream.payments.runs(Some("gw-key-0001")), 1);

    let mismatch = call(&mut client, create(Some("gw-key-0001"), 999, ""))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), Code::FailedPrecondition, "{mismatch:?}");

    for n in 0..2 {
        let declined = call(&mut client, create(Some("gw-key-0002"), 100, "decline"))
            .await
            .unwrap_err();
        assert_eq!(declined.code(), Code::FailedPrecondition);
        assert_eq!(declined.details(), b"declined: insufficient funds");
        assert_eq!(replayed(declined.metadata()), n == 1);
    }
    assert_eq!(upstream.payments.runs(Some("gw-key-0002")), 1);

    for _ in 0..2 {
        let down = call(&mut client, create(Some("gw-key-0003"), 100, "unavailable")).await;
        assert_eq!(down.unwrap_err().code(), Code::Unavailable);
    }
    assert_eq!(upstream.payments.runs(Some("gw-key-0003")), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_applies_the_contract_to_an_h2c_grpc_upstream() {
    let upstream = upstream(None).await;
    let gateway = gateway(&upstream.url, None).await;
    the_contract_holds_through(upstream, gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_applies_the_contract_to_a_grpc_upstream_over_tls() {
    let pki = Pki::new();
    let upstream = upstream(Some(&pki)).await;
    let gateway = gateway(&upstream.url, Some(&pki)).await;
    the_contract_holds_through(upstream, gateway).await;
}

/// An upstream the gateway cannot reach: `UNAVAILABLE`, and the key is free for the retry.
#[tokio::test]
async fn an_unreachable_grpc_upstream_is_unavailable() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let gateway = gateway(&url, None).await;
    let mut client = client(gateway.addr).await;
    for _ in 0..2 {
        let status = call(&mut client, create(Some("gw-key-down"), 100, ""))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status
                .message()
                .starts_with("urn:idem:problem:upstream-unavailable")
        );
        assert!(!replayed(status.metadata()));
    }
}

/// grpcio with its retry policy through the gateway, to an h2c and a TLS upstream: copies of
/// one key that find it in use get `ABORTED` with a pushback, and come back for the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpcio_retries_through_the_gateway_make_one_payment_per_key() {
    let pki = Pki::new();
    for tls in [false, true] {
        let upstream = upstream(tls.then_some(&pki)).await;
        let gateway = gateway(&upstream.url, tls.then_some(&pki)).await;
        let prefix = if tls { "py-gw-tls" } else { "py-gw-h2c" };
        let results = grpcio(
            &gateway.addr.to_string(),
            &["--keys", "20", "--copies", "4", "--prefix", prefix],
        )
        .await;
        let label = format!("grpcio through idem proxy, {prefix}");
        for key in assert_one_payment_per_key(&label, &results) {
            assert_eq!(upstream.payments.made(Some(&key)), 1, "{key}");
        }
    }
}
