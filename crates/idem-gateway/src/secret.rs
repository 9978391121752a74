//! The gateway's server secret: the HMAC key that turns credentials into account scopes.

use std::fmt;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use rand::RngCore;
use sha2::Sha256;

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
    /// The secret file could not be read or created.
    #[error("cannot use the secret file {path}")]
    File {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl Secret {
    /// Wraps a secret given on the command line or in the environment.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        let bytes = bytes.into();
        if bytes.len() < 16 {
            return Err(SecretError::TooShort);
        }
        let keyed = Hmac::<Sha256>::new_from_slice(&bytes).expect("HMAC takes any key length");
        Ok(Self(Arc::new(keyed)))
    }

    /// Reads the secret from `path`, or, when the file does not exist, generates 32 random
    /// bytes and keeps them there (mode 0600) so scopes survive restarts.
    pub fn load_or_create(path: &Path) -> Result<Self, SecretError> {
        let file_error = |source| SecretError::File {
            path: path.display().to_string(),
            source,
        };
        match std::fs::read_to_string(path) {
            Ok(text) => return Self::new(text.trim().as_bytes().to_vec()),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(file_error(e)),
            Err(_) => {}
        }
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        let text = hex::encode(bytes);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        match options.open(path) {
            Ok(mut file) => {
                file.write_all(text.as_bytes()).map_err(file_error)?;
                file.sync_all().map_err(file_error)?;
                tracing::info!(path = %path.display(), "generated a new gateway secret");
                Self::new(text.into_bytes())
            }
            // Another instance created it first: use theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Self::load_or_create(path),
            Err(e) => Err(file_error(e)),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_once_then_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let first = Secret::load_or_create(&path).unwrap();
        let again = Secret::load_or_create(&path).unwrap();
        assert_eq!(first.hmac_hex(&[b"x"]), again.hmac_hex(&[b"x"]));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

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
