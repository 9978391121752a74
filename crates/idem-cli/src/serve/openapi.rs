//! The OpenAPI 3.1 document of `idem serve`, served at `GET /openapi.json`.
//!
//! Written by hand with utoipa's builders rather than derived from the handlers: the statuses
//! that matter most here (the idempotency layer's `400`/`409`/`422`/`503`, the
//! authentication's `401`) come from layers the handlers never see, so only a document written
//! route by route can list every answer a route gives. `tests/openapi.rs` and
//! `scripts/schemathesis.sh` hold it to what the server does.

use std::collections::{BTreeMap, BTreeSet};

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use idem_core::{KeyLimits, Policy, ProblemKind};
use serde_json::json;
use utoipa::openapi::extensions::Extensions;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::path::{
    HttpMethod, Operation, OperationBuilder, Parameter, ParameterBuilder, ParameterIn, PathItem,
};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::{ResponseBuilder, ResponsesBuilder};
use utoipa::openapi::schema::{
    AdditionalProperties, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type,
};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    Components, ComponentsBuilder, ContentBuilder, InfoBuilder, OpenApi, OpenApiBuilder, Paths,
    PathsBuilder, Ref, RefOr, Required,
};

use super::app::App;
use super::backend::Backend;
use super::error::ApiError;

/// The media type of every problem-details answer (RFC 9457).
const PROBLEM_JSON: &str = "application/problem+json";
const JSON: &str = "application/json";

/// One problem type idem serve answers with: its `type`, the statuses it comes with, and what
/// it means here.
struct ProblemType {
    uri: &'static str,
    statuses: BTreeSet<u16>,
    description: &'static str,
}

/// Every problem type idem serve can answer with: the idempotency layers' (those of
/// idem-core's [`ProblemKind`]s they answer on these routes) and the service's own (every
/// [`ApiError`]), the statuses of a type both answer merged into one schema.
fn problem_types() -> Vec<ProblemType> {
    let layer = ProblemKind::ALL
        .into_iter()
        .filter_map(|kind| Some((kind.type_uri(), kind.status(), layer_description(kind)?)));
    let service = ApiError::every().into_iter().map(|error| {
        let description = service_description(&error);
        (error.type_uri(), error.status().as_u16(), description)
    });
    let mut types: BTreeMap<&'static str, (BTreeSet<u16>, Option<&'static str>)> = BTreeMap::new();
    for (uri, status, description) in layer.map(|(u, s, d)| (u, s, Some(d))).chain(service) {
        let (statuses, described) = types.entry(uri).or_default();
        statuses.insert(status);
        *described = described.or(description);
    }
    types
        .into_iter()
        .map(|(uri, (statuses, description))| ProblemType {
            uri,
            statuses,
            description: description
                .unwrap_or_else(|| panic!("{uri} has no description in the document")),
        })
        .collect()
}

/// The kinds of idem-core's that no route of idem serve answers: the gateway's upstream
/// failures and credential scope (a payout's unreachable provider is the service's own
/// [`ApiError::ProviderUnreachable`]), a missing account (authentication runs before the
/// layers), and a missing transaction (only routes behind the transactional layer take one).
const NOT_ANSWERED_HERE: [ProblemKind; 5] = [
    ProblemKind::UpstreamUnavailable,
    ProblemKind::UpstreamTimeout,
    ProblemKind::NoAccount,
    ProblemKind::NoCredential,
    ProblemKind::NoTransaction,
];

