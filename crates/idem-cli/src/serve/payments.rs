//! The payments API: create (idempotent, in the key's transaction), show, list.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::{AccountId, Scope};
use idem_tower::Tx;
use serde_json::Value;

use super::app::App;
use super::backend::{Backend, Payment};
use super::error::ApiError;
use crate::runtime::PAYMENTS_TOPIC;

/// A validated payment request.
pub(crate) struct NewPayment {
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) reference: Option<String>,
}

/// Validates `{"amount": <positive integer>, "currency": "<3 capital letters>"}` with an
/// optional `"reference"` string of at most 255 characters, none of them NUL.
pub(crate) fn parse_request(body: &[u8]) -> Result<NewPayment, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    /// The amount as written, so that an integer written with a fraction or an exponent
    /// (`48.0`, `4.8e1`: JSON Schema's `integer` admits both) is read exactly, never through
    /// a float that would round `9007199254740993.0`.
    #[derive(serde::Deserialize)]
    struct AmountText<'a> {
        #[serde(borrow)]
        amount: Option<&'a serde_json::value::RawValue>,
    }
    let amount = serde_json::from_slice::<AmountText>(body)
        .ok()
        .and_then(|text| text.amount)
        .and_then(|raw| integral(raw.get()))
        .filter(|a| *a > 0)
        // A string ("1") or a fraction (1.5) is refused: amounts are integers in minor units.
        .ok_or("amount must be a positive integer (minor units)")?;
    let currency = value
        .get("currency")
        .and_then(Value::as_str)
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))
        .ok_or("currency must be three capital letters, such as \"INR\"")?;
    let reference = match value.get("reference") {
        None | Some(Value::Null) => None,
        // Characters, not bytes, as the published schema's maxLength counts them. NUL is
        // refused because PostgreSQL's text cannot hold it (the insert would fail with 500).
        Some(Value::String(r)) if r.chars().count() <= 255 && !r.contains('\0') => Some(r.clone()),
        Some(_) => {
            return Err("reference must be a string of at most 255 characters, without NUL".into());
        }
    };
    Ok(NewPayment {
        amount,
        currency: currency.to_owned(),
        reference,
    })
}

/// The integer a JSON number's text names exactly (`48`, `48.0`, `4.8e1`, `480e-1`), or `None`
/// for a fraction, a number out of `i64`'s range, or anything that is not a number. Written
/// by hand because a float would round large amounts, and `serde_json`'s exact numbers
/// (`arbitrary_precision`) would change every other number the service parses.
fn integral(text: &str) -> Option<i64> {
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.strip_prefix('+').unwrap_or(e).parse::<i32>().ok()?),
        None => (text, 0),
    };
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let digits = format!("{whole}{fraction}");
    let digits = digits.trim_start_matches('0');
    // The value is `digits` × 10^scale.
    let scale = i64::from(exponent) - fraction.len() as i64;
    let digits = if scale >= 0 {
        if digits.len() as i64 + scale > 19 {
            return (digits.is_empty()).then_some(0);
        }
        format!("{digits}{}", "0".repeat(scale as usize))
    } else {
        let cut = digits.len().checked_sub(scale.unsigned_abs() as usize);
        match cut {
            Some(cut) if digits[cut..].bytes().all(|b| b == b'0') => digits[..cut].to_owned(),
            // Fewer digits than the scale removes: only zero is an integer then.
            None if digits.bytes().all(|b| b == b'0') => String::new(),
            _ => return None,
        }
    };
    let magnitude: i64 = if digits.is_empty() {
        0
    } else {
        digits.parse().ok()?
    };
    Some(if negative { -magnitude } else { magnitude })
}

/// `POST /payments`. With a key it runs inside the transaction the idempotency layer opened,
/// so the payment and the key's stored response commit together. Without one (only when the
/// service runs with `--key-optional`, for experiments) it opens its own.
pub(crate) async fn create<B: Backend>(
    State(app): State<App<B>>,
    Extension(account): Extension<AccountId>,
    scope: Option<Extension<Scope>>,
    tx: Option<Tx<B::Tx>>,
    body: Bytes,
) -> Response {
    let request = match parse_request(&body) {
        Ok(parsed) => parsed,
        Err(detail) => return ApiError::Invalid(detail).into_response(),
    };
    let payment = Payment {
        id: format!("pay_{}", uuid::Uuid::now_v7().simple()),
        amount: request.amount,
        currency: request.currency,
        reference: request.reference,
        status: "succeeded".into(),
        created_at: app.clock.now().0,
    };
    let key = scope.as_ref().map(|Extension(scope)| scope.key.as_str());
    let retired_before = payment.created_at - app.policy.retention.as_millis() as i64;
    // With a broker, the payment announces itself through the outbox, in its own transaction:
    // no event for a payment that rolled back, no payment without its event.
    let event = app
        .outbox
        .then(|| payment_succeeded(account.as_str(), &payment));
    let event = event.as_ref();
    let row = PaymentRow {
        account: account.as_str(),
        key,
        retired_before,
        payment: &payment,
        event,
    };
    let inserted = match tx {
        Some(mut tx) => row.insert::<B>(&mut tx).await,
        None => row.insert_alone(&app.store).await,
    };
    if let Err(e) = inserted {
        // A unique violation here means the idempotency layer let a duplicate through: the
        // safety net held. Either way nothing is committed (5xx rolls back).
        let safety_net = e.is_unique_violation();
        tracing::error!(error = %e, safety_net, "inserting a payment failed");
        if matches!(e, idem_store::Error::Unavailable(_)) {
            return ApiError::StoreUnavailable.into_response();
        }
        return ApiError::NotRecorded.into_response();
    }
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{}", payment.id))],
        Json(payment),
    )
        .into_response()
}

