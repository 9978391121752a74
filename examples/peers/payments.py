"""The in-memory payments handler every gallery app puts behind its idempotency package.

Kept identical across the apps (express/app.js is the same in JavaScript), so the drill
measures the packages, not the handlers:

- accounts by bearer token: sk_test_alice -> acct_alice, sk_test_bob -> acct_bob, others 401;
- POST /payments {"amount": 49900, "currency": "INR"}: the amount a positive integer, the
  currency three capital letters (else 400); a provider call of PROVIDER_DELAY_MS (default
  100 ms, as a payment provider takes), then 201 {"id": "pay_...", "amount", "currency",
  "status": "succeeded"}; the currency XTS (ISO 4217's code for tests) makes the provider
  fail: 500 {"error": "provider failed"} and nothing is stored;
- GET /payments/{id}: the payment, to its own account only (else 404).
"""
import os
import re
import threading
import uuid

TOKENS = {"sk_test_alice": "acct_alice", "sk_test_bob": "acct_bob"}
PROVIDER_DELAY = int(os.environ.get("PROVIDER_DELAY_MS", "100")) / 1000
FAILING_CURRENCY = "XTS"

_payments = {}
_lock = threading.Lock()


def account(authorization):
    """The account a bearer token names, or None."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return TOKENS.get(authorization[len("Bearer "):].strip())


def validate(body):
    """An error message for a payment body the API refuses, else None."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    amount, currency = body.get("amount"), body.get("currency")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        return "amount must be a positive integer"
    if not isinstance(currency, str) or not re.fullmatch(r"[A-Z]{3}", currency):
        return "currency must be three capital letters"
    return None


def charge(acct, body):
    """After the provider call: (201, payment) or (500, error). `body` is valid."""
    if body["currency"] == FAILING_CURRENCY:
        return 500, {"error": "provider failed"}
    payment = {
        "id": f"pay_{uuid.uuid4().hex}",
        "amount": body["amount"],
        "currency": body["currency"],
        "status": "succeeded",
    }
    with _lock:
        _payments[payment["id"]] = (acct, payment)
    return 201, payment


def show(acct, payment_id):
    """(200, payment) for its own account, else (404, error)."""
    with _lock:
        owner, payment = _payments.get(payment_id, (None, None))
    if owner != acct:
        return 404, {"error": "no such payment"}
    return 200, payment


def count():
    """Payments made so far."""
    with _lock:
        return len(_payments)
