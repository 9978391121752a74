//! The checks of docs/contract.md §7, in the order they run. Each sends real requests and turns what came
//! back into one [`Check`] whose detail says what the drill saw.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::bail;
use idem_client::{Answer, Intent};
use reqwest::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode, Url};
use serde_json::Value;

use super::Drill;
use super::body::{JsonObject, id_in};
use super::report::{Check, Report};

const CONCURRENT: &str = "concurrent";
const REPLAY: &str = "replay";
const REORDERED: &str = "reordered-body";
const MISMATCH: &str = "body-mismatch";
const ACCOUNT: &str = "account-scope";
const MISSING_KEY: &str = "missing-key";
const MALFORMED_KEY: &str = "malformed-key";
const GET_WITH_KEY: &str = "get-with-key";
const EXPIRY: &str = "expiry";

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The first request of the drill: later checks repeat it, and compare against its answer.
struct Original {
    /// The request with its key, as sent by every copy.
    intent: Intent,
    /// The answer that did the work (the first copy not marked replayed).
    answer: Answer,
    /// The resource id in that answer.
    id: Option<String>,
}

/// What `<origin>/idempotency-policy` published, if anything.
struct Published {
    url: Url,
    /// The JSON document, or why there is none ("404", "not JSON").
    document: Result<Value, String>,
}

impl Published {
    fn field(&self, name: &str) -> Option<&Value> {
        self.document.as_ref().ok()?.get(name)
    }

    fn key_length(&self, name: &str, default: usize) -> usize {
        self.field(name)
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(default)
    }
}

impl Drill {
    /// Runs every check, in order, and reports them.
    ///
    /// An error means the drill could not start: the API did not answer at all, or refused
    /// account A's token. Everything the API does once it answers is a check's outcome.
    pub async fn run(&self) -> anyhow::Result<Report> {
        let published = self.published().await?;
        let (concurrent, original) = self.concurrent().await?;
        let mut checks = vec![concurrent];
        checks.push(self.replay(&original).await);
        checks.push(self.reordered(&original).await);
        checks.push(self.mismatch(&original).await);
        checks.push(self.account_scope(&original).await);
        checks.push(self.missing_key(&published).await);
        checks.push(self.malformed_key(&published).await);
        checks.push(self.get_with_key(&original).await);
        // Last, because it may wait.
        checks.push(self.expiry(&published).await);
        Ok(Report {
            url: self.config.url.to_string(),
            checks,
        })
    }

