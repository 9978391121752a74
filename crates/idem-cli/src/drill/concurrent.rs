//! docs/contract.md §7.1: rounds of identical requests sent at once, a fresh key each round.
//!
//! One round of three copies catches a racy implementation only when the copies happen to meet
//! inside its race window, so the drill repeats the round (`--rounds`) and counts the rounds
//! that made more than one resource. The copy whose answer carries the resource (a success
//! with an id) is the original, wherever it stands among the copies: a `409` is never one.
//! `409`s for a request in flight are the draft's answer; once the round is over, each copy
//! refused that way is tried again, as a client would, and must get the original's answer.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use idem_client::{Answer, Intent};
use reqwest::StatusCode;
use reqwest::header::RETRY_AFTER;

use super::Drill;
use super::checks::{Marker, answer, marker, problem, resource_of};
use super::report::{Check, Findings, Rounds};
use super::rules::Rule;

const CONCURRENT: &str = "concurrent";
const IN_FLIGHT: &str = "in-flight";

/// How many times a copy refused as in flight is tried again after its round.
const FOLLOW_UP_ATTEMPTS: usize = 4;
/// The longest wait between those tries, whatever `Retry-After` asks.
const FOLLOW_UP_MAX_WAIT: Duration = Duration::from_secs(2);

/// One copy of a round: its first answer, and its retries' last answer if it was refused.
#[derive(Debug)]
pub(super) struct Copy {
    pub(super) first: Result<Answer, String>,
    pub(super) retried: Option<Result<Answer, String>>,
}

impl Copy {
    /// Its answers, first one first.
    fn answers(&self) -> impl Iterator<Item = &Answer> {
        self.first
            .as_ref()
            .ok()
            .into_iter()
            .chain(self.retried.iter().filter_map(|r| r.as_ref().ok()))
    }
}

/// One round: `n` copies of one request with one key.
#[derive(Debug)]
pub(super) struct Round {
    pub(super) intent: Intent,
    pub(super) copies: Vec<Copy>,
}

impl Round {
    /// The distinct resources its successes carried (by id, or by the whole body when the
    /// answer has no id).
    fn resources(&self, drill: &Drill) -> BTreeSet<String> {
        self.copies
            .iter()
            .flat_map(Copy::answers)
            .filter(|a| a.status.is_success())
            .map(|a| resource_of(drill, a))
            .collect()
    }

    /// The answer that did the work: the first success with an id that is not marked as a
    /// replay, else the first success with an id. Never a refusal.
    pub(super) fn original(&self, drill: &Drill) -> Option<&Answer> {
        let made: Vec<&Answer> = self
            .copies
            .iter()
            .flat_map(Copy::answers)
            .filter(|a| a.status.is_success() && drill.id_of(a).is_some())
            .collect();
        made.iter()
            .find(|a| marker(a) == Marker::None)
            .or(made.first())
            .copied()
    }

    /// Every success it got, the original's replays included.
    pub(super) fn successes(&self) -> Vec<&Answer> {
        self.copies
            .iter()
            .flat_map(Copy::answers)
            .filter(|a| a.status.is_success())
            .collect()
    }

