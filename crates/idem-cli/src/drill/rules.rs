//! What the drill holds an API to, where each rule is written, and how much each profile asks.
//!
//! Three kinds of rule, three weights:
//!
//! - **the promise**: one effect per key, the same answer to a repeat, nobody else's answer, no
//!   mismatch processed, a key that does not stay stuck. Breaking it is a `FAIL` under every
//!   profile: a client relying on the key would double-charge or be told something false.
//! - **the draft's other SHOULDs** (draft-ietf-httpapi-idempotency-key-header-06/07: 422 for
//!   a mismatch, 409 for a request in flight, 400 without a key, a published policy, keys
//!   scoped to the client): a `WARN` by default.
//! - **conventions**: Stripe's (the `Idempotent-Replayed` header, 409 with `Retry-After`,
//!   keys of at most 255 characters) and idem's own contract (docs/contract.md). Not judged,
//!   or a `WARN`, until the profile that names them makes them required.
//!
//! A profile is a claim: `--profile stripe` says "this API behaves as Stripe's does", so a
//! departure from Stripe's conventions fails it; `--profile idem` claims all of
//! docs/contract.md.

use std::fmt;

/// Which body of rules the API claims to follow: what is required, what is a warning, what
/// is not judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// The IETF draft: the promise is required, its SHOULDs and Stripe's conventions warn.
    #[default]
    Draft,
    /// Stripe's behaviour: also the replay header, 409 with `Retry-After` for a request in
    /// flight, and keys of at most 255 characters; keys may be optional.
    Stripe,
    /// idem's contract (docs/contract.md): every rule it states is required.
    Idem,
}

impl Profile {
    /// The name `--profile` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Draft => "draft",
            Self::Stripe => "stripe",
            Self::Idem => "idem",
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How much a profile asks of one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Weight {
    /// Not judged: the check does not run that part, or reports it without a verdict.
    Skipped,
    /// A departure is a `WARN`.
    Warning,
    /// A departure is a `FAIL`.
    Required,
}

/// One rule the drill checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    // --- The promise ----------------------------------------------------------------------
    /// Copies of one request with one key make one resource.
    OneEffect,
    /// A repeat of a finished request gets its answer: the same status and content.
    SameAnswer,
    /// An answer made for one caller never reaches another (another account, an unknown
    /// token, the owner after a stranger's failure).
    OwnAnswer,
    /// A changed request under a used key is not processed.
    MismatchNotProcessed,
    /// After the work ended in a 5xx, a retry is not refused as "in flight" for ever.
    NotStuck,
    // --- The draft's SHOULDs --------------------------------------------------------------
    /// The rules are published (the draft: in the documentation; idem: at a URL).
    Published,
    /// A copy that meets the original still running gets `409`.
    InFlightConflict,
    /// A POST without a key is refused with `400` (where the API requires keys).
    KeyRequired,
    /// A changed request under a used key is refused with `422`.
    MismatchStatus,
    /// Keys are scoped to the client: another account's use of a key is its own request.
    ScopedKeys,
    /// The key is one sf-string: empty values, non-ASCII, lists and repeated fields refused.
    KeySyntax,
    /// Refusals carry problem details or a link to the documentation.
    ProblemDetails,
    /// A key is new again once the published retention has passed.
    Expiry,
    // --- Conventions ----------------------------------------------------------------------
    /// A replay is marked `Idempotent-Replayed: true`.
    ReplayMarker,
    /// The `409` for a request in flight says when to retry (`Retry-After`).
    InFlightRetryAfter,
    /// Keys longer than 255 characters are refused.
    KeyMaxLength,
    /// Keys shorter than 8 characters, or with a space, are refused.
    KeyFormat,
    /// Keys outside the lengths the API publishes are refused ("validate the key as per its
    /// published specification").
    PublishedFormat,
    /// A malformed key is refused with `400` exactly.
    Malformed400,
    /// A replay carries the stored body byte for byte.
    SameBytes,
    /// JSON bodies are compared as JSON: the same members in another order are the same
    /// request.
    CanonicalJson,
    /// Refusals before any work (401, 403) are not stored against the key.
    AuthNotStored,
    /// GET requests are untouched by keys.
    GetUntouched,
}

