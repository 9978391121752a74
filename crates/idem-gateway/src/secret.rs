//! The gateway's server secret: the HMAC key that turns credentials into account scopes.
//!
//! Gateways that share a store must derive the same scope from the same credential, or a retry
//! that reaches another instance is a new request and runs again. So by default the secret
//! lives in the store ([`Secret::shared`]): the first gateway to start makes it
//! (insert-if-absent) and every other reads it. One given explicitly ([`Secret::new`], from
//! `--secret` or a file) is used as it is, and kept out of the store.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use idem_store::SharedSecret;
use rand::RngCore;
use sha2::Sha256;

/// The name of the scope secret among a store's shared secrets.
pub const SCOPE_SECRET: &str = "idem-proxy-scope";

/// The secret the gateway keys its HMACs with. Never printed.
///
/// It is kept as the HMAC already keyed with it, shared by every clone: each request
/// starts from a copy of that state instead of hashing the key again, and the gateway's
/// services (cloned for every request) copy no bytes of it.
#[derive(Clone)]
pub struct Secret(Arc<Hmac<Sha256>>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why the secret could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// The secret is too short to be a key.
    #[error("the secret must be at least 16 bytes")]
    TooShort,
    /// The secret file could not be read.
    #[error("cannot read the secret file {path}")]
    File {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store could not keep or give the shared secret.
    #[error("cannot read or store the gateway's secret in the store")]
    Store(#[source] idem_store::Error),
}

/// Where the secret of [`Secret::shared`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SecretOrigin {
    /// Made now and stored: the first gateway on this store.
    Created,
    /// Read from the store, where a gateway put it before.
    Store,
    /// An earlier version's secret file, moved into the store (which held none), so the
    /// records made under it keep their scopes.
    File(PathBuf),
    /// The store's secret, which differs from the secret file's: the file was this instance's
    /// own while another instance's secret went into the store. Records this instance made
    /// under the file's secret are no longer found, until their retention ends.
    StoreOverFile(PathBuf),
}

impl Secret {
    /// Wraps a secret given on the command line or in the environment.
    ///
    /// # Errors
    ///
    /// [`SecretError::TooShort`] when `bytes` has fewer than 16 bytes.
    ///
    /// # Panics
    ///
    /// Never: HMAC takes a key of any length.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        let bytes = bytes.into();
        if bytes.len() < 16 {
            return Err(SecretError::TooShort);
        }
        let keyed = Hmac::<Sha256>::new_from_slice(&bytes).expect("HMAC takes any key length");
        Ok(Self(Arc::new(keyed)))
    }

    /// The secret every gateway on `store` shares: the store's, or, on the first start, one
    /// made now and stored there (insert-if-absent, so of gateways starting together one
    /// makes it and the others read it).
    ///
    /// `legacy_file` is where earlier versions kept a secret of their own (`idem-proxy.secret`):
    /// when it exists and the store holds no secret yet, its secret goes into the store, so
    /// the records made under it keep their scopes. When the store holds another, the store's
    /// wins (every instance must agree), and [`SecretOrigin::StoreOverFile`] says so. Nothing
    /// is written to the file.
    ///
    /// # Errors
    ///
    /// [`SecretError::File`] when `legacy_file` exists but cannot be read,
    /// [`SecretError::Store`] when the store cannot keep or give the secret, and
    /// [`SecretError::TooShort`] when the secret found is shorter than 16 bytes.
    pub async fn shared<St: SharedSecret>(
        store: &St,
        legacy_file: &Path,
    ) -> Result<(Self, SecretOrigin), SecretError> {
        let from_file = match read_file(legacy_file) {
            Ok(text) => Some(text),
            Err(SecretError::File { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                None
            }
            Err(e) => return Err(e),
        };
        let candidate = match &from_file {
            Some(text) => text.clone(),
            None => {
                let mut bytes = [0u8; 32];
                rand::rng().fill_bytes(&mut bytes);
                hex::encode(bytes)
            }
        };
        let shared = store
            .share_secret(SCOPE_SECRET, &candidate)
            .await
            .map_err(SecretError::Store)?;
        let file = || legacy_file.to_path_buf();
        let origin = match (
            from_file.is_some(),
            shared.value == candidate,
            shared.inserted,
        ) {
            (false, _, true) => SecretOrigin::Created,
            (true, true, true) => SecretOrigin::File(file()),
            // The file's secret went into the store at an earlier start (or every instance
            // had the same file).
            (_, true, false) | (false, false, false) => SecretOrigin::Store,
            (true, false, _) => SecretOrigin::StoreOverFile(file()),
        };
        Ok((Self::new(shared.value.into_bytes())?, origin))
    }

    /// Whether `store` holds a shared secret other than `given` (a secret given explicitly):
    /// gateways on that store started without one use the store's, and so derive other scopes
    /// than a gateway with `given`.
    ///
    /// # Errors
    ///
    /// [`SecretError::Store`] when the store cannot be read.
    pub async fn differs_from_store<St: SharedSecret>(
        store: &St,
        given: &[u8],
    ) -> Result<bool, SecretError> {
        let stored = store
            .read_secret(SCOPE_SECRET)
            .await
            .map_err(SecretError::Store)?;
        Ok(stored.is_some_and(|stored| stored.as_bytes() != given))
    }

    /// The secret the gateways on `store` share, if one is stored there; stores nothing. For
    /// tools that find a caller's records (`idem keys --credential`) without being a gateway.
    ///
    /// # Errors
    ///
    /// [`SecretError::Store`] when the store cannot be read, and [`SecretError::TooShort`]
    /// when the stored secret is shorter than 16 bytes.
    pub async fn stored<St: SharedSecret>(store: &St) -> Result<Option<Self>, SecretError> {
        let stored = store
            .read_secret(SCOPE_SECRET)
            .await
            .map_err(SecretError::Store)?;
        stored
            .map(|value| Self::new(value.into_bytes()))
            .transpose()
    }

    /// The account a gateway with this secret files a caller under whose credential header
    /// (`Authorization` by default) carries `value`, with no `--scope-header`: what an
    /// operator looks a caller's keys up by.
    pub fn header_credential_account(&self, value: &[u8]) -> idem_core::AccountId {
        self.account(&[b"idem-scope", value])
    }

    /// The account of a caller whose scope hashes `parts`: `hmac:` and the HMAC's first 32
    /// hex digits.
    pub(crate) fn account(&self, parts: &[&[u8]]) -> idem_core::AccountId {
        idem_core::AccountId::new(format!("hmac:{}", &self.hmac_hex(parts)[..32]))
    }

    /// A short name of the secret that gives nothing of it away (an HMAC of a fixed text under
    /// it): the same in every gateway that has the same secret, for logs and checks.
    pub fn id(&self) -> String {
        self.hmac_hex(&[b"idem-secret-id"])[..12].to_owned()
    }

    /// HMAC-SHA256 of `parts` (length-prefixed, so no two lists collide), hex-encoded.
    pub(crate) fn hmac_hex(&self, parts: &[&[u8]]) -> String {
        let mut mac = Hmac::<Sha256>::clone(&self.0);
        for part in parts {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        hex::encode(mac.finalize().into_bytes())
    }
}

/// The text of the secret file at `path`, trimmed.
fn read_file(path: &Path) -> Result<String, SecretError> {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_owned())
        .map_err(|source| SecretError::File {
            path: path.display().to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn different_secrets_give_different_scopes() {
        let a = Secret::new(b"0123456789abcdef".to_vec()).unwrap();
        let b = Secret::new(b"0123456789abcdeX".to_vec()).unwrap();
        assert_ne!(a.hmac_hex(&[b"Bearer t"]), b.hmac_hex(&[b"Bearer t"]));
        assert_ne!(a.hmac_hex(&[b"ab", b"c"]), a.hmac_hex(&[b"a", b"bc"]));
        assert!(matches!(
            Secret::new(b"short".to_vec()),
            Err(SecretError::TooShort)
        ));
    }
}
