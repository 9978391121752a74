"""stripe-python against idem proxy: run by scripts/stripe_sdks.sh as

    python check.py PROXY_URL UPSTREAM_URL stripe|problem

With `--errors stripe`, idem's 409 (key in use, after the SDK's own retries) and 422 (key
reused with another body) must raise an error made from idem's `error` member: stripe-python
16 makes an IdempotencyError only of a 400 or 404, so these are APIErrors whose `error.type`
is "idempotency_error", with idem's detail as the message. With problem details alone,
stripe-python cannot read the body as an error and raises a generic APIError ("Invalid
response object"): checked too, as the reason the dialect exists.
"""

import json
import os
import sys
import threading
import time
import urllib.request

import stripe

proxy_url, upstream_url, dialect = sys.argv[1:4]


def upstream(path, method="GET"):
    request = urllib.request.Request(upstream_url + path, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request) as response:
        return json.load(response)


client = stripe.StripeClient(
    "sk_test_idem_sdk_check",
    base_addresses={"api": proxy_url},
    max_network_retries=2,
)
key = f"sdk-python-{dialect}-{time.time_ns()}-{os.getpid()}"
params = {"amount": 4200, "currency": "usd", "description": "hold"}


def create(overrides=None):
    return client.v1.charges.create(params={**params, **(overrides or {})}, options={"idempotency_key": key})


# The original is held at the upstream; the duplicate finds the key in use.
result = {}
original = threading.Thread(target=lambda: result.update(charge=create()))
original.start()
while not upstream(f"/__calls?key={key}")["held"]:
    time.sleep(0.02)
started = time.monotonic()
try:
    create()
    in_use = None
except stripe.StripeError as error:
    in_use = error
in_use_seconds = time.monotonic() - started
upstream(f"/__release?key={key}", "POST")
original.join()
charge = result["charge"]
assert charge.object == "charge", charge



def check_raised(error, status):
    assert type(error) is stripe.APIError, f"{status} raised {type(error).__name__}: {error}"
    assert error.http_status == status, error.http_status
    if dialect == "stripe":
        assert error.error is not None and error.error.type == "idempotency_error", error.json_body
    else:
        assert error.error is None and "Invalid response object" in str(error), error


check_raised(in_use, 409)

replay = create()
assert replay.id == charge.id, (replay.id, charge.id)
assert replay.last_response.headers["Idempotent-Replayed"] == "true"
assert replay.last_response.request_id == charge.last_response.request_id

try:
    create({"amount": 4300})
    mismatch = None
except stripe.StripeError as error:
    mismatch = error
check_raised(mismatch, 422)

calls = upstream(f"/__calls?key={key}")["calls"]
assert calls == 1, f"the upstream saw {calls} charges for one key"
print(
    f"stripe-python {stripe.VERSION} ({dialect}): 409 after retries ({in_use_seconds:.1f} s) -> "
    f"{type(in_use).__name__}; 422 -> {type(mismatch).__name__}; replay {replay.id} with request id "
    f"{replay.last_response.request_id}; upstream calls {calls}"
)