/// What a problem of the idempotency layers means on these routes; `None` for those in
/// [`NOT_ANSWERED_HERE`] (a unit test holds every kind to one or the other).
fn layer_description(kind: ProblemKind) -> Option<&'static str> {
    if NOT_ANSWERED_HERE.contains(&kind) {
        return None;
    }
    Some(match kind {
        ProblemKind::MissingKey => {
            "A POST came without an Idempotency-Key header. Nothing was stored."
        }
        ProblemKind::MalformedKey => {
            "The Idempotency-Key header is malformed: outside 8-255 characters of visible ASCII, a list, parameters, or several fields. Nothing was stored."
        }
        ProblemKind::MalformedBody => {
            "The body could not be fingerprinted (a JSON object with a duplicate member, or a body that could not be read). Nothing was stored."
        }
        ProblemKind::BodyTimeout => "The request body did not arrive in time. Nothing was stored.",
        ProblemKind::InUse => {
            "The key's original request is still running; retry after Retry-After seconds."
        }
        // The layer's 409 and the payout handler's 502/504 (ApiError's provider failures).
        ProblemKind::OutcomeUnknown => {
            "A payout may or may not have happened (the provider failed or did not answer, 502/504), or such a payout is being reconciled with the provider (409). Retry with the same key to learn which."
        }
        ProblemKind::BodyTooLarge => "The request body is over the limit. Nothing was stored.",
        ProblemKind::Mismatch => {
            "The key was used for a different request (method, path, query, content type or body). The stored record is untouched."
        }
        ProblemKind::HandlerFailed => {
            "The handler failed unexpectedly (it panicked). Nothing was stored and the key is free: a retry with the same key runs again (a payout whose outcome may be unknown is reconciled first)."
        }
        // The layer's and the handlers' alike (ApiError::StoreUnavailable).
        ProblemKind::StoreUnavailable => {
            "The database is unavailable; the request was not processed. Retry after Retry-After seconds with the same key."
        }
        // A kind idem-core gained since: the unit test asks for a description or a reason.
        _ => return None,
    })
}

/// What one of the service's own problems means; `None` where the layer's kind of the same
/// `type` describes it.
fn service_description(error: &ApiError) -> Option<&'static str> {
    Some(match error {
        ApiError::Invalid(_) => {
            "The request is not a valid payment request (amount a positive integer, currency three capital letters). Not stored: fix the request and retry with the same key."
        }
        ApiError::Unauthorized => "No registered sandbox token in `Authorization: Bearer <token>`.",
        ApiError::CardDeclined => {
            "The payment provider declined the payout: a business outcome, stored and replayed."
        }
        ApiError::NotFound { .. } => "No such payment in the authenticated account.",
        ApiError::NotRecorded => {
            "The payment could not be recorded. Nothing was charged or stored; retry with the same key."
        }
        ApiError::ProviderUnreachable => {
            "The payment provider could not be reached; nothing was sent to it, so a retry with the same key runs fresh."
        }
        ApiError::ProviderFailed
        | ApiError::ProviderUnreadable
        | ApiError::ProviderSilent
        | ApiError::StoreUnavailable => return None,
    })
}

/// The component name of the schema of the problem `type` `uri`:
/// `urn:idem:problem:in-use` is `InUseProblem`.
fn schema_name(uri: &str) -> String {
    let name = uri
        .strip_prefix("urn:idem:problem:")
        .expect("every problem type is an idem URN");
    let mut schema: String = name
        .split('-')
        .flat_map(|word| {
            let mut chars = word.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase())
                .into_iter()
                .chain(chars)
        })
        .collect();
    schema.push_str("Problem");
    schema
}

/// `GET /openapi.json`: the document, for the policy this server runs with.
pub(crate) async fn document<B: Backend>(State(app): State<App<B>>) -> Response {
    Json(build(&app.policy)).into_response()
}

/// The regular expression of an `Idempotency-Key` field value the server accepts with
/// `limits`: a bare key (visible ASCII without `"`, `,` and `;`) or an sf-string whose
/// unescaped value is visible ASCII (`\"` and `\\` are one character each). Mirrors
/// `idem_core::IdempotencyKey::parse`, less the optional whitespace around the value, which
/// HTTP strips before the server sees it.
pub(crate) fn key_pattern(limits: KeyLimits) -> String {
    let (min, max) = (limits.min_len, limits.max_len);
    // Written with hex escapes, which ECMA-262, Python and Rust regexes all read alike.
    format!(
        r#"^(?:[\x21\x23-\x2B\x2D-\x3A\x3C-\x7E]{{{min},{max}}}|"(?:[\x21\x23-\x5B\x5D-\x7E]|\\["\\]){{{min},{max}}}")$"#
    )
}

fn build(policy: &Policy) -> OpenApi {
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("idem serve")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "The reference payments API of idem: every POST takes an Idempotency-Key, and a retry of the same request with the same key gets the first answer again instead of a second payment.",
                ))
                .build(),
        )
        .paths(paths())
        .components(Some(components(policy)))
        .build()
}

