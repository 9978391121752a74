//! The checks of docs/contract.md §7, in the order they run. Each sends real requests and turns
//! what came back into one [`Check`]: what the drill saw, and each departure from a rule,
//! judged under the profile (see [`super::rules`]).

use std::time::Duration;

use anyhow::bail;
use idem_client::{Answer, Intent};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, LINK, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use serde_json::Value;

use super::Drill;
use super::body::{JsonObject, id_in};
use super::concurrent::Round;
use super::report::{Check, Findings, Report};
use super::rules::{Profile, Rule, Weight};

const POLICY: &str = "policy";
const REPLAY: &str = "replay";
const REPLAY_MARKER: &str = "replay-marker";
const REORDERED: &str = "reordered-body";
const MISMATCH: &str = "body-mismatch";
const ACCOUNT: &str = "account-scope";
const UNKNOWN_TOKEN: &str = "unknown-token";
const AUTH_FAILURE: &str = "auth-failure";
const MISSING_KEY: &str = "missing-key";
const MALFORMED_KEY: &str = "malformed-key";
const PROBLEM_DETAILS: &str = "problem-details";
const GET_WITH_KEY: &str = "get-with-key";
const AFTER_5XX: &str = "after-5xx";
const EXPIRY: &str = "expiry";

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Where an API may publish its rules: idem serve's path, then the well-known one the
/// gateway uses (out of the way of the upstream's paths).
const POLICY_PATHS: [&str; 2] = ["/idempotency-policy", "/.well-known/idempotency-policy"];

/// Replay headers other than Stripe's `Idempotent-Replayed`, seen in the field; the drill
/// names them rather than calling such a replay unmarked.
const OTHER_MARKERS: [&str; 3] = [
    "idempotency-replayed",
    "x-idempotent-replayed",
    "x-idempotency-replayed",
];

/// The first resource the drill made: later checks repeat its request and compare.
struct Original<'a> {
    /// The request with its key, as every copy of its round sent it.
    intent: &'a Intent,
    /// The answer that did the work (never a refusal); once the replay has shown which of a
    /// racy round's resources the key kept, that one.
    answer: &'a Answer,
    /// The resource id in that answer.
    id: Option<String>,
    /// Every success its round got: with a racy API, several resources.
    made: Vec<&'a Answer>,
}

/// What the published policy said, if there is one.
pub(super) struct Published {
    /// Where it was found, or where it was looked for.
    path: &'static str,
    /// The JSON document, or why there is none ("404", "not JSON").
    document: Result<Value, String>,
}

impl Published {
    fn field(&self, name: &str) -> Option<&Value> {
        self.document.as_ref().ok()?.get(name)
    }

    fn key_length(&self, name: &str) -> Option<usize> {
        self.field(name)
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
    }

    /// How long a claim may stay held after its last renewal: `claim_held_seconds`, else
    /// `lease_seconds`, at the top level or in a `lease_mode` member.
    fn hold(&self) -> Option<u64> {
        let document = self.document.as_ref().ok()?;
        [Some(document), document.get("lease_mode")]
            .into_iter()
            .flatten()
            .find_map(|d| {
                ["claim_held_seconds", "lease_seconds"]
                    .iter()
                    .find_map(|name| d.get(name).and_then(Value::as_u64))
            })
    }
}

/// A refusal the drill met (a 4xx other than an authentication failure), for the
/// problem-details check.
struct Refusal {
    what: String,
    answer: Answer,
}

/// How a response says it is a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Marker {
    /// `Idempotent-Replayed: true`, as Stripe and idem send it.
    Stripe,
    /// Another header with `true`, named.
    Other(&'static str),
    /// None.
    None,
}

/// How `answer` says it is a replay, if it does.
pub(super) fn marker(answer: &Answer) -> Marker {
    marker_in(&answer.headers)
}

fn marker_in(headers: &HeaderMap) -> Marker {
    let is_true = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    };
    if is_true("idempotent-replayed") {
        return Marker::Stripe;
    }
    OTHER_MARKERS
        .into_iter()
        .find(|name| is_true(name))
        .map_or(Marker::None, Marker::Other)
}

/// The resource a success stands for: its id, or its whole body when it has none.
pub(super) fn resource_of(drill: &Drill, answer: &Answer) -> String {
    drill
        .id_of(answer)
        .unwrap_or_else(|| String::from_utf8_lossy(&answer.body).into_owned())
}

impl Drill {
    /// Runs every check, in order, and reports them.
    ///
    /// An error means the drill could not start: the API did not answer at all, or refused
    /// account A's token. Everything the API does once it answers is a check's outcome.
    pub async fn run(&self) -> anyhow::Result<Report> {
        let profile = self.config.profile;
        let published = self.published().await?;
        let rounds = self.rounds().await?;
        let (concurrent, figures) = self.concurrent(&rounds);
        let mut refusals = Vec::new();
        let mut checks = vec![self.policy(&published), concurrent];
        checks.push(self.in_flight(&rounds));
        refusals.extend(in_flight_refusals(&rounds));

        let mut original = original(self, &rounds);
        match &mut original {
            Some(original) => {
                let (replay, replayed, kept) = self.replay(original).await;
                checks.push(replay);
                checks.push(self.replay_marker(&rounds, replayed.as_ref()));
                // A racy round made several resources; the later checks compare with the one
                // the key kept, so the race is counted once, by concurrent.
                if let Some(kept) = kept {
                    original.id = self.id_of(kept);
                    original.answer = kept;
                }
                let original = &*original;
                checks.push(self.reordered(original).await);
                checks.push(self.mismatch(original, &mut refusals).await);
                checks.push(self.account_scope(original).await);
                checks.push(self.unknown_token(original).await);
            }
            None => {
                let why = "no resource was made to compare with (see concurrent)";
                for (name, rule) in [
                    (REPLAY, Rule::SameAnswer),
                    (REPLAY_MARKER, Rule::ReplayMarker),
                    (REORDERED, Rule::OneEffect),
                    (MISMATCH, Rule::MismatchNotProcessed),
                    (ACCOUNT, Rule::OwnAnswer),
                    (UNKNOWN_TOKEN, Rule::OwnAnswer),
                ] {
                    checks.push(Check::skip(name, rule, profile, why));
                }
            }
        }
        checks.push(self.auth_failure().await);
        checks.push(self.missing_key(&published, &mut refusals).await);
        checks.push(self.malformed_key(&published, &mut refusals).await);
        checks.push(self.problem_details(&refusals));
        checks.push(match &original {
            Some(original) => self.get_with_key(original).await,
            None => Check::skip(
                GET_WITH_KEY,
                Rule::GetUntouched,
                profile,
                "no resource id to GET (see concurrent)",
            ),
        });
        checks.push(self.after_5xx(&published).await);
        // Last, because it may wait.
        checks.push(self.expiry(&published).await);
        Ok(Report {
            url: self.config.url.to_string(),
            profile,
            strict: self.config.strict,
            checks,
            concurrency: figures,
        })
    }

