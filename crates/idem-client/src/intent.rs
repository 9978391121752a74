//! One thing the caller wants done once: a request and the key every attempt of it carries.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use http::{HeaderMap, Method};
use idem_core::{IdempotencyKey, KeyLimits};
use uuid::Uuid;

/// A request to be done once, however many attempts it takes.
///
/// Its idempotency key is made when the intent is (a UUID v4) and sent unchanged, as an
/// RFC 9651 sf-string (`Idempotency-Key: "…"`, the IETF draft's form), on every attempt. Keys
/// come from the operating system's randomness, never from the client's seedable RNG: two
/// processes started with the same seed must not send the same keys, or one would be handed
/// the other's stored response.
#[derive(Debug, Clone)]
pub struct Intent {
    pub(crate) method: Method,
    pub(crate) url: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) key: Option<IdempotencyKey>,
}

impl Intent {
    /// An intent to send `method` to `url` with an empty body and a fresh key.
    pub fn new(method: Method, url: impl Into<String>) -> Self {
        Self {
            method,
            url: url.into(),
            headers: HeaderMap::new(),
            body: Bytes::new(),
            key: Some(new_key()),
        }
    }

    /// An intent to `POST` to `url`, with a fresh key.
    pub fn post(url: impl Into<String>) -> Self {
        Self::new(Method::POST, url)
    }

    /// Adds a header to every attempt. An `Idempotency-Key` given here is replaced by the
    /// intent's key, unless the intent has none ([`Intent::without_key`]).
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    /// Sets the body sent by every attempt.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// Sets a JSON body and `Content-Type: application/json`.
    pub fn json(mut self, value: &serde_json::Value) -> Self {
        self.headers
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        self.body(value.to_string())
    }

    /// Uses `key` instead of the generated one, for a caller that keeps its keys (in its own
    /// database, say) across restarts.
    pub fn with_key(mut self, key: IdempotencyKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Sends no key at all: retries are then plain duplicates, which is what a simulator needs
    /// to show what idempotency keys prevent.
    pub fn without_key(mut self) -> Self {
        self.key = None;
        self
    }

    /// The key every attempt carries, if any.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }
}

fn new_key() -> IdempotencyKey {
    IdempotencyKey::new(Uuid::new_v4().to_string(), KeyLimits::default())
        .expect("a UUID is 36 characters of visible ASCII, within the default limits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_intent_gets_its_own_uuid_v4_key() {
        let a = Intent::post("http://127.0.0.1/x");
        let b = Intent::post("http://127.0.0.1/x");
        let key = a.key().unwrap().as_str();
        assert_eq!(Uuid::parse_str(key).unwrap().get_version_num(), 4);
        assert_ne!(a.key(), b.key());
    }

    #[test]
    fn a_clone_keeps_the_key() {
        let a = Intent::post("http://127.0.0.1/x");
        assert_eq!(a.clone().key(), a.key());
    }

    #[test]
    fn keys_can_be_chosen_or_dropped() {
        let key = IdempotencyKey::new("order-0001", KeyLimits::default()).unwrap();
        let chosen = Intent::post("http://127.0.0.1/x").with_key(key.clone());
        assert_eq!(chosen.key(), Some(&key));
        assert_eq!(chosen.without_key().key(), None);
    }

    #[test]
    fn json_sets_body_and_content_type() {
        let intent = Intent::post("http://127.0.0.1/x").json(&serde_json::json!({"amount": 5}));
        assert_eq!(intent.body, Bytes::from_static(br#"{"amount":5}"#));
        assert_eq!(intent.headers[CONTENT_TYPE], "application/json");
    }
}