    /// "201 409 409", with each retried copy's final status after an arrow.
    fn statuses(&self) -> String {
        let status = |r: &Result<Answer, String>| match r {
            Ok(a) => a.status.as_u16().to_string(),
            Err(_) => "error".to_owned(),
        };
        self.copies
            .iter()
            .map(|c| match &c.retried {
                Some(r) => format!("{}->{}", status(&c.first), status(r)),
                None => status(&c.first),
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Whether a client would try this answer again with the same key: a refusal for a request
/// in flight or a busy server (`409`, `423`, `425`, `429`, a `5xx`).
fn retried_by_clients(status: StatusCode) -> bool {
    matches!(status.as_u16(), 409 | 423 | 425 | 429) || status.is_server_error()
}

impl Drill {
    /// Runs `--rounds` rounds. An error means the drill could not start: the API did not
    /// answer the first round at all, or refused account A's token.
    pub(super) async fn rounds(&self) -> anyhow::Result<Vec<Round>> {
        self.warm_up().await;
        let mut rounds = Vec::with_capacity(self.config.rounds);
        for i in 0..self.config.rounds {
            let round = self.round().await;
            if i == 0 {
                let firsts: Vec<&Result<Answer, String>> =
                    round.copies.iter().map(|c| &c.first).collect();
                if let Some(Err(e)) = firsts.iter().find(|r| r.is_err())
                    && firsts.iter().all(|r| r.is_err())
                {
                    bail!("{}: {e}", self.config.url);
                }
                let refused = |r: &&Result<Answer, String>| {
                    r.as_ref().is_ok_and(|a| {
                        matches!(a.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
                    })
                };
                if firsts.iter().all(refused) {
                    let status = firsts[0].as_ref().map(|a| a.status).unwrap_or_default();
                    bail!(
                        "{} refused --token-a with {status}: check the token",
                        self.config.url
                    );
                }
            }
            rounds.push(round);
        }
        Ok(rounds)
    }

    /// Opens as many pooled connections as a round sends copies, so the copies of the first
    /// round do not each wait for a connection of their own and arrive apart.
    async fn warm_up(&self) {
        let Ok(url) = self.config.url.join("/") else {
            return;
        };
        let tasks: Vec<_> = (0..self.config.concurrency)
            .map(|_| {
                let (client, intent) = (self.once.clone(), self.get(&url));
                tokio::spawn(async move { client.send(&intent).await })
            })
            .collect();
        for task in tasks {
            // Whatever the path answers: only the connection matters.
            let _ = task.await;
        }
    }

    /// One round: the copies leave together (spawned, past a barrier), each sent once; then
    /// each copy refused as in flight is tried again until it gets another answer.
    async fn round(&self) -> Round {
        let intent = self.post(&self.auth_a, &self.config.body);
        let n = self.config.concurrency;
        let barrier = Arc::new(tokio::sync::Barrier::new(n));
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (client, intent, barrier) =
                    (self.once.clone(), intent.clone(), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    client.send(&intent).await
                })
            })
            .collect();
        let mut copies = Vec::with_capacity(n);
        for task in tasks {
            let first = match task.await {
                Ok(sent) => answer(sent),
                Err(e) => Err(format!("the request task failed: {e}")),
            };
            copies.push(Copy {
                first,
                retried: None,
            });
        }
        // Every copy has answered, so the original has finished: a retry now must get its
        // answer.
        for copy in &mut copies {
            let refused = copy
                .first
                .as_ref()
                .is_ok_and(|a| retried_by_clients(a.status));
            if refused {
                copy.retried = Some(self.follow_up(&intent).await);
            }
        }
        Round { intent, copies }
    }

    /// Tries `intent` again until the answer is not a refusal a client retries, waiting what
    /// `Retry-After` asks (at most two seconds) between tries; the last answer.
    async fn follow_up(&self, intent: &Intent) -> Result<Answer, String> {
        let mut last = self.send_once(intent).await;
        for _ in 1..FOLLOW_UP_ATTEMPTS {
            let wait = match &last {
                Ok(a) if retried_by_clients(a.status) => retry_after(a)
                    .unwrap_or(Duration::from_millis(250))
                    .min(FOLLOW_UP_MAX_WAIT),
                _ => break,
            };
            self.sleeper.sleep(wait).await;
            last = self.send_once(intent).await;
        }
        last
    }

    /// The `concurrent` row: how many rounds made more than one resource.
    pub(super) fn concurrent(&self, rounds: &[Round]) -> (Check, Rounds) {
        let n = self.config.concurrency;
        let extra: Vec<(usize, &Round, usize)> = rounds
            .iter()
            .enumerate()
            .map(|(i, r)| (i + 1, r, r.resources(self).len()))
            .filter(|(_, _, made)| *made > 1)
            .collect();
        let figures = Rounds {
            rounds: rounds.len(),
            copies: n,
            with_extra_resources: extra.len(),
        };
        let plan = format!(
            "{} round{} of {n} copies, a fresh key each",
            rounds.len(),
            if rounds.len() == 1 { "" } else { "s" }
        );
        if rounds.iter().all(|r| r.resources(self).is_empty()) {
            let first = &rounds[0];
            let hint = first
                .copies
                .iter()
                .find_map(|c| c.first.as_ref().ok())
                .filter(|a| !a.status.is_success())
                .map(|a| format!(" ({})", problem(a)))
                .unwrap_or_default();
            return (
                Check::skip(
                    CONCURRENT,
                    Rule::OneEffect,
                    self.config.profile,
                    format!(
                        "{plan}: no copy made a resource: {}{hint} (check --body)",
                        first.statuses()
                    ),
                ),
                figures,
            );
        }
        let saw = if extra.is_empty() {
            format!(
                "{plan}: one resource per round; round 1: {}",
                rounds[0].statuses()
            )
        } else {
            let shown: Vec<String> = extra
                .iter()
                .take(3)
                .map(|(i, r, made)| format!("round {i}: {}, {made} resources", r.statuses()))
                .collect();
            format!(
                "{} of {plan} made more than one resource; {}",
                extra.len(),
                shown.join("; ")
            )
        };
        let mut findings = Findings::new(CONCURRENT, Rule::OneEffect, saw);
        findings.require(
            extra.is_empty(),
            Rule::OneEffect,
            "one resource per key, however many copies meet",
        );
        (findings.judge(self.config.profile), figures)
    }

    /// The `in-flight` row: what the copies that met the original still running were told,
    /// and what their retries got.
    pub(super) fn in_flight(&self, rounds: &[Round]) -> Check {
        let mut conflicts = 0;
        let mut with_retry_after = 0;
        let mut other: Vec<String> = Vec::new();
        let mut waited = 0;
        let mut still_refused = Vec::new();
        for (i, round) in rounds.iter().enumerate() {
            let original = round.original(self);
            for copy in &round.copies {
                let Ok(first) = &copy.first else { continue };
                if first.status.is_success() {
                    let is_original = original.is_some_and(|o| std::ptr::eq(o, first));
                    if !is_original && original.is_some_and(|o| self.same_resource(o, first)) {
                        waited += 1;
                    }
                    continue;
                }
                if first.status == StatusCode::CONFLICT {
                    conflicts += 1;
                    with_retry_after += usize::from(first.headers.contains_key(RETRY_AFTER));
                } else {
                    other.push(format!("{} {}", first.status.as_u16(), problem(first)));
                }
                if let Some(Ok(last)) = &copy.retried
                    && retried_by_clients(last.status)
                {
                    still_refused.push(format!("round {}: {}", i + 1, last.status.as_u16()));
                }
            }
        }
        let refused = conflicts + other.len();
        if refused == 0 {
            let saw = if waited > 0 {
                format!("no copy was refused: {waited} got the original's answer")
            } else {
                "no copy met the original in flight".to_owned()
            };
            return Findings::new(IN_FLIGHT, Rule::InFlightConflict, saw)
                .judge(self.config.profile);
        }
        let mut saw = format!("{refused} copies met the original in flight: ");
        let mut parts = Vec::new();
        if conflicts > 0 {
            parts.push(format!(
                "409 ×{conflicts} ({with_retry_after} with Retry-After)"
            ));
        }
        if !other.is_empty() {
            parts.push(other.join(", "));
        }
        if waited > 0 {
            parts.push(format!("{waited} got its answer without a refusal"));
        }
        saw += &parts.join(", ");
        saw += if still_refused.is_empty() {
            "; tried again once the original had answered, each got its answer"
        } else {
            "; tried again once the original had answered, some were still refused"
        };
        let mut findings = Findings::new(IN_FLIGHT, Rule::InFlightConflict, saw);
        findings
            .require(
                other.is_empty(),
                Rule::InFlightConflict,
                "409 for a request still in progress",
            )
            .require(
                with_retry_after == conflicts,
                Rule::InFlightRetryAfter,
                "Retry-After on each 409",
            )
            .require(
                still_refused.is_empty(),
                Rule::SameAnswer,
                &format!(
                    "the original's answer once it had answered, not {}",
                    still_refused.join(", ")
                ),
            );
        findings.judge(self.config.profile)
    }
}

fn retry_after(answer: &Answer) -> Option<Duration> {
    let value = answer.headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    value.parse::<u64>().ok().map(Duration::from_secs)
}