    /// Reads the published policy. Its absence is a finding of its own (the checks that need
    /// it skip); no answer at all means the API is unreachable, and the drill stops.
    async fn published(&self) -> anyhow::Result<Published> {
        let mut missing = Vec::new();
        for path in POLICY_PATHS {
            let url = self.config.url.join(path)?;
            let answer = match self.send_once(&self.get(&url)).await {
                Ok(answer) => answer,
                Err(e) => bail!("cannot reach {}: {e}", origin(&self.config.url)),
            };
            if answer.status.is_success() {
                let document = serde_json::from_slice::<Value>(&answer.body)
                    .ok()
                    .filter(Value::is_object)
                    .ok_or_else(|| "not a JSON object".to_owned());
                return Ok(Published { path, document });
            }
            missing.push(format!("{path} {}", answer.status.as_u16()));
        }
        Ok(Published {
            path: POLICY_PATHS[0],
            document: Err(missing.join(", ")),
        })
    }

    /// The draft asks for published rules (§2.5); the drill can read them only at a URL.
    fn policy(&self, published: &Published) -> Check {
        let path = published.path;
        match &published.document {
            Ok(_) => {
                let mut said = Vec::new();
                if let Some(secs) = published.field("retention_seconds").and_then(Value::as_u64) {
                    said.push(format!("retention {secs} s"));
                }
                if let (Some(min), Some(max)) = (
                    published.key_length("key_min_length"),
                    published.key_length("key_max_length"),
                ) {
                    said.push(format!("keys of {min} to {max} characters"));
                }
                match published.field("key_required") {
                    Some(Value::Bool(true)) => said.push("keys required".to_owned()),
                    Some(Value::Bool(false)) => said.push("keys optional".to_owned()),
                    _ => {}
                }
                if let Some(secs) = published.hold() {
                    said.push(format!("claims held {secs} s"));
                }
                let saw = if said.is_empty() {
                    format!("GET {path}: a JSON object")
                } else {
                    format!("GET {path}: {}", said.join(", "))
                };
                Findings::new(POLICY, Rule::Published, saw).judge(self.config.profile)
            }
            Err(why) => {
                let mut findings = Findings::new(
                    POLICY,
                    Rule::Published,
                    format!("GET {why}: no published policy the drill can read"),
                );
                findings.depart(
                    Rule::Published,
                    "the rules published (the draft asks for them in the documentation; idem \
                     serves them as JSON at /idempotency-policy)",
                );
                findings.judge(self.config.profile)
            }
        }
    }

