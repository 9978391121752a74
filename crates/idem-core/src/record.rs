//! Records and their state machine, and the one decision every request goes through.
//!
//! ```text
//!            claim                     complete (token matches)
//!   (none) ────────▶ InProgress ─────────────────────────────▶ Completed
//!     ▲                 │  │                                        │
//!     │     release     │  │ lease runs out: taken over             │ retention ends
//!     └─────────────────┘  └──▶ InProgress (new token)              ▼
//!     ▲                                                          Expired ─▶ claimed anew
//!     └──────────────────────────── sweeper deletes ◀───────────────┘
//! ```
//!
//! Only a completed record expires. An in-progress record whose lease ran out holds an outcome
//! nobody knows (the work may have happened): it stays until it is completed (late, or by a
//! reconciler or an operator), released, or taken over by the same request where takeover is
//! allowed, never handed to a fresh claim because its retention passed. Retention counts from
//! the outcome: a completion moves `expires_at` to the completion time plus the retention.
//!
//! In transaction mode the `InProgress` row never commits: other transactions see no row, or a
//! `Completed` one.

use std::time::Duration;

use crate::{Fingerprint, Scope, Timestamp};

/// Identifies one claim of a key. Only the holder of the current token may store an outcome,
/// so a worker that lost its lease (paused, partitioned) cannot overwrite its successor's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub i64);

/// A response kept for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// The allow-listed headers, in order, names in lower case; then the trailers, each name
    /// prefixed with [`TRAILER_PREFIX`] (see [`trailers`](Self::trailers)).
    pub headers: Vec<(String, String)>,
    /// The body bytes (empty when omitted).
    pub body: Vec<u8>,
    /// The body was larger than the storage cap and was not kept.
    pub body_omitted: bool,
}

/// Marks a stored field as a trailer (`trailer:grpc-status`): a name no header field can have,
/// since `:` is not allowed in one, so trailers live among the headers and every store keeps
/// them without a schema of its own, and a reader that knows nothing of trailers skips them.
pub const TRAILER_PREFIX: &str = "trailer:";

impl StoredResponse {
    /// The stored header fields, trailers left out.
    pub fn header_fields(&self) -> impl Iterator<Item = (&str, &str)> {
        self.headers
            .iter()
            .filter(|(name, _)| !name.starts_with(TRAILER_PREFIX))
            .map(|(name, value)| (name.as_str(), value.as_str()))
    }

    /// The stored trailers (a gRPC call's `grpc-status`, `grpc-message` and the like), names
    /// without their prefix.
    pub fn trailers(&self) -> impl Iterator<Item = (&str, &str)> {
        self.headers
            .iter()
            .filter_map(|(name, value)| Some((name.strip_prefix(TRAILER_PREFIX)?, value.as_str())))
    }

    /// Keeps the trailer `name: value`.
    pub fn push_trailer(&mut self, name: &str, value: &str) {
        self.headers
            .push((format!("{TRAILER_PREFIX}{name}"), value.to_owned()));
    }
}

/// Where a record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed; the outcome is not known yet.
    InProgress {
        /// Until when the claim holds without renewal.
        lease_until: Timestamp,
        /// The current claim.
        token: FencingToken,
    },
    /// Finished; replays return this.
    Completed(StoredResponse),
}

/// One key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// (account, key).
    pub scope: Scope,
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// Where it stands.
    pub state: RecordState,
    /// When it was claimed.
    pub created_at: Timestamp,
    /// When the key may be used afresh, once completed: the claim's time plus the retention,
    /// moved to the completion time plus the retention when the outcome is stored. An
    /// in-progress record never expires.
    pub expires_at: Timestamp,
}

/// One thing an operator or a reconciler did to a key: its history, as a store keeps it
/// (`AdminStore::record_event` in idem-store). Only these rare operations write one; the
/// requests' own claims, renewals and completions never do, so keeping a history costs the
/// request path nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordEvent {
    /// When, by the writer's clock (Unix milliseconds).
    pub at: Timestamp,
    /// What happened, for people: `resolved: completed with status 201`, `resolved: released`,
    /// `reconciled: completed with status 201`, `reconciled: released`.
    pub what: String,
    /// Who did it: `idem keys (CLI)`, `admin API`, `console`, `reconciler`.
    pub by: String,
}

/// What to do with a request, given the record its key names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<'a> {
    /// No record: claim the key and do the work.
    Fresh,
    /// A completed record past its retention: the key is new again.
    Expired,
    /// The same request finished before: answer with its response.
    Replay(&'a StoredResponse),
    /// The same key with a different request: `422`.
    Mismatch,
    /// The same request is still running: `409`, or wait.
    InFlight {
        /// How long until its lease runs out, rounded up to whole seconds, at least one.
        retry_after: Duration,
    },
    /// The same request was claimed but its lease ran out (its worker crashed or stalled): the
    /// outcome is unknown until it is taken over or reconciled.
    LeaseExpired {
        /// The stale claim's token.
        token: FencingToken,
    },
}

impl Decision<'_> {
    /// Whether a store may (atomically) replace the record with a new claim.
    pub fn allows_claim(&self) -> bool {
        matches!(self, Decision::Fresh | Decision::Expired)
    }
}