/// Every route, one operation each; `/payments` twice, for its POST and its GET.
fn paths() -> Paths {
    let operations = [
        ("/payments", HttpMethod::Post, create_payment()),
        ("/payments", HttpMethod::Get, list_payments()),
        ("/payments/{id}", HttpMethod::Get, get_payment()),
        ("/invoices", HttpMethod::Post, create_invoice()),
        ("/payouts", HttpMethod::Post, create_payout()),
        ("/healthz", HttpMethod::Get, healthz()),
        ("/metrics", HttpMethod::Get, metrics()),
        ("/idempotency-policy", HttpMethod::Get, idempotency_policy()),
        ("/openapi.json", HttpMethod::Get, openapi_json()),
    ];
    operations
        .into_iter()
        .fold(PathsBuilder::new(), |paths, (path, method, operation)| {
            paths.path(path, PathItem::new(method, operation))
        })
        .build()
}

/// The security scheme, the key parameter, the shared headers and every schema.
fn components(policy: &Policy) -> Components {
    let mut components = ComponentsBuilder::new()
        .security_scheme(
            "bearer",
            SecurityScheme::Http(
                Http::builder()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A sandbox token registered with `idem serve --token TOKEN=ACCOUNT` (by default `sk_test_alice` and `sk_test_bob`). Keys are scoped to the account it authenticates.",
                    ))
                    .build(),
            ),
        )
        .parameter("IdempotencyKey", key_parameter(policy));
    for (name, header) in headers() {
        components = components.header(name, header);
    }
    for problem in problem_types() {
        components = components.schema(schema_name(problem.uri), problem_schema(&problem));
    }
    components
        .schema("PaymentRequest", payment_request())
        .schema("Payment", payment())
        .schema("PaymentList", payment_list())
        .schema("Invoice", invoice())
        .schema("Payout", payout())
        .schema("Health", health())
        .schema("PublishedPolicy", published_policy())
        .build()
}

/// The `Idempotency-Key` header, as `policy` accepts it.
fn key_parameter(policy: &Policy) -> Parameter {
    let limits = policy.key_limits;
    ParameterBuilder::new()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(Required::True)
        .description(Some(format!(
            "One key per intent, reused by every retry of it: {}-{} characters of visible ASCII (0x21-0x7E), as a bare token (Stripe's form; no `\"`, `,` or `;`) or an RFC 9651 sf-string (`\"...\"`, the IETF draft's form); both name the same key. Scoped to the authenticated account, remembered for {} s.",
            limits.min_len,
            limits.max_len,
            policy.retention.as_secs()
        )))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(limits.min_len))
                // The sf-string form: every character escaped, plus the two quotes.
                .max_length(Some(limits.max_len * 2 + 2))
                .pattern(Some(key_pattern(limits))),
        ))
        .build()
}

/// The headers answers refer to, by component name.
fn headers() -> [(&'static str, utoipa::openapi::Header); 4] {
    let header = |schema: ObjectBuilder, description: Option<&str>| {
        HeaderBuilder::new()
            .schema(Some(schema))
            .description(description)
            .build()
    };
    [
        (
            "IdempotentReplayed",
            header(
                string_enum(&["true"]),
                Some(
                    "Present on a replay: the stored answer of the key's first request; the work was not done again.",
                ),
            ),
        ),
        (
            "IdempotentReplay",
            header(
                string_enum(&["omitted"]),
                Some(
                    "On a replay whose original body was over the storage cap: status and headers as stored, empty body.",
                ),
            ),
        ),
        (
            "Location",
            header(string(), Some("The created payment, `/payments/{id}`.")),
        ),
        ("WwwAuthenticate", header(string_enum(&["Bearer"]), None)),
    ]
}

/// `POST /payments`.
fn create_payment() -> Operation {
    let created = json_answer(
        "The payment was made (or, with Idempotent-Replayed, made by the key's first request).",
        "Payment",
    )
    .header_ref("Location", header("Location"));
    let created = replayable(created).link(
        "GetPaymentById",
        LinkBuilder::new()
            .operation_id("getPayment")
            .parameter("id", "$response.body#/id")
            .description("The payment just created.")
            .build(),
    );
    covered_post(
        "createPayment",
        "Create a payment",
        "Charges `amount` minor units of `currency` once per Idempotency-Key: a retry with the same key and body replays the first answer.",
        created,
        &[ProblemKind::InUse.type_uri()],
        &[],
        true,
    )
    .build()
}

/// `GET /payments`.
fn list_payments() -> Operation {
    let operation = authenticated(
        "listPayments",
        "List the account's payments",
        "The authenticated account's payments, newest first, at most 100.",
    )
    .response("200", json_answer("The account's payments.", "PaymentList"));
    account_read(operation).build()
}

/// `GET /payments/{id}`.
fn get_payment() -> Operation {
    let operation = authenticated(
        "getPayment",
        "Show a payment",
        "Only the account that made the payment sees it; any other account gets 404.",
    )
    .parameter(
        ParameterBuilder::new()
            .name("id")
            .parameter_in(ParameterIn::Path)
            .required(Required::True)
            .description(Some(
                "The payment's id, as `POST /payments` returned it (`pay_…`).",
            ))
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .min_length(Some(1)),
            ))
            .build(),
    )
    .response("200", json_answer("The payment.", "Payment"))
    .response(
        "404",
        problem_response(
            "No such payment in this account.",
            &[ApiError::NOT_FOUND],
            false,
        ),
    );
    account_read(operation).build()
}