    /// docs/contract.md §7.2: the same request again, later. Returns the answer too, for the
    /// marker check, and which of the round's answers it repeated.
    async fn replay<'a>(
        &self,
        original: &Original<'a>,
    ) -> (Check, Option<Answer>, Option<&'a Answer>) {
        let answer = match self.send(original.intent).await {
            Ok(answer) => answer,
            Err(e) => {
                let mut findings = Findings::new(REPLAY, Rule::SameAnswer, e);
                findings.depart(Rule::SameAnswer, "the first answer again");
                return (findings.judge(self.config.profile), None, None);
            }
        };
        // With a racy API, any of the round's resources is the one its key kept; an answer
        // that carries one under another status is that answer, changed.
        let first = original
            .made
            .iter()
            .find(|a| resource_of(self, a) == resource_of(self, &answer))
            .copied();
        let mut saw = match first.and_then(|f| self.id_of(f)) {
            Some(kept) if Some(&kept) != original.id.as_ref() => {
                self.saw(&answer, Some(&kept), "another id the round made")
            }
            _ => self.saw(&answer, original.id.as_deref(), "the same id"),
        };
        let mut findings;
        match first {
            Some(first) if first.status == answer.status => {
                let same_bytes = answer.body == first.body;
                let same_json = same_bytes || json_equal(&answer.body, &first.body);
                saw += match (same_bytes, same_json) {
                    (true, _) => ", same bytes",
                    (false, true) => ", the same JSON in other bytes",
                    (false, false) => ", a different body",
                };
                findings = Findings::new(REPLAY, Rule::SameAnswer, saw);
                findings
                    .require(same_json, Rule::SameAnswer, "the first answer's content")
                    .require(same_bytes, Rule::SameBytes, "the stored body byte for byte");
            }
            Some(first) => {
                findings = Findings::new(REPLAY, Rule::SameAnswer, saw);
                findings.depart(
                    Rule::SameAnswer,
                    format!("the first answer's status {}", first.status.as_u16()),
                );
            }
            None => {
                findings = Findings::new(REPLAY, Rule::SameAnswer, saw);
                findings.depart(Rule::SameAnswer, "the first answer again");
            }
        }
        let check = findings.judge(self.config.profile);
        // The marker is judged on a replay that is one; a changed status is no replay.
        let replayed = first.filter(|f| f.status == answer.status).map(|_| answer);
        (check, replayed, first)
    }

    /// Replays marked as such: the replay above, and the copies of each round that got the
    /// stored answer (all but the original).
    fn replay_marker(&self, rounds: &[Round], replay: Option<&Answer>) -> Check {
        let profile = self.config.profile;
        let Some(replay) = replay else {
            return Check::skip(
                REPLAY_MARKER,
                Rule::ReplayMarker,
                profile,
                "no replay to look at (see replay)",
            );
        };
        let mut unmarked_copies = 0;
        for round in rounds {
            let Some(original) = round.original(self) else {
                continue;
            };
            let same: Vec<&Answer> = round
                .successes()
                .into_iter()
                .filter(|a| self.same_resource(a, original))
                .collect();
            let unmarked = same.iter().filter(|a| marker(a) == Marker::None).count();
            // One of them is the original itself.
            unmarked_copies += unmarked.saturating_sub(1);
        }
        let saw = match marker(replay) {
            Marker::Stripe => "the replay: Idempotent-Replayed: true".to_owned(),
            Marker::Other(name) => format!("the replay: {name}: true"),
            Marker::None => "the replay: no replay header".to_owned(),
        };
        let saw = if unmarked_copies > 0 {
            format!("{saw}; {unmarked_copies} concurrent copies got the stored answer unmarked")
        } else {
            saw
        };
        let mut findings = Findings::new(REPLAY_MARKER, Rule::ReplayMarker, saw);
        findings
            .require(
                marker(replay) == Marker::Stripe,
                Rule::ReplayMarker,
                "Idempotent-Replayed: true on a replay",
            )
            .require(
                unmarked_copies == 0,
                Rule::ReplayMarker,
                "every copy but the original marked",
            );
        findings.judge(profile)
    }

    /// The same JSON members in another order: a replay where bodies are compared as JSON, a
    /// refusal where they are compared as bytes (the draft allows both), never a second
    /// resource.
    async fn reordered(&self, original: &Original<'_>) -> Check {
        let profile = self.config.profile;
        let Some(reordered) = JsonObject::parse(&self.config.body).and_then(|b| b.reordered())
        else {
            return Check::skip(
                REORDERED,
                Rule::CanonicalJson,
                profile,
                "the body is not a JSON object with two or more members",
            );
        };
        let answer = match self.send(&original.intent.clone().body(reordered)).await {
            Ok(answer) => answer,
            Err(e) => {
                let mut findings = Findings::new(REORDERED, Rule::OneEffect, e);
                findings.depart(Rule::CanonicalJson, "a replay of the same resource");
                return findings.judge(profile);
            }
        };
        let same = self.same_resource(&answer, original.answer);
        let mut saw = format!(
            "members reversed: {}",
            self.saw(&answer, original.id.as_deref(), "the same id")
        );
        if answer.status.is_client_error() {
            saw += ": taken for another request (a fingerprint of the bytes, draft §2.4)";
        }
        let mut findings = Findings::new(REORDERED, Rule::OneEffect, saw);
        findings
            .require(
                !answer.status.is_success() || same,
                Rule::OneEffect,
                "the same resource or a refusal, never a second resource for the key",
            )
            .require(
                answer.status.is_success() && same,
                Rule::CanonicalJson,
                "a replay: the same members in another order are the same request",
            );
        findings.judge(profile)
    }

    /// docs/contract.md §7.3: the same key with a different body is refused, and nothing is
    /// made.
    async fn mismatch(&self, original: &Original<'_>, refusals: &mut Vec<Refusal>) -> Check {
        let profile = self.config.profile;
        let Some(body) = JsonObject::parse(&self.config.body) else {
            return Check::skip(
                MISMATCH,
                Rule::MismatchNotProcessed,
                profile,
                "the body is not a JSON object the drill can vary",
            );
        };
        let (varied, what) = body.varied();
        let changed = match self.send(&original.intent.clone().body(varied)).await {
            Ok(answer) => answer,
            Err(e) => {
                let mut findings =
                    Findings::new(MISMATCH, Rule::MismatchNotProcessed, format!("{what}: {e}"));
                findings.depart(Rule::MismatchStatus, "422");
                return findings.judge(profile);
            }
        };
        // "No new resource": the refusal names none, and the key still holds the original.
        let again = self.send(original.intent).await;
        if changed.status.is_client_error() {
            refusals.push(Refusal {
                what: format!("{MISMATCH} {}", changed.status.as_u16()),
                answer: changed.clone(),
            });
        }
        let made_new =
            changed.status.is_success() && !self.same_resource(&changed, original.answer);
        let replayed_first = changed.status.is_success() && !made_new;
        let mut saw = format!(
            "{what}: {}",
            self.saw(&changed, original.id.as_deref(), "the same id")
        );
        if replayed_first {
            saw += " (the first answer, for a changed request)";
        }
        let again_ok = match &again {
            Ok(a) => {
                saw += &format!(
                    "; the original again: {}",
                    self.saw(a, original.id.as_deref(), "the same id")
                );
                a.status == original.answer.status && self.same_resource(a, original.answer)
            }
            Err(e) => {
                saw += &format!("; the original again: {e}");
                false
            }
        };
        let mut findings = Findings::new(MISMATCH, Rule::MismatchNotProcessed, saw);
        findings
            .require(
                !made_new,
                Rule::MismatchNotProcessed,
                "a refusal, no new resource",
            )
            .require(
                made_new || changed.status == StatusCode::UNPROCESSABLE_ENTITY,
                Rule::MismatchStatus,
                "422 for a changed request under a used key",
            )
            .require(
                again_ok,
                Rule::SameAnswer,
                "the original's answer still held by its key",
            );
        findings.judge(profile)
    }

    /// docs/contract.md §7.4: the same key and body from account B is a request of B's own.
    async fn account_scope(&self, original: &Original<'_>) -> Check {
        let profile = self.config.profile;
        let intent = self.keyed(&self.auth_b, &self.config.body, original.intent);
        let answer = match self.send(&intent).await {
            Ok(answer) => answer,
            Err(e) => return Check::skip(ACCOUNT, Rule::OwnAnswer, profile, e),
        };
        if matches!(
            answer.status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) {
            return Check::skip(
                ACCOUNT,
                Rule::OwnAnswer,
                profile,
                format!("the API refused --token-b with {}", answer.status.as_u16()),
            );
        }
        let saw = format!(
            "account B, same key and body: {}",
            self.saw(&answer, original.id.as_deref(), "account A's id")
        );
        let mut findings = Findings::new(ACCOUNT, Rule::OwnAnswer, saw);
        findings
            .require(
                !self.carries(&answer, original),
                Rule::OwnAnswer,
                "a resource of B's own, never A's",
            )
            .require(
                answer.status.is_success() || self.carries(&answer, original),
                Rule::ScopedKeys,
                "a resource of B's own: keys scoped to the account",
            );
        findings.judge(profile)
    }

    /// A token nobody holds, with account A's key and body: refused, never A's answer (an
    /// idempotency layer that looks the key up before authentication hands it out).
    async fn unknown_token(&self, original: &Original<'_>) -> Check {
        let auth = self.unknown_auth();
        let intent = self.keyed(&auth, &self.config.body, original.intent);
        let answer = match self.send_once(&intent).await {
            Ok(answer) => answer,
            Err(e) => {
                return Check::skip(UNKNOWN_TOKEN, Rule::OwnAnswer, self.config.profile, e);
            }
        };
        let mut saw = format!(
            "an unknown token, A's key and body: {}",
            self.saw(&answer, original.id.as_deref(), "account A's id")
        );
        if answer.status.is_success() && !self.carries(&answer, original) {
            saw += " (the API accepted a token nobody holds)";
        }
        let looked_up = matches!(answer.status.as_u16(), 409 | 422);
        let mut findings = Findings::new(UNKNOWN_TOKEN, Rule::OwnAnswer, saw);
        findings
            .require(
                !self.carries(&answer, original),
                Rule::OwnAnswer,
                "401, never account A's answer",
            )
            .require(
                !looked_up,
                Rule::ScopedKeys,
                "401 before any look-up of the key",
            );
        findings.judge(self.config.profile)
    }

    /// An authentication failure is not stored against the key: a stranger's request with a
    /// fresh key is refused, then the owner's request with that key runs.
    async fn auth_failure(&self) -> Check {
        let profile = self.config.profile;
        let stranger = self.post(&self.unknown_auth(), &self.config.body);
        let refused = match self.send_once(&stranger).await {
            Ok(a) if matches!(a.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) => a,
            Ok(a) => {
                return Check::skip(
                    AUTH_FAILURE,
                    Rule::OwnAnswer,
                    profile,
                    format!(
                        "an unknown token got {}, not 401 or 403: no failure to store",
                        a.status.as_u16()
                    ),
                );
            }
            Err(e) => return Check::skip(AUTH_FAILURE, Rule::OwnAnswer, profile, e),
        };
        let owner = self.keyed(&self.auth_a, &self.config.body, &stranger);
        let answer = match self.send(&owner).await {
            Ok(answer) => answer,
            Err(e) => {
                let mut findings = Findings::new(AUTH_FAILURE, Rule::OwnAnswer, e);
                findings.depart(Rule::AuthNotStored, "the owner's request to run");
                return findings.judge(profile);
            }
        };
        let saw = format!(
            "an unknown token with a fresh key: {}; then account A with that key: {}",
            refused.status.as_u16(),
            self.saw(&answer, None, "")
        );
        let got_the_failure = matches!(
            answer.status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        );
        let mut findings = Findings::new(AUTH_FAILURE, Rule::OwnAnswer, saw);
        findings
            .require(
                !got_the_failure,
                Rule::OwnAnswer,
                "the owner's request run, not the stranger's refusal replayed",
            )
            .require(
                got_the_failure || (answer.status.is_success() && marker(&answer) == Marker::None),
                Rule::AuthNotStored,
                "the owner's request run: an authentication failure is not stored",
            );
        findings.judge(profile)
    }

    /// docs/contract.md §7.5, first half: a POST without a key.
    async fn missing_key(&self, published: &Published, refusals: &mut Vec<Refusal>) -> Check {
        let profile = self.config.profile;
        if Rule::KeyRequired.weight(profile) == Weight::Skipped {
            return Check::skip(
                MISSING_KEY,
                Rule::KeyRequired,
                profile,
                format!("not judged under --profile {profile}: keys may be optional"),
            );
        }
        if published.field("key_required") == Some(&Value::Bool(false)) {
            let mut findings = Findings::new(
                MISSING_KEY,
                Rule::KeyRequired,
                format!("{} says key_required: false", published.path),
            );
            findings.depart(Rule::KeyRequired, "keys required (400 without one)");
            return findings.judge(profile);
        }
        let intent = self.post(&self.auth_a, &self.config.body).without_key();
        let answer = match self.send_once(&intent).await {
            Ok(answer) => answer,
            Err(e) => {
                let mut findings = Findings::new(MISSING_KEY, Rule::KeyRequired, e);
                findings.depart(Rule::KeyRequired, "400");
                return findings.judge(profile);
            }
        };
        if answer.status.is_client_error() {
            refusals.push(Refusal {
                what: format!("{MISSING_KEY} {}", answer.status.as_u16()),
                answer: answer.clone(),
            });
        }
        let mut saw = format!("no key: {}", self.saw(&answer, None, ""));
        if answer.status.is_success() {
            saw += " (keys are optional)";
        }
        let mut findings = Findings::new(MISSING_KEY, Rule::KeyRequired, saw);
        findings.require(
            answer.status == StatusCode::BAD_REQUEST,
            Rule::KeyRequired,
            "400",
        );
        findings.judge(profile)
    }

    /// docs/contract.md §7.5, second half: every malformed form of the header is refused.
    /// Each form is held to the rule that makes it malformed; forms no judged rule forbids
    /// are not sent.
    async fn malformed_key(&self, published: &Published, refusals: &mut Vec<Refusal>) -> Check {
        let profile = self.config.profile;
        let fresh = || filler(32);
        let published_min = published.key_length("key_min_length");
        let published_max = published.key_length("key_max_length");
        // A published format is checked as published (draft §5), besides any convention.
        let heavier = |a: Rule, b: Option<Rule>| match b {
            Some(b) if b.weight(profile) > a.weight(profile) => b,
            _ => a,
        };
        let min = published_min.unwrap_or(8);
        let max = published_max.unwrap_or(255);
        let mut cases: Vec<(&str, Rule, Vec<Vec<u8>>)> =
            vec![("empty", Rule::KeySyntax, vec![Vec::new()])];
        if min > 1 {
            let rule = heavier(
                Rule::KeyFormat,
                published_min.map(|_| Rule::PublishedFormat),
            );
            cases.push(("too short", rule, vec![filler(min - 1).into_bytes()]));
        }
        // Past this, servers refuse the header itself (431), which says nothing about keys.
        if max < 8 * 1024 {
            let rule = heavier(
                Rule::KeyMaxLength,
                published_max.map(|_| Rule::PublishedFormat),
            );
            cases.push(("too long", rule, vec![filler(max + 1).into_bytes()]));
        }
        cases.extend([
            (
                "a space",
                Rule::KeyFormat,
                vec![format!("drill {}", fresh()).into_bytes()],
            ),
            (
                "non-ASCII",
                Rule::KeySyntax,
                vec![[fresh().as_bytes(), b"\xe9"].concat()],
            ),
            (
                "a list",
                Rule::KeySyntax,
                vec![format!("{}, {}", fresh(), fresh()).into_bytes()],
            ),
            (
                "two fields",
                Rule::KeySyntax,
                vec![fresh().into_bytes(), fresh().into_bytes()],
            ),
        ]);

        let (judged, unjudged): (Vec<_>, Vec<_>) = cases
            .into_iter()
            .partition(|(_, rule, _)| rule.weight(profile) > Weight::Skipped);
        let mut refused = Vec::new();
        // (the rule, the form, what it got)
        let mut accepted: Vec<(Rule, &str, String)> = Vec::new();
        let mut other_4xx = Vec::new();
        for (what, rule, values) in judged {
            let mut intent = self.post(&self.auth_a, &self.config.body).without_key();
            for value in values {
                let value = HeaderValue::from_bytes(&value).expect("no control characters");
                intent = intent.header(IDEMPOTENCY_KEY, value);
            }
            match self.send_once(&intent).await {
                Ok(a) if a.status == StatusCode::BAD_REQUEST => {
                    refused.push(what.to_owned());
                    refusals.push(Refusal {
                        what: format!("{MALFORMED_KEY} 400"),
                        answer: a,
                    });
                }
                Ok(a) if a.status.is_client_error() => {
                    other_4xx.push(format!("{what} {}", a.status.as_u16()));
                    refusals.push(Refusal {
                        what: format!("{MALFORMED_KEY} {}", a.status.as_u16()),
                        answer: a,
                    });
                }
                Ok(a) => accepted.push((rule, what, a.status.as_u16().to_string())),
                Err(e) => accepted.push((rule, what, e)),
            }
        }
        let mut parts = Vec::new();
        if !accepted.is_empty() {
            let got: Vec<String> = accepted
                .iter()
                .map(|(_, form, got)| format!("{form} {got}"))
                .collect();
            parts.push(format!("not refused: {}", got.join(", ")));
        }
        if !other_4xx.is_empty() {
            parts.push(format!(
                "refused with another 4xx: {}",
                other_4xx.join(", ")
            ));
        }
        if !refused.is_empty() {
            parts.push(format!("400: {}", refused.join(", ")));
        }
        if !unjudged.is_empty() {
            let names: Vec<&str> = unjudged.iter().map(|(w, _, _)| *w).collect();
            parts.push(format!(
                "not sent (no rule of --profile {profile} forbids them): {}",
                names.join(", ")
            ));
        }
        let mut findings = Findings::new(MALFORMED_KEY, Rule::KeySyntax, parts.join("; "));
        let mut rules: Vec<Rule> = Vec::new();
        for (rule, _, _) in &accepted {
            if !rules.contains(rule) {
                rules.push(*rule);
            }
        }
        for rule in rules {
            let forms: Vec<&str> = accepted
                .iter()
                .filter(|(r, _, _)| *r == rule)
                .map(|(_, form, _)| *form)
                .collect();
            findings.depart(rule, format!("a refusal for {}", forms.join(", ")));
        }
        findings.require(other_4xx.is_empty(), Rule::Malformed400, "400 exactly");
        findings.judge(profile)
    }

    /// Refusals as problem details (RFC 9457) or with a `Link` to the documentation, as the
    /// draft's examples give them.
    fn problem_details(&self, refusals: &[Refusal]) -> Check {
        let profile = self.config.profile;
        if Rule::ProblemDetails.weight(profile) == Weight::Skipped {
            return Check::skip(
                PROBLEM_DETAILS,
                Rule::ProblemDetails,
                profile,
                format!("not judged under --profile {profile}"),
            );
        }
        if refusals.is_empty() {
            return Check::skip(
                PROBLEM_DETAILS,
                Rule::ProblemDetails,
                profile,
                "the drill met no refusal to look at",
            );
        }
        let idem = profile == Profile::Idem;
        let (mut problems, mut links, mut bare) = (0, 0, Vec::new());
        for refusal in refusals {
            let is_problem = is_problem(&refusal.answer);
            let has_link = refusal.answer.headers.contains_key(LINK);
            problems += usize::from(is_problem);
            links += usize::from(has_link);
            // idem's contract asks for problem details; the draft takes a Link instead.
            let described = is_problem || (has_link && !idem);
            if !described && !bare.contains(&refusal.what.as_str()) {
                bare.push(refusal.what.as_str());
            }
        }
        let mut saw = format!(
            "{} refusals: {problems} as application/problem+json with a type, {links} with a Link",
            refusals.len()
        );
        if !bare.is_empty() {
            saw += &format!("; neither: {}", bare.join(", "));
        }
        let mut findings = Findings::new(PROBLEM_DETAILS, Rule::ProblemDetails, saw);
        findings.require(
            bare.is_empty(),
            Rule::ProblemDetails,
            if idem {
                "problem details on every refusal"
            } else {
                "problem details or a Link to the documentation on every refusal"
            },
        );
        findings.judge(profile)
    }

    /// docs/contract.md §7.6: a GET is untouched by keys, valid or not.
    async fn get_with_key(&self, original: &Original<'_>) -> Check {
        let profile = self.config.profile;
        let skip = |why: String| Check::skip(GET_WITH_KEY, Rule::GetUntouched, profile, why);
        let Some(id) = &original.id else {
            return skip("no resource id to GET (see --id-field)".to_owned());
        };
        let mut url = self.config.url.clone();
        match url.path_segments_mut() {
            Ok(mut path) => {
                path.pop_if_empty().push(id);
            }
            Err(()) => return skip("the URL has no path to extend".to_owned()),
        }
        let path = url.path().to_owned();
        let plain = match self.send_once(&self.get(&url)).await {
            Ok(answer) if answer.status.is_success() => answer,
            Ok(answer) => {
                return skip(format!(
                    "GET {path} without a key answered {}: nothing to compare",
                    answer.status.as_u16()
                ));
            }
            Err(e) => return skip(format!("GET {path}: {e}")),
        };

        let keyed = Intent::new(Method::GET, url.as_str());
        let keyed = self.with_headers(keyed, &self.auth_a);
        let malformed = self.get(&url).header(
            IDEMPOTENCY_KEY,
            HeaderValue::from_static("not a valid key!"),
        );
        let mut differ = Vec::new();
        for (what, intent) in [
            ("a key", &keyed),
            ("the key again", &keyed),
            ("a malformed key", &malformed),
        ] {
            match self.send_once(intent).await {
                Ok(a) if marker(&a) != Marker::None => {
                    differ.push(format!("{what}: marked replayed"));
                }
                Ok(a) if a.status != plain.status => {
                    differ.push(format!("{what}: {}", a.status.as_u16()));
                }
                Ok(a) if a.body != plain.body => differ.push(format!("{what}: another body")),
                Ok(_) => {}
                Err(e) => differ.push(format!("{what}: {e}")),
            }
        }
        let saw = if differ.is_empty() {
            format!(
                "GET {path} with no key, a key twice, a malformed key: {} each, same body, none replayed",
                plain.status.as_u16()
            )
        } else {
            format!(
                "GET {path}: {} with no key; with {}",
                plain.status.as_u16(),
                differ.join("; ")
            )
        };
        let mut findings = Findings::new(GET_WITH_KEY, Rule::GetUntouched, saw);
        findings.require(
            differ.is_empty(),
            Rule::GetUntouched,
            "the same answer with or without a key",
        );
        findings.judge(profile)
    }

    /// After the work failed with a 5xx, the key is not refused as "in flight" for ever: a
    /// retry gets the failure again, or runs again, within the published hold of a claim (or
    /// `--failing-wait`).
    async fn after_5xx(&self, published: &Published) -> Check {
        let profile = self.config.profile;
        let Some(body) = &self.config.failing_body else {
            return Check::skip(
                AFTER_5XX,
                Rule::NotStuck,
                profile,
                "give --failing-body (a body the API answers with a 5xx) to run it",
            );
        };
        let intent = self.post(&self.auth_a, body);
        let failed = match self.send_once(&intent).await {
            Ok(a) if a.status.is_server_error() => a,
            Ok(a) => {
                return Check::skip(
                    AFTER_5XX,
                    Rule::NotStuck,
                    profile,
                    format!(
                        "--failing-body got {}, not a 5xx: nothing to retry",
                        a.status.as_u16()
                    ),
                );
            }
            Err(e) => {
                return Check::skip(
                    AFTER_5XX,
                    Rule::NotStuck,
                    profile,
                    format!("--failing-body: {e}"),
                );
            }
        };
        let (bound, source) = match (self.config.failing_wait, published.hold()) {
            (Some(wait), _) => (wait, "--failing-wait".to_owned()),
            (None, Some(hold)) => (
                Duration::from_secs(hold + 1),
                format!("{}'s hold of a claim, plus a second", published.path),
            ),
            (None, None) => (self.config.max_wait, "--max-wait".to_owned()),
        };
        let mut waited = Duration::ZERO;
        let mut retries = 0;
        let last = loop {
            retries += 1;
            let answer = self.send_once(&intent).await;
            let refused = answer
                .as_ref()
                .is_ok_and(|a| a.status == StatusCode::CONFLICT);
            if !refused || waited >= bound {
                break answer;
            }
            let asked = answer
                .as_ref()
                .ok()
                .and_then(|a| a.headers.get(RETRY_AFTER))
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            let wait = asked
                .unwrap_or(Duration::from_millis(500))
                .clamp(Duration::from_millis(100), Duration::from_secs(5))
                .min(bound.saturating_sub(waited).max(Duration::from_millis(100)));
            self.sleeper.sleep(wait).await;
            waited += wait;
        };
        let first = format!("{} {}", failed.status.as_u16(), problem(&failed));
        let (saw, stuck) = match &last {
            Ok(a) if a.status == StatusCode::CONFLICT => (
                format!(
                    "--failing-body: {first}; then 409 {} for {:.1} s ({retries} tries, bound: {source})",
                    problem(a),
                    waited.as_secs_f64()
                ),
                true,
            ),
            Ok(a) => {
                let how = if marker(a) != Marker::None {
                    ", replayed"
                } else {
                    ""
                };
                (
                    format!(
                        "--failing-body: {first}; a retry after {:.1} s: {}{how}",
                        waited.as_secs_f64(),
                        a.status.as_u16()
                    ),
                    false,
                )
            }
            Err(e) => (format!("--failing-body: {first}; a retry: {e}"), false),
        };
        let mut findings = Findings::new(AFTER_5XX, Rule::NotStuck, saw);
        findings.require(
            !stuck,
            Rule::NotStuck,
            "the failure again or a new run once the work has ended, not 409 for ever",
        );
        findings.judge(profile)
    }

    /// docs/contract.md §7.7: once the published retention has passed, the key is new again.
    async fn expiry(&self, published: &Published) -> Check {
        let profile = self.config.profile;
        let skip = |why: String| Check::skip(EXPIRY, Rule::Expiry, profile, why);
        let policy = published.path;
        let retention = match (&published.document, published.field("retention_seconds")) {
            (Err(why), _) => return skip(format!("GET {why}; no retention to wait out")),
            (Ok(_), None) => return skip(format!("{policy} publishes no retention_seconds")),
            (Ok(_), Some(value)) => match value.as_u64() {
                Some(secs) => Duration::from_secs(secs),
                None => return skip(format!("{policy}: retention_seconds is {value}")),
            },
        };
        if retention > self.config.max_wait {
            return skip(format!(
                "retention is {} s, more than --max-wait {} s",
                retention.as_secs(),
                self.config.max_wait.as_secs()
            ));
        }

        let intent = self.post(&self.auth_a, &self.config.body);
        let first = match self.send(&intent).await {
            Ok(answer) if answer.status.is_success() && self.id_of(&answer).is_some() => answer,
            Ok(answer) => {
                return skip(format!("a new key: {}", self.saw(&answer, None, "")));
            }
            Err(e) => return skip(format!("a new key: {e}")),
        };
        // A second past the retention, for servers that count whole seconds.
        let wait = retention + Duration::from_secs(1);
        self.sleeper.sleep(wait).await;
        let first_id = self.id_of(&first);
        let after = self.send(&intent).await;
        let (saw, ok) = match &after {
            Ok(after) => {
                let id = self.id_of(after);
                (
                    self.saw(after, first_id.as_deref(), "its first id"),
                    after.status.is_success() && id.is_some() && id != first_id,
                )
            }
            Err(e) => (e.clone(), false),
        };
        let saw = format!(
            "retention {} s; after {} s the key got: {saw}",
            retention.as_secs(),
            wait.as_secs()
        );
        let mut findings = Findings::new(EXPIRY, Rule::Expiry, saw);
        findings.require(
            ok,
            Rule::Expiry,
            "a new resource once the published retention has passed",
        );
        findings.judge(profile)
    }

    /// A POST of `body` as the account `auth` names, with a fresh key.
    pub(super) fn post(&self, auth: &HeaderValue, body: &str) -> Intent {
        let mut intent = Intent::post(self.config.url.as_str());
        if !self.config.headers.contains_key(CONTENT_TYPE) {
            intent = intent.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        self.with_headers(intent, auth).body(body.to_owned())
    }

    /// A POST of `body` as `auth`, with the key `like` carries.
    fn keyed(&self, auth: &HeaderValue, body: &str, like: &Intent) -> Intent {
        let mut intent = self.post(auth, body);
        if let Some(key) = like.key() {
            intent = intent.with_key(key.clone());
        }
        intent
    }

    /// `Authorization` with a token nobody holds, new each time.
    fn unknown_auth(&self) -> HeaderValue {
        let token = format!("idem_drill_unknown_{}", uuid::Uuid::new_v4().simple());
        HeaderValue::try_from(format!("Bearer {token}")).expect("hex digits fit in a header")
    }

    /// A GET as account A, with no key.
    pub(super) fn get(&self, url: &Url) -> Intent {
        let intent = Intent::new(Method::GET, url.as_str()).without_key();
        self.with_headers(intent, &self.auth_a)
    }

    fn with_headers(&self, mut intent: Intent, auth: &HeaderValue) -> Intent {
        for (name, value) in &self.config.headers {
            intent = intent.header(name.clone(), value.clone());
        }
        intent.header(reqwest::header::AUTHORIZATION, auth.clone())
    }

    /// Sends with retries, as a client with a key would.
    async fn send(&self, intent: &Intent) -> Result<Answer, String> {
        answer(self.client.send(intent).await)
    }

    /// Sends once: the first answer is what is checked.
    pub(super) async fn send_once(&self, intent: &Intent) -> Result<Answer, String> {
        answer(self.once.send(intent).await)
    }

    pub(super) fn id_of(&self, answer: &Answer) -> Option<String> {
        id_in(&answer.body, &self.config.id_field)
    }

    /// Whether two successes stand for the same resource.
    pub(super) fn same_resource(&self, a: &Answer, b: &Answer) -> bool {
        a.status.is_success()
            && b.status.is_success()
            && resource_of(self, a) == resource_of(self, b)
    }

    /// Whether `answer` hands out a resource the original's round made: its id, or its very
    /// bytes.
    fn carries(&self, answer: &Answer, original: &Original<'_>) -> bool {
        let id = self.id_of(answer);
        original
            .made
            .iter()
            .any(|made| (id.is_some() && id == self.id_of(made)) || answer.body == made.body)
    }

    /// One answer in a few words: status, the id it carries (named `known_as` when it is
    /// `known`), whether it was marked replayed; for a refusal, its problem type.
    fn saw(&self, answer: &Answer, known: Option<&str>, known_as: &str) -> String {
        let mut out = answer.status.as_u16().to_string();
        let success = answer.status.is_success();
        if !success {
            out += &format!(" {}", problem(answer));
        }
        match self.id_of(answer) {
            Some(id) if Some(id.as_str()) == known => out += &format!(", {known_as}"),
            Some(id) if known.is_some() => out += &format!(", new id {id}"),
            Some(id) => out += &format!(", id {id}"),
            // A refusal is expected to carry no id; a success without one is news.
            None if success => out += &format!(", no \"{}\"", self.config.id_field),
            None => {}
        }
        match marker(answer) {
            Marker::Stripe => out += ", replayed",
            Marker::Other(name) => out += &format!(", marked {name}"),
            Marker::None if success => out += ", not marked replayed",
            Marker::None => {}
        }
        out
    }
}