/// The decision for a request with `fingerprint` at `now`, given the record its scope names.
///
/// Expiry comes first (a completed record past its retention is new whatever it held), then
/// the fingerprint (a different request is a mismatch even while the original runs), then the
/// state. An in-progress record never expires, however old: its outcome is unknown until it is
/// resolved, and a fresh claim could run the work a second time.
///
/// ```
/// use idem_core::{decide, Decision, Fingerprint, RequestParts};
/// let fp = Fingerprint::compute(&RequestParts {
///     account: "a", method: "POST", route: "/p", query: "", content_type: "", body: b"",
/// })?;
/// assert_eq!(decide(None, &fp, idem_core::Timestamp(0)), Decision::Fresh);
/// # Ok::<(), idem_core::JsonError>(())
/// ```
pub fn decide<'a>(
    existing: Option<&'a Record>,
    fingerprint: &Fingerprint,
    now: Timestamp,
) -> Decision<'a> {
    let Some(record) = existing else {
        return Decision::Fresh;
    };
    if matches!(record.state, RecordState::Completed(_)) && record.expires_at <= now {
        return Decision::Expired;
    }
    if record.fingerprint != *fingerprint {
        return Decision::Mismatch;
    }
    match &record.state {
        RecordState::Completed(response) => Decision::Replay(response),
        RecordState::InProgress { lease_until, .. } if *lease_until > now => {
            let wait = now.until(*lease_until);
            Decision::InFlight {
                retry_after: Duration::from_secs(wait.as_millis().div_ceil(1000).max(1) as u64),
            }
        }
        RecordState::InProgress { token, .. } => Decision::LeaseExpired { token: *token },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AccountId, IdempotencyKey, KeyLimits, RequestParts};

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::compute(&RequestParts {
            account: "a",
            method: "POST",
            route: "/p",
            query: "",
            content_type: "application/json",
            body: body.as_bytes(),
        })
        .unwrap()
    }

    fn record(state: RecordState) -> Record {
        Record {
            scope: Scope::new(
                AccountId::new("a"),
                IdempotencyKey::new("key-0001", KeyLimits::default()).unwrap(),
            ),
            fingerprint: fp("1"),
            state,
            created_at: Timestamp(0),
            expires_at: Timestamp(100_000),
        }
    }

    fn done() -> RecordState {
        RecordState::Completed(StoredResponse {
            status: 201,
            headers: vec![],
            body: b"{}".to_vec(),
            body_omitted: false,
        })
    }

    fn running(lease_until: i64) -> RecordState {
        RecordState::InProgress {
            lease_until: Timestamp(lease_until),
            token: FencingToken(7),
        }
    }

    #[test]
    fn trailers_are_kept_among_the_headers_and_read_apart() {
        let mut stored = StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), "application/grpc".into())],
            body: vec![],
            body_omitted: false,
        };
        stored.push_trailer("grpc-status", "0");
        stored.push_trailer("x-ledger", "l-1");
        assert_eq!(
            stored.header_fields().collect::<Vec<_>>(),
            [("content-type", "application/grpc")]
        );
        assert_eq!(
            stored.trailers().collect::<Vec<_>>(),
            [("grpc-status", "0"), ("x-ledger", "l-1")]
        );
        assert_eq!(stored.headers[1].0, "trailer:grpc-status");
    }

    #[test]
    fn each_outcome() {
        let completed = record(done());
        assert!(matches!(
            decide(Some(&completed), &fp("1"), Timestamp(5)),
            Decision::Replay(r) if r.status == 201
        ));
        assert_eq!(
            decide(Some(&completed), &fp("2"), Timestamp(5)),
            Decision::Mismatch
        );
        assert_eq!(
            decide(Some(&completed), &fp("2"), Timestamp(100_000)),
            Decision::Expired
        );
        let in_flight = record(running(2_500));
        assert_eq!(
            decide(Some(&in_flight), &fp("1"), Timestamp(1_000)),
            Decision::InFlight {
                retry_after: Duration::from_secs(2)
            }
        );
        assert_eq!(
            decide(Some(&in_flight), &fp("2"), Timestamp(1_000)),
            Decision::Mismatch
        );
        assert_eq!(
            decide(Some(&in_flight), &fp("1"), Timestamp(2_500)),
            Decision::LeaseExpired {
                token: FencingToken(7)
            }
        );
    }

    #[test]
    fn a_live_lease_outlasts_retention() {
        // A claim still running when retention ends must not be handed to a second worker.
        let mut r = record(running(200_000));
        r.expires_at = Timestamp(100_000);
        assert!(matches!(
            decide(Some(&r), &fp("1"), Timestamp(150_000)),
            Decision::InFlight { .. }
        ));
    }

    #[test]
    fn an_unknown_outcome_never_expires() {
        // Its lease ran out long ago and its retention too: the work may have happened, so
        // the same request learns that the outcome is unknown and any other is a mismatch.
        let r = record(running(2_500));
        let much_later = Timestamp(100_000_000);
        assert_eq!(
            decide(Some(&r), &fp("1"), much_later),
            Decision::LeaseExpired {
                token: FencingToken(7)
            }
        );
        assert_eq!(decide(Some(&r), &fp("2"), much_later), Decision::Mismatch);
        assert!(!decide(Some(&r), &fp("2"), much_later).allows_claim());
    }
}
