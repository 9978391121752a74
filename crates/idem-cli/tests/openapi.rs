//! `GET /openapi.json` against a real `idem serve`: the document is OpenAPI 3.1, it lists the
//! routes the router has with the methods the router answers, every problem type the server
//! emits is a schema, the Idempotency-Key pattern accepts exactly the keys the server accepts,
//! and the answers the server gives to provoked failures are the ones the document lists.
//! `scripts/schemathesis.sh` explores the same document with generated requests.

use std::collections::BTreeSet;

use crate::common::{ALICE, Answer, TestServer, send, start_psp};
use idem_cli::fake_psp::Faults;
use idem_core::ProblemKind;
use serde_json::Value;

const BODY: &str = r#"{"amount": 49900, "currency": "INR"}"#;
const PAYOUT: &str = r#"{"amount": 2500, "currency": "EUR"}"#;

/// The routes `App::router` builds: path, methods.
const ROUTES: &[(&str, &[&str])] = &[
    ("/payments", &["get", "post"]),
    ("/payments/{id}", &["get"]),
    ("/invoices", &["post"]),
    ("/payouts", &["post"]),
    ("/healthz", &["get"]),
    ("/metrics", &["get"]),
    ("/idempotency-policy", &["get"]),
    ("/openapi.json", &["get"]),
];

async fn document(server: &TestServer) -> Value {
    // No credentials: the document is public.
    let answer = send(server.get("/openapi.json")).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.headers["content-type"], "application/json");
    answer.body
}

/// Follows a local `$ref` (`#/components/...`).
fn resolve<'a>(doc: &'a Value, value: &'a Value) -> &'a Value {
    match value.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let pointer = reference.strip_prefix('#').expect("a local reference");
            let target = doc
                .pointer(pointer)
                .unwrap_or_else(|| panic!("{reference} resolves"));
            resolve(doc, target)
        }
        None => value,
    }
}

fn refs(value: &Value, found: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref") {
                found.push(r.clone());
            }
            map.values().for_each(|v| refs(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, found)),
        _ => {}
    }
}

/// The problem `type`s a problem schema allows.
fn problem_types(doc: &Value, schema: &Value) -> Vec<String> {
    let schema = resolve(doc, schema);
    match schema.get("oneOf").and_then(Value::as_array) {
        Some(alternatives) => alternatives
            .iter()
            .flat_map(|s| problem_types(doc, s))
            .collect(),
        None => schema["properties"]["type"]["enum"]
            .as_array()
            .expect("a problem schema names its type")
            .iter()
            .map(|t| t.as_str().unwrap().to_owned())
            .collect(),
    }
}

/// Asserts that `answer` is one the document lists for `method path`: its status, its content
/// type, its required headers, and for problem details its `type` and `status`.
fn assert_documented(doc: &Value, method: &str, path: &str, answer: &Answer) {
    let what = format!("{} {method} {path}: {}", answer.status, answer.body);
    let operation = &doc["paths"][path][method];
    let response = operation["responses"]
        .get(answer.status.to_string())
        .unwrap_or_else(|| panic!("undocumented status: {what}"));
    let response = resolve(doc, response);
    let content_type = answer.headers["content-type"].to_str().unwrap();
    let media = response["content"]
        .get(content_type)
        .unwrap_or_else(|| panic!("undocumented content type {content_type}: {what}"));
    for (name, header) in response["headers"].as_object().into_iter().flatten() {
        if resolve(doc, header)["required"] == true {
            assert!(answer.headers.contains_key(name.as_str()), "{name}: {what}");
        }
    }
    if content_type == "application/problem+json" {
        let kind = answer.body["type"].as_str().unwrap().to_owned();
        assert!(
            problem_types(doc, &media["schema"]).contains(&kind),
            "undocumented problem type: {what}"
        );
        let schema = schemas_of_type(doc, &kind);
        assert!(
            schema["properties"]["status"]["enum"]
                .as_array()
                .unwrap()
                .contains(&Value::from(answer.status)),
            "the {kind} schema does not allow status {what}"
        );
    }
}

fn schemas_of_type<'a>(doc: &'a Value, kind: &str) -> &'a Value {
    doc["components"]["schemas"]
        .as_object()
        .unwrap()
        .values()
        .find(|s| s["properties"]["type"]["enum"] == serde_json::json!([kind]))
        .unwrap_or_else(|| panic!("no schema for {kind}"))
}