/// What [`Backend::insert_payment`] writes for one payment.
struct PaymentRow<'a> {
    account: &'a str,
    key: Option<&'a str>,
    retired_before: i64,
    payment: &'a Payment,
    event: Option<&'a idem_consumer::Message>,
}

impl PaymentRow<'_> {
    /// Inserts the payment (and its event) in `tx`.
    async fn insert<B: Backend>(&self, tx: &mut B::Tx) -> idem_store::Result<()> {
        B::insert_payment(
            tx,
            self.account,
            self.key,
            self.retired_before,
            self.payment,
            self.event,
        )
        .await
    }

    /// Inserts the payment (and its event) in a transaction of its own: a request without a
    /// key has none from the layer.
    async fn insert_alone<B: Backend>(&self, store: &B) -> idem_store::Result<()> {
        let mut own = store.begin().await?;
        self.insert::<B>(&mut own).await?;
        B::commit(own).await
    }
}

/// The `payment.succeeded` event of `payment`. Its id derives from the payment's, so it is
/// fixed when the payment is created and names exactly one payment.
pub(crate) fn payment_succeeded(account: &str, payment: &Payment) -> idem_consumer::Message {
    let payload = serde_json::json!({
        "type": "payment.succeeded",
        "payment_id": payment.id,
        "account_id": account,
        "amount": payment.amount,
        "currency": payment.currency,
        "created_at": payment.created_at,
    });
    idem_consumer::Message {
        id: idem_consumer::EventId::new(format!("{}.succeeded", payment.id))
            .expect("payment ids are short visible ASCII"),
        topic: PAYMENTS_TOPIC.to_owned(),
        payload: payload.to_string().into_bytes(),
    }
}

/// [`ApiError::StoreUnavailable`] for `e`, which it logs: the database could not be reached,
/// nothing was done.
pub(crate) fn database_error(e: impl Into<idem_store::Error>) -> ApiError {
    let e = e.into();
    tracing::error!(error = &e as &dyn std::error::Error, "the database failed");
    ApiError::StoreUnavailable
}

/// `GET /payments/{id}`: only the owning account sees a payment; others get `404`.
pub(crate) async fn show<B: Backend>(
    State(app): State<App<B>>,
    Extension(account): Extension<AccountId>,
    Path(id): Path<String>,
) -> Response {
    match app.store.find_payment(account.as_str(), &id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => ApiError::NotFound { id }.into_response(),
        Err(e) => database_error(e).into_response(),
    }
}

/// `GET /payments`: the account's payments, newest first (at most 100).
pub(crate) async fn list<B: Backend>(
    State(app): State<App<B>>,
    Extension(account): Extension<AccountId>,
) -> Response {
    match app.store.list_payments(account.as_str(), 100).await {
        Ok(data) => Json(serde_json::json!({ "data": data })).into_response(),
        Err(e) => database_error(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_integer_is_read_exactly_however_it_is_written() {
        for (text, value) in [
            ("48", Some(48)),
            ("48.0", Some(48)),
            ("48.000", Some(48)),
            ("4.8e1", Some(48)),
            ("4.8E+1", Some(48)),
            ("480e-1", Some(48)),
            ("0.0", Some(0)),
            ("-3.0", Some(-3)),
            ("9007199254740993.0", Some(9_007_199_254_740_993)),
            ("9223372036854775807", Some(i64::MAX)),
            ("9223372036854775808", None),
            ("1e300", None),
            ("48.5", None),
            ("4.85e1", None),
            ("\"48\"", None),
            ("null", None),
            (".5", None),
        ] {
            assert_eq!(integral(text), value, "{text}");
        }
    }

    #[test]
    fn a_schema_valid_whole_float_amount_is_accepted() {
        let payment = parse_request(br#"{"amount": 48.0, "currency": "INR"}"#).unwrap();
        assert_eq!(payment.amount, 48);
        for refused in [
            r#"{"amount": 48.5, "currency": "INR"}"#,
            r#"{"amount": "48", "currency": "INR"}"#,
            r#"{"amount": 0.0, "currency": "INR"}"#,
        ] {
            assert!(parse_request(refused.as_bytes()).is_err(), "{refused}");
        }
    }
}