/// The first round that made a resource, and its original.
fn original<'a>(drill: &Drill, rounds: &'a [Round]) -> Option<Original<'a>> {
    rounds.iter().find_map(|round| {
        let answer = round.original(drill)?;
        Some(Original {
            intent: &round.intent,
            answer,
            id: drill.id_of(answer),
            made: round.successes(),
        })
    })
}

/// The refusals the copies met in flight, for the problem-details check.
fn in_flight_refusals(rounds: &[Round]) -> Vec<Refusal> {
    rounds
        .iter()
        .flat_map(|r| &r.copies)
        .filter_map(|c| c.first.as_ref().ok())
        .filter(|a| a.status.is_client_error())
        .take(3)
        .map(|a| Refusal {
            what: format!("in flight {}", a.status.as_u16()),
            answer: a.clone(),
        })
        .collect()
}

/// Whether `a` and `b` are the same JSON value (numbers as parsed): a replay re-serialised.
fn json_equal(a: &[u8], b: &[u8]) -> bool {
    match (
        serde_json::from_slice::<Value>(a),
        serde_json::from_slice::<Value>(b),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Whether `answer` is problem details: `application/problem+json` with a `type`.
fn is_problem(answer: &Answer) -> bool {
    is_problem_in(&answer.headers, &answer.body)
}

fn is_problem_in(headers: &HeaderMap, body: &[u8]) -> bool {
    let content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/problem+json"));
    content_type
        && serde_json::from_slice::<Value>(body)
            .is_ok_and(|v| v.get("type").is_some_and(Value::is_string))
}

/// `len` random hex digits: each malformed key is new, so one the API wrongly accepts is not
/// replayed by the next run.
fn filler(len: usize) -> String {
    std::iter::repeat_with(|| uuid::Uuid::new_v4().simple().to_string())
        .flat_map(|s| s.into_bytes())
        .take(len)
        .map(char::from)
        .collect()
}

/// The final answer, including one the client stopped retrying (a 409 or 503 to the end);
/// `Err` only when the API never answered.
pub(super) fn answer(sent: idem_client::Result<Answer>) -> Result<Answer, String> {
    match sent {
        Ok(answer) => Ok(answer),
        Err(idem_client::Error::Status { last, .. }) => Ok(*last),
        Err(idem_client::Error::Transport {
            attempts, source, ..
        }) => Err(format!(
            "no answer ({attempts} attempt{}): {}",
            if attempts == 1 { "" } else { "s" },
            idem_core::ErrorChain(&source)
        )),
        Err(e) => Err(idem_core::ErrorChain(&e).to_string()),
    }
}

/// The problem `type` of a problem-details answer, else a hint at what the body is.
pub(super) fn problem(answer: &Answer) -> String {
    let problem_type = serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_owned));
    match problem_type {
        Some(t) => t,
        None if answer.body.is_empty() => "(empty body)".to_owned(),
        None => "(no problem type)".to_owned(),
    }
}

