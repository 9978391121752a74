//! Micro-benchmarks of the core, defined once: `cargo bench -p idem-bench` runs them under
//! criterion, and the harness times them with a simple loop so that its one command covers
//! them too.

use std::hint::black_box;
use std::time::{Duration, Instant};

use idem_core::{
    AccountId, Fingerprint, IdempotencyKey, KeyLimits, Policy, Record, RecordState, RequestParts,
    Scope, StoredResponse, Timestamp, decide,
};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// One micro-benchmark: a name and the operation it times.
pub struct MicroCase {
    /// A stable name (`fingerprint-64k`).
    pub id: &'static str,
    /// What it does.
    pub title: &'static str,
    /// The bytes one operation processes, when that is meaningful.
    pub bytes: Option<usize>,
    /// One operation.
    pub run: Box<dyn FnMut()>,
}

impl std::fmt::Debug for MicroCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicroCase")
            .field("id", &self.id)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// A JSON order of about `len` bytes: members out of order, nested objects and arrays, numbers
/// as written (fractions, a big integer), strings with escapes. Deterministic.
pub fn json_body(len: usize) -> Vec<u8> {
    let mut out = String::from(r#"{"currency": "INR", "amount": 49900, "items": ["#);
    let tail = r#"], "customer": {"name": "Asha \"A.\" Rao", "id": 9007199254740993, "vip": true}, "reference": "order-1042"}"#;
    let mut i = 0;
    loop {
        let item = format!(
            r#"{{"sku": "SKU-{i:05}", "qty": {}, "price": 12.50, "note": "line {i}\u00e9\n", "tags": ["a", "b"], "discount": null}}"#,
            i % 7 + 1
        );
        if out.len() + item.len() + 2 + tail.len() > len && i > 0 {
            break;
        }
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&item);
        i += 1;
    }
    out.push_str(tail);
    out.into_bytes()
}

fn parts(body: &[u8]) -> RequestParts<'_> {
    RequestParts {
        account: "acct_alice",
        method: "POST",
        route: "/payments",
        query: "",
        content_type: "application/json",
        body,
    }
}

/// When the record the decision reads was made; the decision runs a second later.
const RECORDED_AT: Timestamp = Timestamp(1_795_992_070_553);

fn completed_record(fingerprint: Fingerprint) -> Record {
    let key = IdempotencyKey::parse(b"order-1042-pay", KeyLimits::default()).expect("valid key");
    Record {
        scope: Scope::new(AccountId::new("acct_alice"), key),
        fingerprint,
        state: RecordState::Completed(StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: br#"{"id":"pay_1","amount":49900,"currency":"INR"}"#.to_vec(),
            body_omitted: false,
        }),
        created_at: RECORDED_AT,
        expires_at: RECORDED_AT.plus(Policy::default().retention),
    }
}

impl MicroCase {
    fn new(
        id: &'static str,
        title: &'static str,
        bytes: Option<usize>,
        run: impl FnMut() + 'static,
    ) -> Self {
        Self {
            id,
            title,
            bytes,
            run: Box::new(run),
        }
    }
}

/// Parsing the `Idempotency-Key` header value `raw`.
fn key_case(id: &'static str, title: &'static str, raw: &'static [u8]) -> MicroCase {
    let limits = KeyLimits::default();
    MicroCase::new(id, title, None, move || {
        black_box(IdempotencyKey::parse(black_box(raw), limits)).expect("valid key");
    })
}

/// Fingerprinting a request whose body is `body`.
fn fingerprint_case(id: &'static str, title: &'static str, body: Vec<u8>) -> MicroCase {
    MicroCase::new(id, title, Some(body.len()), move || {
        black_box(Fingerprint::compute(&parts(black_box(&body)))).expect("valid JSON");
    })
}