#[tokio::test]
async fn the_document_is_openapi_3_1_and_every_reference_resolves() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    assert_eq!(doc["openapi"], "3.1.0");
    let parsed: utoipa::openapi::OpenApi =
        serde_json::from_value(doc.clone()).expect("an OpenAPI document");
    assert_eq!(parsed.info.title, "idem serve");
    let mut found = Vec::new();
    refs(&doc, &mut found);
    assert!(found.len() > 20, "{found:?}");
    for reference in &found {
        let pointer = reference.strip_prefix('#').unwrap();
        assert!(
            doc.pointer(pointer).is_some(),
            "{reference} does not resolve"
        );
    }
    let bearer = &doc["components"]["securitySchemes"]["bearer"];
    assert_eq!(bearer["type"], "http");
    assert_eq!(bearer["scheme"], "bearer");
    // The stateful phase of schemathesis chains a created payment to its GET.
    let link = &doc["paths"]["/payments"]["post"]["responses"]["201"]["links"]["GetPaymentById"];
    assert_eq!(link["operationId"], "getPayment");
    assert_eq!(link["parameters"]["id"], "$response.body#/id");
    server.stop().await;
}

#[tokio::test]
async fn every_route_of_the_router_is_documented_with_the_methods_it_answers() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let documented: BTreeSet<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let routes: BTreeSet<&str> = ROUTES.iter().map(|(path, _)| *path).collect();
    assert_eq!(documented, routes);
    for (path, methods) in ROUTES {
        let item = doc["paths"][path].as_object().unwrap();
        let documented: BTreeSet<&str> = item.keys().map(String::as_str).collect();
        let methods: BTreeSet<&str> = methods.iter().copied().collect();
        assert_eq!(documented, methods, "{path}");
        // The router says which methods a path has in the Allow of its 405 to a method it
        // lacks (DELETE, which no route has and no layer covers).
        let concrete = path.replace("{id}", "pay_openapi");
        let delete = server.request(reqwest::Method::DELETE, &concrete);
        let answer = send(delete.bearer_auth(ALICE)).await;
        assert_eq!(answer.status, 405, "DELETE {path}");
        let allow: BTreeSet<String> = answer.headers["allow"]
            .to_str()
            .unwrap()
            .split(',')
            .map(|m| m.trim().to_ascii_lowercase())
            .filter(|m| m != "head")
            .collect();
        let methods: BTreeSet<String> = methods.iter().map(|m| m.to_string()).collect();
        assert_eq!(allow, methods, "{path}");
        // Every operation that needs a token says so, and refuses a request without one.
        for method in item.keys() {
            let needs_token = item[method].get("security").is_some();
            let request = server.request(method.to_uppercase().parse().unwrap(), &concrete);
            let status = request.send().await.unwrap().status().as_u16();
            assert_eq!(status == 401, needs_token, "{method} {path}: {status}");
        }
    }
    server.stop().await;
}

/// Every problem type idem serve emits: the layer's (idem-core's kinds it uses) and the
/// service's own.
fn emitted_problem_types() -> Vec<&'static str> {
    let layer = [
        ProblemKind::MissingKey,
        ProblemKind::MalformedKey,
        ProblemKind::MalformedBody,
        ProblemKind::Mismatch,
        ProblemKind::InUse,
        ProblemKind::OutcomeUnknown,
        ProblemKind::BodyTooLarge,
        ProblemKind::BodyTimeout,
        ProblemKind::StoreUnavailable,
        ProblemKind::UpstreamUnavailable,
        ProblemKind::HandlerFailed,
    ]
    .map(ProblemKind::type_uri);
    let service = [
        "urn:idem:problem:validation",
        "urn:idem:problem:unauthorized",
        "urn:idem:problem:not-found",
        "urn:idem:problem:internal",
        "urn:idem:problem:card-declined",
    ];
    layer.into_iter().chain(service).collect()
}