    /// Reads the published policy. Its absence is fine (the checks that need it skip); no
    /// answer at all means the API is unreachable, and the drill stops before any check.
    async fn published(&self) -> anyhow::Result<Published> {
        let url = self.config.url.join("/idempotency-policy")?;
        let answer = match self.send_once(&self.get(&url)).await {
            Ok(answer) => answer,
            Err(e) => bail!("cannot reach {}: {e}", origin(&self.config.url)),
        };
        let document = if answer.status.is_success() {
            serde_json::from_slice::<Value>(&answer.body)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| "not a JSON object".to_owned())
        } else {
            Err(answer.status.as_u16().to_string())
        };
        Ok(Published { url, document })
    }

    /// docs/contract.md §7.1: N copies at once with one key.
    async fn concurrent(&self) -> anyhow::Result<(Check, Original)> {
        let intent = self.post(&self.auth_a, &self.config.body);
        let n = self.config.concurrency;
        // Spawned, so the copies are on the wire together rather than one after another.
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (client, intent) = (self.client.clone(), intent.clone());
                tokio::spawn(async move { client.send(&intent).await })
            })
            .collect();
        let mut results = Vec::with_capacity(n);
        for task in tasks {
            results.push(match task.await {
                Ok(sent) => answer(sent),
                Err(e) => Err(format!("the request task failed: {e}")),
            });
        }

        let answers: Vec<&Answer> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        let Some(first) = answers.first() else {
            bail!("{}: {}", self.config.url, errors[0]);
        };
        if answers
            .iter()
            .all(|a| matches!(a.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN))
        {
            bail!(
                "{} refused --token-a with {}: check the token",
                self.config.url,
                first.status
            );
        }

        let statuses: Vec<String> = results
            .iter()
            .map(|r| match r {
                Ok(a) => a.status.as_u16().to_string(),
                Err(_) => "error".to_owned(),
            })
            .collect();
        let ids: BTreeSet<Option<String>> = answers.iter().map(|a| self.id_of(a)).collect();
        let replayed = answers.iter().filter(|a| a.replayed).count();
        let retried = answers.iter().filter(|a| a.attempts > 1).count();
        let same_status = answers.iter().all(|a| a.status == first.status);
        let one_id = ids.len() == 1 && !ids.contains(&None);

        let mut detail = format!(
            "{n} {}: {}, {}, {replayed} replayed",
            if errors.is_empty() { "answers" } else { "sent" },
            statuses.join(" "),
            self.count_ids(&ids)
        );
        if retried > 0 {
            detail += &format!(", {retried} after a retry");
        }
        if !first.status.is_success() {
            detail += &format!(" ({})", problem(first));
        }
        if let Some(e) = errors.first() {
            detail += &format!("; {} without an answer: {e}", errors.len());
        }
        let ok = errors.is_empty()
            && same_status
            && first.status.is_success()
            && one_id
            && replayed == n - 1;

        // The copy that did the work; with no idempotency at all, simply the first.
        let worker = Answer::clone(answers.iter().find(|a| !a.replayed).unwrap_or(first));
        let original = Original {
            id: self.id_of(&worker),
            intent,
            answer: worker,
        };
        Ok((
            Check::verdict(CONCURRENT, ok, detail, "one id, all but one replayed"),
            original,
        ))
    }

    /// docs/contract.md §7.2: the same request again, later.
    async fn replay(&self, original: &Original) -> Check {
        let answer = match self.send(&original.intent).await {
            Ok(answer) => answer,
            Err(e) => return Check::fail(REPLAY, e),
        };
        let same_bytes = answer.body == original.answer.body;
        let ok = answer.replayed && answer.status == original.answer.status && same_bytes;
        let mut detail = self.saw(&answer, original.id.as_deref(), "the same id");
        detail += if same_bytes {
            ", same bytes"
        } else {
            ", different bytes"
        };
        Check::verdict(REPLAY, ok, detail, "the same status and bytes, replayed")
    }

    /// The same JSON members in another order are the same request.
    async fn reordered(&self, original: &Original) -> Check {
        let Some(reordered) = JsonObject::parse(&self.config.body).and_then(|b| b.reordered())
        else {
            return Check::skip(
                REORDERED,
                "the body is not a JSON object with two or more members",
            );
        };
        match self.send(&original.intent.clone().body(reordered)).await {
            Ok(answer) => {
                let ok = answer.replayed
                    && answer.status == original.answer.status
                    && answer.body == original.answer.body;
                let detail = format!(
                    "members reversed: {}",
                    self.saw(&answer, original.id.as_deref(), "the same id")
                );
                Check::verdict(REORDERED, ok, detail, "a replay of the same id")
            }
            Err(e) => Check::fail(REORDERED, e),
        }
    }

    /// docs/contract.md §7.3: the same key with a different body is refused, and nothing is made.
    async fn mismatch(&self, original: &Original) -> Check {
        let Some(body) = JsonObject::parse(&self.config.body) else {
            return Check::skip(MISMATCH, "the body is not a JSON object the drill can vary");
        };
        let (varied, what) = body.varied();
        let changed = match self.send(&original.intent.clone().body(varied)).await {
            Ok(answer) => answer,
            Err(e) => return Check::fail(MISMATCH, format!("{what}: {e}")),
        };
        // "No new resource": the refusal names none, and the key still holds the original.
        let again = match self.send(&original.intent).await {
            Ok(answer) => answer,
            Err(e) => return Check::fail(MISMATCH, format!("the original again: {e}")),
        };
        let changed_id = self.id_of(&changed);
        let ok = changed.status == StatusCode::UNPROCESSABLE_ENTITY
            && (changed_id.is_none() || changed_id == original.id)
            && again.replayed
            && again.body == original.answer.body;
        let detail = format!(
            "{what}: {}; the original again: {}",
            self.saw(&changed, original.id.as_deref(), "the same id"),
            self.saw(&again, original.id.as_deref(), "the same id")
        );
        Check::verdict(MISMATCH, ok, detail, "422, then the same id replayed")
    }

    /// docs/contract.md §7.4: the same key and body from account B is a request of B's own.
    async fn account_scope(&self, original: &Original) -> Check {
        if original.id.is_none() {
            return Check::skip(ACCOUNT, "no resource id to compare (see --id-field)");
        }
        let mut intent = self.post(&self.auth_b, &self.config.body);
        if let Some(key) = original.intent.key() {
            intent = intent.with_key(key.clone());
        }
        let answer = match self.send(&intent).await {
            Ok(answer) => answer,
            Err(e) => return Check::fail(ACCOUNT, e),
        };
        if matches!(
            answer.status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) {
            return Check::skip(
                ACCOUNT,
                format!("the API refused --token-b with {}", answer.status.as_u16()),
            );
        }
        let id = self.id_of(&answer);
        let ok =
            answer.status.is_success() && !answer.replayed && id.is_some() && id != original.id;
        let detail = format!(
            "account B, same key and body: {}",
            self.saw(&answer, original.id.as_deref(), "account A's id")
        );
        Check::verdict(ACCOUNT, ok, detail, "a new id, not replayed")
    }

    /// docs/contract.md §7.5, first half: a POST without a key.
    async fn missing_key(&self, published: &Published) -> Check {
        if published.field("key_required") == Some(&Value::Bool(false)) {
            return Check::skip(
                MISSING_KEY,
                format!("{} says key_required: false", published.url.path()),
            );
        }
        let intent = self.post(&self.auth_a, &self.config.body).without_key();
        match self.send_once(&intent).await {
            Ok(answer) => Check::verdict(
                MISSING_KEY,
                answer.status == StatusCode::BAD_REQUEST,
                format!("no key: {}", self.saw(&answer, None, "")),
                "400",
            ),
            Err(e) => Check::fail(MISSING_KEY, e),
        }
    }

    /// docs/contract.md §7.5, second half: every malformed form of the header is refused.
    async fn malformed_key(&self, published: &Published) -> Check {
        let fresh = || filler(32);
        let min = published.key_length("key_min_length", 8);
        let max = published.key_length("key_max_length", 255);
        let mut cases: Vec<(&str, Vec<Vec<u8>>)> = vec![("empty", vec![Vec::new()])];
        if min > 1 {
            cases.push(("too short", vec![filler(min - 1).into_bytes()]));
        }
        // Past this, servers refuse the header itself (431), which says nothing about keys.
        if max < 8 * 1024 {
            cases.push(("too long", vec![filler(max + 1).into_bytes()]));
        }
        cases.extend([
            ("a space", vec![format!("drill {}", fresh()).into_bytes()]),
            ("non-ASCII", vec![[fresh().as_bytes(), b"\xe9"].concat()]),
            (
                "a list",
                vec![format!("{}, {}", fresh(), fresh()).into_bytes()],
            ),
            (
                "two fields",
                vec![fresh().into_bytes(), fresh().into_bytes()],
            ),
        ]);

        let total = cases.len();
        let (mut refused, mut other) = (Vec::new(), Vec::new());
        for (what, values) in cases {
            let mut intent = self.post(&self.auth_a, &self.config.body).without_key();
            for value in values {
                let value = HeaderValue::from_bytes(&value).expect("no control characters");
                intent = intent.header(IDEMPOTENCY_KEY, value);
            }
            match self.send_once(&intent).await {
                Ok(a) if a.status == StatusCode::BAD_REQUEST => refused.push(what.to_owned()),
                Ok(a) => other.push(format!("{what} {}", a.status.as_u16())),
                Err(e) => other.push(format!("{what}: {e}")),
            }
        }
        if other.is_empty() {
            Check::pass(
                MALFORMED_KEY,
                format!("{total} malformed keys, 400 each: {}", refused.join(", ")),
            )
        } else {
            let mut detail = format!("not 400: {}", other.join(", "));
            if !refused.is_empty() {
                detail += &format!("; 400: {}", refused.join(", "));
            }
            Check::fail(MALFORMED_KEY, detail)
        }
    }

    /// docs/contract.md §7.6: a GET is untouched by keys, valid or not.
    async fn get_with_key(&self, original: &Original) -> Check {
        let Some(id) = &original.id else {
            return Check::skip(GET_WITH_KEY, "no resource id to GET (see --id-field)");
        };
        let mut url = self.config.url.clone();
        match url.path_segments_mut() {
            Ok(mut path) => {
                path.pop_if_empty().push(id);
            }
            Err(()) => return Check::skip(GET_WITH_KEY, "the URL has no path to extend"),
        }
        let path = url.path().to_owned();
        let plain = match self.send_once(&self.get(&url)).await {
            Ok(answer) if answer.status.is_success() => answer,
            Ok(answer) => {
                return Check::skip(
                    GET_WITH_KEY,
                    format!(
                        "GET {path} without a key answered {}: nothing to compare",
                        answer.status.as_u16()
                    ),
                );
            }
            Err(e) => return Check::skip(GET_WITH_KEY, format!("GET {path}: {e}")),
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
                Ok(a) if a.replayed => differ.push(format!("{what}: marked replayed")),
                Ok(a) if a.status != plain.status => {
                    differ.push(format!("{what}: {}", a.status.as_u16()));
                }
                Ok(a) if a.body != plain.body => differ.push(format!("{what}: another body")),
                Ok(_) => {}
                Err(e) => differ.push(format!("{what}: {e}")),
            }
        }
        if differ.is_empty() {
            Check::pass(
                GET_WITH_KEY,
                format!(
                    "GET {path} with no key, a key twice, a malformed key: {} each, same body, none replayed",
                    plain.status.as_u16()
                ),
            )
        } else {
            Check::fail(
                GET_WITH_KEY,
                format!(
                    "GET {path}: {} with no key; with {}",
                    plain.status.as_u16(),
                    differ.join("; ")
                ),
            )
        }
    }

    /// docs/contract.md §7.7: once the published retention has passed, the key is new again.
    async fn expiry(&self, published: &Published) -> Check {
        let policy = published.url.path();
        let retention = match (&published.document, published.field("retention_seconds")) {
            (Err(why), _) => {
                return Check::skip(
                    EXPIRY,
                    format!("GET {policy}: {why}; no retention to wait out"),
                );
            }
            (Ok(_), None) => {
                return Check::skip(EXPIRY, format!("{policy} publishes no retention_seconds"));
            }
            (Ok(_), Some(value)) => match value.as_u64() {
                Some(secs) => Duration::from_secs(secs),
                None => {
                    return Check::skip(EXPIRY, format!("{policy}: retention_seconds is {value}"));
                }
            },
        };
        if retention > self.config.max_wait {
            return Check::skip(
                EXPIRY,
                format!(
                    "retention is {} s, more than --max-wait {} s",
                    retention.as_secs(),
                    self.config.max_wait.as_secs()
                ),
            );
        }

        let intent = self.post(&self.auth_a, &self.config.body);
        let first = match self.send(&intent).await {
            Ok(answer) if answer.status.is_success() && self.id_of(&answer).is_some() => answer,
            Ok(answer) => {
                return Check::fail(
                    EXPIRY,
                    format!("a new key: {}", self.saw(&answer, None, "")),
                );
            }
            Err(e) => return Check::fail(EXPIRY, format!("a new key: {e}")),
        };
        // A second past the retention, for servers that count whole seconds.
        let wait = retention + Duration::from_secs(1);
        self.sleeper.sleep(wait).await;
        let first_id = self.id_of(&first);
        let detail = |saw: String| {
            format!(
                "retention {} s; after {} s the key got: {saw}",
                retention.as_secs(),
                wait.as_secs()
            )
        };
        match self.send(&intent).await {
            Ok(after) => {
                let id = self.id_of(&after);
                let ok =
                    after.status.is_success() && !after.replayed && id.is_some() && id != first_id;
                Check::verdict(
                    EXPIRY,
                    ok,
                    detail(self.saw(&after, first_id.as_deref(), "its first id")),
                    "a new id, not replayed",
                )
            }
            Err(e) => Check::fail(EXPIRY, detail(e)),
        }
    }

    /// A POST of `body` as the account `auth` names, with a fresh key.
    fn post(&self, auth: &HeaderValue, body: &str) -> Intent {
        let mut intent = Intent::post(self.config.url.as_str());
        if !self.config.headers.contains_key(CONTENT_TYPE) {
            intent = intent.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        self.with_headers(intent, auth).body(body.to_owned())
    }

    /// A GET as account A, with no key.
    fn get(&self, url: &Url) -> Intent {
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
    async fn send_once(&self, intent: &Intent) -> Result<Answer, String> {
        answer(self.once.send(intent).await)
    }

    fn id_of(&self, answer: &Answer) -> Option<String> {
        id_in(&answer.body, &self.config.id_field)
    }

    /// "3 ids", "1 id", or that the answers carry none.
    fn count_ids(&self, ids: &BTreeSet<Option<String>>) -> String {
        if ids.contains(&None) {
            format!("no \"{}\" in some answers", self.config.id_field)
        } else if ids.len() == 1 {
            "1 id".to_owned()
        } else {
            format!("{} ids", ids.len())
        }
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
        if answer.replayed {
            out += ", replayed";
        } else if success {
            out += ", not replayed";
        }
        out
    }
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
fn answer(sent: idem_client::Result<Answer>) -> Result<Answer, String> {
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
fn problem(answer: &Answer) -> String {
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