/// `POST /invoices`.
fn create_invoice() -> Operation {
    covered_post(
        "createInvoice",
        "Issue an invoice",
        "Issues the account's next invoice number, gapless: a retry with the same key gets the number already issued.",
        replayable(json_answer(
            "The invoice was issued (or, with Idempotent-Replayed, issued by the key's first request).",
            "Invoice",
        )),
        &[ProblemKind::InUse.type_uri()],
        &[],
        false,
    )
    .build()
}

/// `POST /payouts`: lease mode, with the provider's answers beside the layer's.
fn create_payout() -> Operation {
    covered_post(
        "createPayout",
        "Pay out through the payment provider",
        "Runs in lease mode: the key is claimed first, the provider is called with a key derived from it, and a payout whose outcome is unknown is reconciled with the provider before any retry runs.",
        replayable(json_answer(
            "The provider paid (or, with Idempotent-Replayed, paid for the key's first request).",
            "Payout",
        )),
        &[ProblemKind::InUse.type_uri(), ProblemKind::OutcomeUnknown.type_uri()],
        &[
            (
                "402",
                ResponseBuilder::new()
                    .description("The provider declined: a business outcome, stored and replayed.")
                    .content(PROBLEM_JSON, problem_content(&[ApiError::CARD_DECLINED]))
                    .header_ref("Idempotent-Replayed", header("IdempotentReplayed"))
                    .build(),
            ),
            (
                "502",
                retry_required(
                    "The provider could not be reached (nothing was sent), or it failed and the payout may have happened.",
                    &[ProblemKind::UpstreamUnavailable.type_uri(), ProblemKind::OutcomeUnknown.type_uri()],
                ),
            ),
            (
                "504",
                retry_required(
                    "The provider did not answer: the payout may have happened; it is reconciled with the provider.",
                    &[ProblemKind::OutcomeUnknown.type_uri()],
                ),
            ),
        ],
        false,
    )
    .build()
}

/// `GET /healthz`.
fn healthz() -> Operation {
    public("healthz", "Health", "Whether the database answers.")
        .response("200", json_answer("The database answers.", "Health"))
        .response(
            "503",
            json_answer("The database does not answer.", "Health"),
        )
        .build()
}

/// `GET /metrics`.
fn metrics() -> Operation {
    public(
        "metrics",
        "Prometheus metrics",
        "The process's metrics in the Prometheus text format.",
    )
    .response(
        "200",
        ResponseBuilder::new().description("The metrics.").content(
            "text/plain",
            ContentBuilder::new().schema(Some(string())).build(),
        ),
    )
    .build()
}

/// `GET /idempotency-policy`.
fn idempotency_policy() -> Operation {
    public(
        "getIdempotencyPolicy",
        "The published idempotency rules",
        "Header name, key format, scope, covered methods, retention, mismatch and in-flight behaviour.",
    )
    .response(
        "200",
        json_answer("The rules this server applies.", "PublishedPolicy"),
    )
    .build()
}

/// `GET /openapi.json`.
fn openapi_json() -> Operation {
    public(
        "getOpenApi",
        "This document",
        "The OpenAPI 3.1 document of this server.",
    )
    .response(
        "200",
        ResponseBuilder::new().description("The document.").content(
            JSON,
            ContentBuilder::new()
                .schema(Some(ObjectBuilder::new().schema_type(Type::Object)))
                .build(),
        ),
    )
    .build()
}

/// An operation that needs the bearer token.
fn authenticated(id: &str, summary: &str, description: &str) -> OperationBuilder {
    public(id, summary, description).security(SecurityRequirement::new("bearer", [""; 0]))
}

