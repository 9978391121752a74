//! TLS for idem's servers and clients, with rustls (docs/contract.md §9).
//!
//! - [`ServerTls`]: a certificate chain and its key from PEM files, for `idem serve` and
//!   `idem proxy`; it offers HTTP/2 and HTTP/1.1 over ALPN.
//! - [`ClientTls`]: certificates checked against the platform's roots, plus private CAs from
//!   PEM files, for the gateway's upstream; idem's reqwest clients add the private CAs
//!   ([`ca_certificates`]) to reqwest's own rustls, which checks the same platform roots.
//!
//! One crypto provider, aws-lc-rs, named where each config is built: ring is also in the
//! dependency tree (through other crates), and rustls refuses to guess between two.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{what} {}: {reason}", path.display())]
    Pem {
        /// What the file should hold ("certificate", "private key", "CA certificate").
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// rustls refused the certificates or key (a key that does not match its certificate, an
    /// unsupported algorithm).
    #[error("TLS configuration refused")]
    Rustls(#[source] rustls::Error),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn pem_error(what: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::Pem {
        what,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// Every certificate in a PEM file; at least one.
fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(what, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(what, path, e))?;
    if certs.is_empty() {
        return Err(pem_error(what, path, "no CERTIFICATE block in the file"));
    }
    Ok(certs)
}

/// Every certificate in each of `ca_files` (PEM), for a client that checks the platform's
/// roots itself (reqwest) and only needs the private CAs added.
///
/// # Errors
///
/// [`TlsError::Pem`] when a file cannot be read or holds no certificate.
pub fn ca_certificates(ca_files: &[PathBuf]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let mut certs = Vec::new();
    for path in ca_files {
        certs.extend(certificates("CA certificate", path)?);
    }
    Ok(certs)
}

/// A server's certificate chain and key: what `--tls-cert FILE --tls-key FILE` give.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("alpn", &["h2", "http/1.1"])
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads the certificate chain (leaf first) and its private key (PKCS#8, PKCS#1 or SEC1)
    /// from PEM files.
    ///
    /// # Errors
    ///
    /// [`TlsError::Pem`] when a file cannot be read or holds no certificate or key, and
    /// [`TlsError::Rustls`] when rustls refuses them (a key that does not match the leaf, an
    /// unsupported algorithm).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let chain = certificates("certificate", cert)?;
        let key =
            PrivateKeyDer::from_pem_file(key).map_err(|e| pem_error("private key", key, e))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(TlsError::Rustls)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self {
            config: Arc::new(config),
        })
    }

    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }
}

/// How idem's clients check the servers they call: the platform's roots, plus private CAs
/// (`--ca-cert FILE`, repeatable).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    /// The platform's roots and every certificate in each of `ca_files` (PEM).
    ///
    /// # Errors
    ///
    /// [`TlsError::Pem`] when a file cannot be read or holds no certificate, and
    /// [`TlsError::Rustls`] when the platform's roots cannot be loaded or rustls refuses a
    /// certificate.
    pub fn new(ca_files: &[PathBuf]) -> Result<Self, TlsError> {
        let extra = ca_certificates(ca_files)?;
        let verifier = rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider())
            .map_err(TlsError::Rustls)?;
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .dangerous() // Not dangerous: the platform verifier is the safe default.
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// The platform's roots only.
    ///
    /// # Errors
    ///
    /// [`TlsError::Rustls`] when the platform's roots cannot be loaded.
    pub fn platform() -> Result<Self, TlsError> {
        Self::new(&[])
    }

    /// The rustls configuration, for a client of your own.
    pub fn config(&self) -> Arc<rustls::ClientConfig> {
        self.config.clone()
    }
}