#[tokio::test]
async fn every_problem_type_is_a_schema_of_rfc_9457_members() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    for kind in emitted_problem_types() {
        let schema = schemas_of_type(&doc, kind);
        for member in ["type", "title", "status", "detail"] {
            assert!(
                schema["properties"].get(member).is_some(),
                "{kind}: {member}"
            );
            assert!(
                schema["required"]
                    .as_array()
                    .unwrap()
                    .contains(&member.into()),
                "{kind}: {member}"
            );
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn provoked_refusals_are_answers_the_document_lists() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let post = |path: &str, key: Option<&str>, body: &str| server.post_to(path, ALICE, key, body);
    let cases: Vec<(&str, reqwest::RequestBuilder, &str)> = vec![
        ("/payments", post("/payments", None, BODY), "missing-key"),
        (
            "/payments",
            post("/payments", Some("short"), BODY),
            "malformed-key",
        ),
        (
            "/payments",
            post(
                "/payments",
                Some("openapi-dup-member"),
                r#"{"amount": 1, "amount": 2}"#,
            ),
            "malformed-body",
        ),
        (
            "/payments",
            post(
                "/payments",
                Some("openapi-validation"),
                r#"{"amount": 0, "currency": "INR"}"#,
            ),
            "validation",
        ),
        (
            "/invoices",
            post(
                "/invoices",
                Some("openapi-invoice-bad"),
                r#"{"amount": 1, "currency": "inr"}"#,
            ),
            "validation",
        ),
        // PostgreSQL's text cannot hold NUL: refused up front on every database, not a 500.
        (
            "/payments",
            post(
                "/payments",
                Some("openapi-nul-reference"),
                r#"{"amount": 1, "currency": "INR", "reference": "a\u0000b"}"#,
            ),
            "validation",
        ),
        (
            "/payments",
            post("/payments", Some("openapi-too-large"), &"x".repeat(2 << 20)),
            "body-too-large",
        ),
        (
            "/payments",
            server
                .request(reqwest::Method::POST, "/payments")
                .body(BODY),
            "unauthorized",
        ),
    ];
    for (path, request, kind) in cases {
        let answer = send(request).await;
        assert_eq!(answer.problem_type(), format!("urn:idem:problem:{kind}"));
        assert_documented(&doc, "post", path, &answer);
    }

    // A payment, its replay, its mismatch, its GET, a GET of someone else's id.
    let first = send(post("/payments", Some("openapi-payment-1"), BODY)).await;
    assert_eq!(first.status, 201);
    assert_documented(&doc, "post", "/payments", &first);
    // The reference's limit counts characters, as the schema's maxLength does.
    let long_reference = format!(
        r#"{{"amount": 1, "currency": "INR", "reference": "{}"}}"#,
        "é".repeat(255)
    );
    let accented = send(post(
        "/payments",
        Some("openapi-reference-255"),
        &long_reference,
    ))
    .await;
    assert_eq!(accented.status, 201, "{}", accented.body);
    let replay = send(post("/payments", Some("openapi-payment-1"), BODY)).await;
    assert!(replay.replayed());
    assert_documented(&doc, "post", "/payments", &replay);
    let mismatch = send(post(
        "/payments",
        Some("openapi-payment-1"),
        r#"{"amount": 1, "currency": "INR"}"#,
    ))
    .await;
    assert_eq!(mismatch.problem_type(), "urn:idem:problem:mismatch");
    assert_documented(&doc, "post", "/payments", &mismatch);
    for id in [first.id(), "pay_nobody"] {
        let answer = send(server.get(&format!("/payments/{id}")).bearer_auth(ALICE)).await;
        assert_documented(&doc, "get", "/payments/{id}", &answer);
    }
    let list = send(server.get("/payments").bearer_auth(ALICE)).await;
    let ids: Vec<&str> = list.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [accented.id(), first.id()], "newest first");
    assert_documented(&doc, "get", "/payments", &list);
    for path in ["/healthz", "/idempotency-policy", "/metrics"] {
        let answer = send(server.get(path)).await;
        assert_eq!(answer.status, 200);
        let content_type = answer.headers["content-type"].to_str().unwrap();
        let media = content_type.split(';').next().unwrap();
        assert!(
            doc["paths"][path]["get"]["responses"]["200"]["content"]
                .get(media)
                .is_some(),
            "{path}: {content_type}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn payout_failures_are_answers_the_document_lists() {
    let (psp, psp_url) = start_psp().await;
    let server = TestServer::start_with(|config| config.psp_url = Some(psp_url)).await;
    let doc = document(&server).await;
    let payout = |key: &str| server.post_to("/payouts", ALICE, Some(key), PAYOUT);
    let paid = send(payout("openapi-payout-paid")).await;
    assert_eq!(paid.status, 201);
    assert_documented(&doc, "post", "/payouts", &paid);

    psp.set_faults(Faults {
        decline_next: 1,
        ..Faults::default()
    })
    .await;
    let declined = send(payout("openapi-payout-declined")).await;
    assert_eq!(declined.problem_type(), "urn:idem:problem:card-declined");
    assert_documented(&doc, "post", "/payouts", &declined);
    let replayed = send(payout("openapi-payout-declined")).await;
    assert!(replayed.replayed());
    assert_documented(&doc, "post", "/payouts", &replayed);

    // The reconciler's lookup takes its time, so the retry below meets the unknown record.
    psp.set_faults(Faults {
        fail_next: 1,
        lookup_delay_ms: 2000,
        ..Faults::default()
    })
    .await;
    let failed = send(payout("openapi-payout-failed")).await;
    assert_eq!(
        (failed.status, failed.problem_type()),
        (502, "urn:idem:problem:outcome-unknown")
    );
    assert_documented(&doc, "post", "/payouts", &failed);
    // Its outcome is unknown until the reconciler has asked the provider: the retry gets 409.
    let pending = send(payout("openapi-payout-failed")).await;
    assert_eq!(
        (pending.status, pending.problem_type()),
        (409, "urn:idem:problem:outcome-unknown")
    );
    assert_documented(&doc, "post", "/payouts", &pending);
    server.stop().await;

    // A provider nobody listens on: nothing was sent.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let server = TestServer::start_with(|config| config.psp_url = Some(nowhere)).await;
    let answer = send(
        server
            .request(reqwest::Method::POST, "/payouts")
            .bearer_auth(ALICE)
            .header("idempotency-key", "openapi-payout-nowhere")
            .body(PAYOUT),
    )
    .await;
    assert_eq!(
        answer.problem_type(),
        "urn:idem:problem:upstream-unavailable"
    );
    assert_documented(&doc, "post", "/payouts", &answer);
    server.stop().await;
}

#[tokio::test]
async fn the_key_pattern_accepts_exactly_the_keys_the_server_accepts() {
    let server = TestServer::start().await;
    let doc = document(&server).await;
    let schema = &doc["components"]["parameters"]["IdempotencyKey"]["schema"];
    let pattern = regex::Regex::new(schema["pattern"].as_str().unwrap()).unwrap();
    let (min, max) = (
        schema["minLength"].as_u64().unwrap() as usize,
        schema["maxLength"].as_u64().unwrap() as usize,
    );
    let documented = |key: &str| pattern.is_match(key) && (min..=max).contains(&key.len());
    let long = |n: usize| "k".repeat(n);
    let cases: Vec<(String, bool)> = vec![
        ("8e03978e-40d5-43e8-bc93-6894a57f9324".into(), true),
        ("\"8e03978e-40d5-43e8-bc93-6894a57f9325\"".into(), true),
        (r#""abc\"def\\gh""#.into(), true),
        (":YWJjZGVmZ2hpams=:".into(), true),
        ("12345678".into(), true),
        ("~!#$%&'()*+-./<=>?@[]^_`{|}".into(), true),
        (long(255), true),
        (format!("\"{}\"", "m".repeat(255)), true),
        (format!("\"{}\"", r"\\".repeat(255)), true),
        ("1234567".into(), false),
        ("\"1234567\"".into(), false),
        (long(256), false),
        (format!("\"{}\"", "m".repeat(256)), false),
        ("abcdefgh,ijklmnop".into(), false),
        ("abcdefgh;a=1".into(), false),
        ("\"abcdefgh\";a=1".into(), false),
        ("\"abcdefgh\", \"ijklmnop\"".into(), false),
        ("\"abcd efgh\"".into(), false),
        ("abcd efgh".into(), false),
        ("abc\"defgh".into(), false),
        ("\"unterminated".into(), false),
        (r#""bad\escape""#.into(), false),
    ];
    for (key, accepted) in &cases {
        assert_eq!(documented(key), *accepted, "the pattern on {key}");
        let answer = send(server.post(ALICE, Some(key), BODY)).await;
        let expected = if *accepted { 201 } else { 400 };
        assert_eq!(
            answer.status, expected,
            "the server on {key}: {}",
            answer.body
        );
        if !accepted {
            assert_eq!(answer.problem_type(), "urn:idem:problem:malformed-key");
        }
    }
    // The bare and the quoted form name the same key.
    let bare = send(server.post(ALICE, Some("openapi-same-key"), BODY)).await;
    let quoted = send(server.post(ALICE, Some("\"openapi-same-key\""), BODY)).await;
    assert!(quoted.replayed());
    assert_eq!(bare.id(), quoted.id());
    server.stop().await;
}