/// An operation anyone may call.
fn public(id: &str, summary: &str, description: &str) -> OperationBuilder {
    OperationBuilder::new()
        .operation_id(Some(id))
        .summary(Some(summary))
        .description(Some(description))
}

/// A POST behind authentication and the idempotency layer: its `success` (`201`), the
/// problems its `409` may carry, the route's own `extra` answers, and every answer of the
/// layer. `internal` adds the `500` of a payment that could not be recorded.
fn covered_post(
    id: &str,
    summary: &str,
    description: &str,
    success: ResponseBuilder,
    conflict: &[&str],
    extra: &[(&str, utoipa::openapi::Response)],
    internal: bool,
) -> OperationBuilder {
    let mut responses = ResponsesBuilder::new()
        .response("201", success)
        .response(
            "400",
            problem_response(
                "The key is missing or malformed, the body cannot be fingerprinted, or the request is invalid. Nothing was stored: fix the request and retry with the same key.",
                &[ProblemKind::MissingKey.type_uri(), ProblemKind::MalformedKey.type_uri(), ProblemKind::MalformedBody.type_uri(), ApiError::VALIDATION],
                false,
            )
            .header("Link", policy_link()),
        )
        .response("401", unauthorized())
        .response("408", problem_response("The body did not arrive in time.", &[ProblemKind::BodyTimeout.type_uri()], false))
        .response(
            "409",
            problem_response("The key's original request is still running or being reconciled.", conflict, true)
                .header("Link", policy_link())
                .build(),
        )
        .response("413", problem_response("The body is over the limit.", &[ProblemKind::BodyTooLarge.type_uri()], false))
        .response(
            "422",
            problem_response("The key was used for a different request.", &[ProblemKind::Mismatch.type_uri()], false)
                .header("Link", policy_link()),
        )
        .response("503", retry_required("The database is unavailable; nothing was done.", &[ProblemKind::StoreUnavailable.type_uri()]));
    for (status, response) in extra {
        responses = responses.response(*status, response.clone());
    }
    // Any handler can fail unexpectedly (a panic); payments also say when they could not be
    // recorded.
    let (failed, failures): (&str, &[&str]) = if internal {
        (
            "The payment could not be recorded, or the handler failed unexpectedly; nothing was charged or stored.",
            &[ApiError::INTERNAL, ProblemKind::HandlerFailed.type_uri()],
        )
    } else {
        (
            "The handler failed unexpectedly; nothing was stored.",
            &[ProblemKind::HandlerFailed.type_uri()],
        )
    };
    responses = responses.response("500", problem_response(failed, failures, false));
    authenticated(id, summary, description)
        .parameter_ref(Ref::new("#/components/parameters/IdempotencyKey"))
        .request_body(Some(
            RequestBodyBuilder::new()
                .required(Some(Required::True))
                .content(JSON, content_ref("PaymentRequest"))
                .build(),
        ))
        .responses(responses.build())
}

/// `response` with the headers that mark a replay.
fn replayable(response: ResponseBuilder) -> ResponseBuilder {
    response
        .header_ref("Idempotent-Replayed", header("IdempotentReplayed"))
        .header_ref("Idempotent-Replay", header("IdempotentReplay"))
}

/// An answer whose body is the JSON schema named `schema`.
fn json_answer(description: &str, schema: &str) -> ResponseBuilder {
    ResponseBuilder::new()
        .description(description)
        .content(JSON, content_ref(schema))
}

fn unauthorized() -> ResponseBuilder {
    ResponseBuilder::new()
        .description("No registered bearer token.")
        .content(PROBLEM_JSON, problem_content(&[ApiError::UNAUTHORIZED]))
        .header_ref("WWW-Authenticate", header("WwwAuthenticate"))
}

/// A read of the account's data: with the `401` of a missing token and the `503` of a
/// database that does not answer.
fn account_read(operation: OperationBuilder) -> OperationBuilder {
    operation.response("401", unauthorized()).response(
        "503",
        problem_response(
            "The database is unavailable.",
            &[ProblemKind::StoreUnavailable.type_uri()],
            true,
        ),
    )
}

/// A problem answer that always carries `Retry-After`.
fn retry_required(description: &str, types: &[&str]) -> utoipa::openapi::Response {
    problem_response(description, types, true).build()
}

