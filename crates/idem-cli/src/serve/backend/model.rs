//! What the service stores: payments, invoices, and the worker's receipts.

use serde::Serialize;

/// A payment as stored and as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Payment {
    pub(crate) id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reference: Option<String>,
    pub(crate) created_at: i64,
}

/// An invoice.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Invoice {
    pub(crate) id: String,
    pub(crate) number: i64,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) created_at: i64,
}

/// A receipt: the worker's side effect for one `payment.succeeded` event.
#[derive(Debug, Clone)]
pub(crate) struct Receipt {
    pub(crate) event_id: String,
    pub(crate) payment_id: String,
    pub(crate) account_id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) created_at: i64,
}