/// Deciding on a request with `fingerprint` whose key holds `record`.
fn decide_case(
    id: &'static str,
    title: &'static str,
    record: Record,
    fingerprint: Fingerprint,
) -> MicroCase {
    let now = Timestamp(RECORDED_AT.0 + 1000);
    MicroCase::new(id, title, None, move || {
        black_box(decide(
            Some(black_box(&record)),
            black_box(&fingerprint),
            now,
        ));
    })
}

/// Every micro-benchmark.
pub fn cases() -> Vec<MicroCase> {
    let body_1k = json_body(1024);
    let body_64k = json_body(64 * 1024);
    let raw_64k = body_64k.clone();
    let fingerprint = Fingerprint::compute(&parts(&body_1k)).expect("valid JSON");
    let other = Fingerprint::compute(&parts(b"{}")).expect("valid JSON");
    let record = completed_record(fingerprint);
    let key = b"order-1042-pay-2026-11-29";
    let sf_string = br#""order-1042-pay-2026-11-29""#;
    vec![
        key_case("key-bare", "parse a bare Idempotency-Key", key),
        key_case(
            "key-sf-string",
            "parse an sf-string Idempotency-Key",
            sf_string,
        ),
        fingerprint_case("fingerprint-1k", "fingerprint a 1 KiB JSON body", body_1k),
        fingerprint_case(
            "fingerprint-64k",
            "fingerprint a 64 KiB JSON body",
            body_64k,
        ),
        MicroCase::new(
            "sha256-64k",
            "SHA-256 of the same 64 KiB, raw (the hashing floor)",
            Some(raw_64k.len()),
            move || {
                black_box(Sha256::digest(black_box(&raw_64k)));
            },
        ),
        decide_case(
            "decide-replay",
            "decide: same request, completed record",
            record.clone(),
            fingerprint,
        ),
        decide_case(
            "decide-mismatch",
            "decide: different request, same key",
            record,
            other,
        ),
    ]
}

/// A micro-benchmark's result in the harness.
#[derive(Debug, Clone, Serialize)]
pub struct MicroResult {
    /// The case's id.
    pub id: &'static str,
    /// What it does.
    pub title: &'static str,
    /// Median nanoseconds per operation over the batches.
    pub ns_per_op: f64,
    /// Bytes processed per operation, if meaningful.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<usize>,
    /// MiB/s, if bytes are meaningful.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mib_per_s: Option<f64>,
}

/// Times `case` for about `budget`: batches of at least a millisecond, median ns per op.
pub fn time(mut case: MicroCase, budget: Duration) -> MicroResult {
    // Warm up and size a batch so that the clock's resolution does not matter.
    let mut batch = 1u64;
    loop {
        let start = Instant::now();
        for _ in 0..batch {
            (case.run)();
        }
        if start.elapsed() >= Duration::from_millis(1) || batch >= 1 << 30 {
            break;
        }
        batch *= 2;
    }
    let mut per_op = Vec::new();
    let until = Instant::now() + budget;
    while Instant::now() < until || per_op.len() < 5 {
        let start = Instant::now();
        for _ in 0..batch {
            (case.run)();
        }
        per_op.push(start.elapsed().as_nanos() as f64 / batch as f64);
    }
    let ns_per_op = crate::stats::median(&per_op).expect("at least one batch");
    MicroResult {
        id: case.id,
        title: case.title,
        ns_per_op,
        bytes: case.bytes,
        mib_per_s: case
            .bytes
            .map(|b| b as f64 / (ns_per_op / 1e9) / (1024.0 * 1024.0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_about_the_size_asked_and_valid_json() {
        for len in [1024, 64 * 1024] {
            let body = json_body(len);
            assert!(
                body.len() <= len && body.len() > len * 9 / 10,
                "{}",
                body.len()
            );
            let _: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        }
    }

    #[test]
    fn every_case_runs_and_times() {
        for case in cases() {
            let result = time(case, Duration::from_millis(5));
            assert!(result.ns_per_op > 0.0, "{}", result.id);
        }
    }
}