/// A problem answer whose `type` is one of `types`.
fn problem_response(description: &str, types: &[&str], retry: bool) -> ResponseBuilder {
    let response = ResponseBuilder::new()
        .description(description)
        .content(PROBLEM_JSON, problem_content(types));
    if retry {
        response.header("Retry-After", retry_after(true))
    } else {
        response
    }
}

/// `Link: </idempotency-policy>; rel="describedby"`, on the idempotency layer's own refusals
/// (not on the service's validation 400).
fn policy_link() -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(Some(string()))
        .description(Some(
            "On the idempotency layer's own refusals: `</idempotency-policy>; rel=\"describedby\"`, where the rules are published.",
        ))
        .extensions(Some(Extensions::from_iter([("required", false)])))
        .build()
}

fn retry_after(required: bool) -> utoipa::openapi::Header {
    // utoipa 6's Header has no `required` field, and its extensions are written flat into the
    // object, so they carry the member OpenAPI defines.
    HeaderBuilder::new()
        .schema(Some(integer(1)))
        .description(Some("Seconds to wait before retrying with the same key."))
        .extensions(Some(Extensions::from_iter([("required", required)])))
        .build()
}

/// The content of a problem answer whose `type` is one of `types`.
fn problem_content(types: &[&str]) -> utoipa::openapi::Content {
    let schema: RefOr<Schema> = match types {
        [one] => schema_ref(&schema_name(one)),
        many => many
            .iter()
            .fold(OneOfBuilder::new(), |one_of, uri| {
                one_of.item(schema_ref(&schema_name(uri)))
            })
            .into(),
    };
    ContentBuilder::new().schema(Some(schema)).build()
}

fn content_ref(schema: &str) -> utoipa::openapi::Content {
    ContentBuilder::new()
        .schema(Some(schema_ref(schema)))
        .build()
}

fn schema_ref(name: &str) -> RefOr<Schema> {
    RefOr::Ref(Ref::from_schema_name(name))
}

fn header(name: &str) -> Ref {
    Ref::new(format!("#/components/headers/{name}"))
}

/// An RFC 9457 problem-details document whose `type` is `problem.uri` and whose `status` is
/// one of `problem.statuses`.
fn problem_schema(problem: &ProblemType) -> ObjectBuilder {
    object(&["type", "title", "status", "detail"])
        .description(Some(problem.description))
        .property(
            "type",
            string_enum(&[problem.uri]).description(Some("The problem type, stable per case.")),
        )
        .property(
            "title",
            string().description(Some("A summary of the problem type.")),
        )
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .enum_values(Some(problem.statuses.iter().copied())),
        )
        .property(
            "detail",
            string().description(Some("What happened this time.")),
        )
}

fn payment_request() -> ObjectBuilder {
    object(&["amount", "currency"])
        .description(Some("What to charge. Other members are ignored, but they are part of the request's fingerprint."))
        .property(
            "amount",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1))
                .maximum(Some(i64::MAX))
                .description(Some("Minor units (paise, cents), a positive integer.")),
        )
        .property(
            "currency",
            currency().description(Some("Three capital letters, such as INR.")),
        )
        .property(
            "reference",
            ObjectBuilder::new()
                .schema_type([Type::String, Type::Null].into_iter().collect::<utoipa::openapi::schema::SchemaType>())
                .max_length(Some(255))
                .pattern(Some("^[^\\u0000]*$"))
                .description(Some("The caller's own reference, kept with the payment: at most 255 characters, none of them NUL.")),
        )
        .examples([json!({"amount": 49900, "currency": "INR"})])
}

fn payment() -> ObjectBuilder {
    object(&["id", "amount", "currency", "status", "created_at"])
        .property("id", string().description(Some("`pay_` and a UUIDv7.")))
        .property("amount", integer(1))
        .property("currency", currency())
        .property("status", string_enum(&["succeeded"]))
        .property("reference", string())
        .property(
            "created_at",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .description(Some("Milliseconds since the Unix epoch.")),
        )
}

fn payment_list() -> ObjectBuilder {
    object(&["data"]).property(
        "data",
        ArrayBuilder::new()
            .items(schema_ref("Payment"))
            .max_items(Some(100)),
    )
}

fn invoice() -> ObjectBuilder {
    object(&["id", "number", "amount", "currency", "created_at"])
        .property("id", string().description(Some("`inv_` and a UUIDv7.")))
        .property(
            "number",
            integer(1).description(Some("The account's invoice number: 1, 2, 3… without gaps.")),
        )
        .property("amount", integer(1))
        .property("currency", currency())
        .property(
            "created_at",
            ObjectBuilder::new().schema_type(Type::Integer),
        )
}

