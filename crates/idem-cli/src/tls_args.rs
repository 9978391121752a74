//! The TLS flags shared by idem's commands (docs/contract.md §9): `--tls-cert`/`--tls-key` for
//! the servers, `--ca-cert` for the clients.

use std::path::PathBuf;

use anyhow::Context as _;
use idem_gateway::{ClientTls, ServerTls};

/// `--tls-cert FILE --tls-key FILE`: serve HTTPS (HTTP/2 and HTTP/1.1 over ALPN).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServerTlsArgs {
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// The certificate and key, read now so a bad file stops the start, not the first client.
    pub fn load(&self) -> anyhow::Result<Option<ServerTls>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(
                ServerTls::from_pem_files(cert, key).context("--tls-cert/--tls-key")?,
            )),
            _ => Ok(None),
        }
    }
}

/// `--ca-cert FILE`: trust a private CA beside the platform's roots.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClientTlsArgs {
    /// Trust the CA certificates in this PEM file too, beside the platform's roots; repeatable.
    #[arg(long = "ca-cert", value_name = "FILE")]
    pub ca_certs: Vec<PathBuf>,
}

impl ClientTlsArgs {
    /// The verifier these flags ask for.
    pub fn load(&self) -> anyhow::Result<ClientTls> {
        ClientTls::new(&self.ca_certs).context("--ca-cert")
    }
}

/// A reqwest client builder that checks `https://` certificates against reqwest's rustls
/// with the platform's roots, plus the CAs in `ca_files` (PEM).
pub fn reqwest_builder(ca_files: &[PathBuf]) -> anyhow::Result<reqwest::ClientBuilder> {
    let mut builder = reqwest::Client::builder();
    for der in idem_gateway::tls::ca_certificates(ca_files).context("--ca-cert")? {
        let cert = reqwest::Certificate::from_der(&der).context("a --ca-cert certificate")?;
        builder = builder.add_root_certificate(cert);
    }
    Ok(builder)
}