fn origin(url: &Url) -> String {
    url.origin().ascii_serialization()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn markers_are_told_apart() {
        let stripe = headers(&[("idempotent-replayed", "true")]);
        assert_eq!(marker_in(&stripe), Marker::Stripe);
        let other = headers(&[("idempotency-replayed", "True")]);
        assert_eq!(marker_in(&other), Marker::Other("idempotency-replayed"));
        assert_eq!(marker_in(&headers(&[])), Marker::None);
        let no = headers(&[("idempotent-replayed", "false")]);
        assert_eq!(marker_in(&no), Marker::None);
    }

    #[test]
    fn problem_details_need_the_media_type_and_a_type() {
        let problem = br#"{"type": "urn:x", "status": 422}"#;
        let media = headers(&[("content-type", "application/problem+json")]);
        assert!(is_problem_in(&media, problem));
        let json = headers(&[("content-type", "application/json")]);
        assert!(!is_problem_in(&json, problem));
        assert!(!is_problem_in(&media, b"{}"));
    }

    #[test]
    fn json_equal_ignores_spacing_and_member_order() {
        assert!(json_equal(br#"{"a":1,"b":2}"#, br#"{ "b": 2, "a": 1 }"#));
        assert!(!json_equal(br#"{"a":1}"#, br#"{"a":2}"#));
        assert!(!json_equal(b"<html>", b"<html>"), "only JSON");
    }
}