impl Rule {
    /// Where the rule is written, as the report names it under `profile`.
    pub(crate) fn citation(self, profile: Profile) -> &'static str {
        // (the draft's or Stripe's words, idem's contract where it says the same)
        let (elsewhere, idem) = match self {
            Self::OneEffect | Self::SameAnswer => ("draft §2.6", "idem contract §2.1"),
            Self::NotStuck => ("draft §2.6", "idem contract §2.6"),
            Self::OwnAnswer | Self::ScopedKeys => ("draft §5", "idem contract §2.3"),
            Self::MismatchNotProcessed | Self::MismatchStatus => {
                ("draft §2.7", "idem contract §2.1")
            }
            Self::Published => ("draft §2.5", "idem contract §2.9"),
            Self::InFlightConflict => ("draft §2.7", "idem contract §2.1"),
            Self::KeyRequired => ("draft §2.7", "idem contract §2.1"),
            Self::KeySyntax => ("draft §2.1", "idem contract §2.2"),
            Self::ProblemDetails => ("draft §2.7", "idem contract §2.8"),
            Self::Expiry => ("draft §2.3", "idem contract §2.1"),
            Self::ReplayMarker | Self::InFlightRetryAfter => {
                ("Stripe convention", "idem contract §2.1")
            }
            Self::KeyMaxLength => ("Stripe convention", "idem contract §2.2"),
            Self::KeyFormat => ("idem contract §2.2", "idem contract §2.2"),
            Self::PublishedFormat => ("draft §5", "idem contract §2.2"),
            Self::Malformed400 | Self::SameBytes | Self::GetUntouched => {
                ("idem contract §2.1", "idem contract §2.1")
            }
            Self::CanonicalJson => ("idem contract §2.4", "idem contract §2.4"),
            Self::AuthNotStored => ("idem contract §2.5", "idem contract §2.5"),
        };
        if profile == Profile::Idem {
            idem
        } else {
            elsewhere
        }
    }

    /// How much `profile` asks of the rule.
    pub(crate) fn weight(self, profile: Profile) -> Weight {
        use Weight::{Required, Skipped, Warning};
        if self.is_promise() || profile == Profile::Idem {
            return Required;
        }
        let stripe = profile == Profile::Stripe;
        match self {
            Self::ReplayMarker | Self::InFlightConflict if stripe => Required,
            Self::InFlightRetryAfter | Self::KeyMaxLength if stripe => Required,
            Self::ReplayMarker | Self::InFlightConflict => Warning,
            // Stripe's keys are optional and its errors are its own JSON.
            Self::KeyRequired | Self::ProblemDetails if stripe => Skipped,
            Self::Published
            | Self::KeyRequired
            | Self::MismatchStatus
            | Self::ScopedKeys
            | Self::KeySyntax
            | Self::PublishedFormat
            | Self::ProblemDetails
            | Self::Expiry
            | Self::AuthNotStored
            | Self::GetUntouched => Warning,
            // The draft leaves these to the server (a byte checksum is a fingerprint it
            // names; it sets no key length): judged under the profiles that state them.
            Self::InFlightRetryAfter
            | Self::KeyMaxLength
            | Self::KeyFormat
            | Self::Malformed400
            | Self::SameBytes
            | Self::CanonicalJson => Skipped,
            Self::OneEffect
            | Self::SameAnswer
            | Self::OwnAnswer
            | Self::MismatchNotProcessed
            | Self::NotStuck => Required,
        }
    }

    /// Whether breaking the rule breaks what a key promises, whatever the profile.
    pub(crate) fn is_promise(self) -> bool {
        matches!(
            self,
            Self::OneEffect
                | Self::SameAnswer
                | Self::OwnAnswer
                | Self::MismatchNotProcessed
                | Self::NotStuck
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Rule; 23] = [
        Rule::OneEffect,
        Rule::SameAnswer,
        Rule::OwnAnswer,
        Rule::MismatchNotProcessed,
        Rule::NotStuck,
        Rule::Published,
        Rule::InFlightConflict,
        Rule::KeyRequired,
        Rule::MismatchStatus,
        Rule::ScopedKeys,
        Rule::KeySyntax,
        Rule::ProblemDetails,
        Rule::Expiry,
        Rule::ReplayMarker,
        Rule::InFlightRetryAfter,
        Rule::KeyMaxLength,
        Rule::KeyFormat,
        Rule::PublishedFormat,
        Rule::Malformed400,
        Rule::SameBytes,
        Rule::CanonicalJson,
        Rule::AuthNotStored,
        Rule::GetUntouched,
    ];

    #[test]
    fn the_promise_is_required_under_every_profile() {
        for profile in [Profile::Draft, Profile::Stripe, Profile::Idem] {
            for rule in ALL.iter().filter(|r| r.is_promise()) {
                assert_eq!(rule.weight(profile), Weight::Required, "{rule:?} {profile}");
            }
        }
    }

    #[test]
    fn under_the_draft_only_the_promise_fails() {
        for rule in ALL.iter().filter(|r| !r.is_promise()) {
            assert!(rule.weight(Profile::Draft) < Weight::Required, "{rule:?}");
        }
        assert_eq!(Rule::ReplayMarker.weight(Profile::Draft), Weight::Warning);
        assert_eq!(Rule::MismatchStatus.weight(Profile::Draft), Weight::Warning);
        assert_eq!(Rule::SameBytes.weight(Profile::Draft), Weight::Skipped);
    }

    #[test]
    fn stripe_requires_its_conventions_and_idem_requires_everything() {
        for rule in [
            Rule::ReplayMarker,
            Rule::InFlightConflict,
            Rule::InFlightRetryAfter,
            Rule::KeyMaxLength,
        ] {
            assert_eq!(rule.weight(Profile::Stripe), Weight::Required, "{rule:?}");
        }
        assert_eq!(Rule::KeyRequired.weight(Profile::Stripe), Weight::Skipped);
        assert!(
            ALL.iter()
                .all(|r| r.weight(Profile::Idem) == Weight::Required)
        );
    }

    #[test]
    fn each_rule_names_where_it_is_written() {
        assert_eq!(Rule::OneEffect.citation(Profile::Draft), "draft §2.6");
        assert_eq!(Rule::MismatchStatus.citation(Profile::Draft), "draft §2.7");
        assert_eq!(
            Rule::ReplayMarker.citation(Profile::Draft),
            "Stripe convention"
        );
        assert_eq!(
            Rule::ReplayMarker.citation(Profile::Idem),
            "idem contract §2.1"
        );
        for profile in [Profile::Draft, Profile::Stripe, Profile::Idem] {
            for rule in ALL {
                assert!(!rule.citation(profile).is_empty());
            }
        }
    }
}
