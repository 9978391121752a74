//! What one simulation does: the settings `idem simulate`'s flags become.

use std::path::PathBuf;

use reqwest::Url;
use reqwest::header::{HeaderName, HeaderValue};

/// What one simulation does, validated.
#[derive(Debug, Clone)]
pub struct SimulateConfig {
    /// Payment intents per rate.
    pub requests: u64,
    /// The answer-loss rates, each in `[0, 1)`, in the order they run.
    pub losses: Vec<f64>,
    /// The seed of the fault schedule and the client's jitter.
    pub seed: u64,
    /// Intents in flight at once (at least 1).
    pub concurrency: u64,
    /// `sqlite://PATH` of the in-process `idem serve`, or `None` for a fresh file in a
    /// temporary folder. Unused with a [`TargetApi`].
    pub database: Option<String>,
    /// The API to measure (`--url`); `None` for an `idem serve` the simulation starts in this
    /// process, whose database it counts in.
    pub target: Option<TargetApi>,
}

impl SimulateConfig {
    /// `requests` intents at each of `losses`, with seed 42, 32 in flight, a fresh database.
    pub fn new(requests: u64, losses: Vec<f64>) -> Self {
        Self {
            requests,
            losses,
            seed: 42,
            concurrency: 32,
            database: None,
            target: None,
        }
    }
}

/// An API of the caller's own, measured through the fault injector (`idem simulate --url`).
///
/// Its charges are counted as the distinct resource ids each intent's `2xx` answers carried,
/// as the fault injector saw them (lost answers included), and, with a [`ResourceList`], as
/// the resources the API lists. In [`body`](Self::body), in header values and in the list's
/// URL, `{{run}}` becomes the id of the (rate, variant) run and `{{intent}}` the intent's
/// number in it.
#[derive(Debug, Clone)]
pub struct TargetApi {
    /// The endpoint each intent POSTs to, `http://` or `https://`.
    pub url: Url,
    /// Each intent's body (sent as JSON unless a header sets `Content-Type`).
    pub body: String,
    /// Headers of every request (its credentials, say), the list's GET included.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Where a `2xx` answer's resource id is: a dotted path (`data.id`) or a JSON pointer
    /// (`/data/id`).
    pub id_field: String,
    /// Where the API lists what it created, to count that too.
    pub list: Option<ResourceList>,
    /// PEM files of private CAs trusted beside the platform's roots, for `https://`.
    pub ca_certs: Vec<PathBuf>,
}

impl TargetApi {
    /// POSTs of [`crate::drill::DEFAULT_BODY`] to `url`, ids in `id`, no list, no headers.
    pub fn new(url: Url) -> Self {
        Self {
            url,
            body: crate::drill::DEFAULT_BODY.to_owned(),
            headers: Vec::new(),
            id_field: "id".to_owned(),
            list: None,
            ca_certs: Vec::new(),
        }
    }
}

/// A `GET` that lists the API's resources (`--list-url`), fetched before and after each run:
/// the resources it gained in between are the ones the run created.
///
/// The answer is a JSON array of resources, or an object with that array at
/// [`field`](Self::field) (`{"data": [...]}`, as Stripe and `idem serve` answer); each
/// resource's id is at the [`TargetApi::id_field`]. Pages are not followed: the list must
/// hold every resource the run made (filter it by `{{run}}` where the API can, so it holds
/// only those).
#[derive(Debug, Clone)]
pub struct ResourceList {
    /// The list's URL; `{{run}}` is replaced.
    pub url: String,
    /// Where the array is when the answer is an object: a dotted path or a JSON pointer.
    pub field: String,
}

impl ResourceList {
    /// The list at `url`, its array in `data` unless the answer is an array itself.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            field: "data".to_owned(),
        }
    }
}

/// `template` with `{{run}}` replaced by `run` and `{{intent}}` by `intent`.
pub(crate) fn render(template: &str, run: &str, intent: u64) -> String {
    template
        .replace("{{run}}", run)
        .replace("{{intent}}", &intent.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_name_the_run_and_the_intent() {
        assert_eq!(
            render(
                r#"{"ref": "{{run}}-{{intent}}", "n": {{intent}}}"#,
                "sim-1",
                7
            ),
            r#"{"ref": "sim-1-7", "n": 7}"#
        );
        assert_eq!(render("no placeholder", "sim-1", 7), "no placeholder");
    }
}