fn payout() -> ObjectBuilder {
    object(&["id", "amount", "currency", "status", "provider_charge"])
        .property(
            "id",
            string().description(Some("`po_` and the provider's charge id.")),
        )
        .property("amount", integer(1))
        .property("currency", currency())
        .property("status", string_enum(&["paid"]))
        .property("provider_charge", string())
}

fn health() -> ObjectBuilder {
    object(&["status"])
        .property("status", string_enum(&["ok", "unavailable"]))
        .property(
            "error",
            string().description(Some("Why the database does not answer.")),
        )
}

fn published_policy() -> ObjectBuilder {
    let strings = [
        "header",
        "key_format",
        "scope",
        "fingerprint",
        "mismatch",
        "in_flight",
        "replay_header",
        "stored_outcomes",
    ];
    let integers = [
        "key_min_length",
        "key_max_length",
        "retention_seconds",
        "request_body_limit_bytes",
        "response_storage_cap_bytes",
    ];
    let mut policy = ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("The idempotency rules, as README.md explains them."))
        .additional_properties(Some(AdditionalProperties::FreeForm(true)));
    for name in strings {
        policy = policy.property(name, string()).required(name);
    }
    for name in integers {
        policy = policy.property(name, integer(0)).required(name);
    }
    policy
        .property(
            "key_required",
            ObjectBuilder::new().schema_type(Type::Boolean),
        )
        .required("key_required")
        .property("covered_methods", ArrayBuilder::new().items(string()))
        .required("covered_methods")
        .property("unstored_statuses", ArrayBuilder::new().items(integer(100)))
        .required("unstored_statuses")
}

fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

fn string_enum(values: &[&str]) -> ObjectBuilder {
    string().enum_values(Some(values.iter().copied()))
}

/// A currency code: three capital letters.
fn currency() -> ObjectBuilder {
    string().pattern(Some("^[A-Z]{3}$"))
}

/// An object schema whose `required` list is `names`, in this order (the builder keeps it
/// apart from the properties, so it can be given first, as a summary of the shape).
fn object(names: &[&str]) -> ObjectBuilder {
    names.iter().fold(
        ObjectBuilder::new().schema_type(Type::Object),
        |object, name| object.required(*name),
    )
}

fn integer(minimum: i64) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(minimum))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_the_layer_is_described_or_named_as_not_answered_here() {
        for kind in ProblemKind::ALL {
            assert_ne!(
                layer_description(kind).is_some(),
                NOT_ANSWERED_HERE.contains(&kind),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn the_problem_types_are_those_the_document_has_always_listed() {
        let listed: Vec<(String, String, Vec<u16>)> = problem_types()
            .into_iter()
            .map(|problem| {
                let statuses = problem.statuses.into_iter().collect();
                (schema_name(problem.uri), problem.uri.to_owned(), statuses)
            })
            .collect();
        let before = [
            ("BodyTimeoutProblem", "body-timeout", &[408][..]),
            ("BodyTooLargeProblem", "body-too-large", &[413]),
            ("CardDeclinedProblem", "card-declined", &[402]),
            ("HandlerFailedProblem", "handler-failed", &[500]),
            ("InUseProblem", "in-use", &[409]),
            ("InternalProblem", "internal", &[500]),
            ("MalformedBodyProblem", "malformed-body", &[400]),
            ("MalformedKeyProblem", "malformed-key", &[400]),
            ("MismatchProblem", "mismatch", &[422]),
            ("MissingKeyProblem", "missing-key", &[400]),
            ("NotFoundProblem", "not-found", &[404]),
            ("OutcomeUnknownProblem", "outcome-unknown", &[409, 502, 504]),
            ("StoreUnavailableProblem", "store-unavailable", &[503]),
            ("UnauthorizedProblem", "unauthorized", &[401]),
            ("UpstreamUnavailableProblem", "upstream-unavailable", &[502]),
            ("ValidationProblem", "validation", &[400]),
        ]
        .map(|(schema, name, statuses)| {
            (
                schema.to_owned(),
                format!("urn:idem:problem:{name}"),
                statuses.to_vec(),
            )
        });
        assert_eq!(listed, before);
    }
}
